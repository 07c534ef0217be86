"""ZeRO-1: a pipeline stage's optimizer state sharded over the stage's DP x CP ranks [Rajbhandari et al. 2020].

Every rank of a stage holds the same weights and, once PipelineSchedule has reduced them, the same gradients. AdamW
(like SGD, Adam, ...) acts on each element alone, so the N elements of the stage's parameters, laid end to end in one
flat vector, can be cut into n slices of ceil(N / n) and rank r steps only its slice:

    theta[lo_r:hi_r] <- opt_step(theta[lo_r:hi_r], g[lo_r:hi_r], state_r)       state_r: m, v of the slice only
    theta            <- all_gather_r theta[lo_r:hi_r]                              every rank: the full updated weights

Each rank needs only its slice of the reduced gradient, so with flat_grads (what DistCotrainer's --zero1 uses) the
gradients accumulate in views of one flat buffer and one reduce_scatter over the group hands each rank its slice of
their sum (divided by dp: the mean over replicas of the sum over CP shards) -- half an all-reduce's traffic, no copy:

    g[lo_r:hi_r] <- reduce_scatter_r (sum over the group of each rank's g) / dp

The same arithmetic as the unsharded optimizer, element for element (tests/test_zero1.py: fp64 <= 1e-10); per rank the
optimizer state and the master slice cost 1/n of the unsharded (for AdamW in fp32: 8 B -> 8/n B per parameter, plus
4/n B for the master slice). The parameters become views of one flat buffer (padded to n slices), so the all-gather
writes the weights in place: no transient copy of the stage.

Mixed precision (modeling/mixed_precision.py) is the same object with master_dtype=float32 over 16-bit parameters:
the slice's master weights and optimizer state are fp32, the gradient is read from each parameter's fp32 .main_grad
accumulator when it has one, and the updated slice is rounded to the parameters' dtype as it is gathered. With n = 1
(group None) that is plain fp32-master mixed precision.

    opt = ShardedOptimizer(stage.parameters(), lambda ps: torch.optim.AdamW(ps, lr=1e-4), group=grid.stage_group)
    opt.zero_grad(); loss.backward(); <reduce grads>; opt.step()

Checkpoints: state_dict() is this rank's slice (its master weights and optimizer state) with the layout it was cut
for; load_state_dict refuses another layout (another dp x cp or another model), naming both.

Letters: N elements of the stage's parameters, n ranks sharing the stage, r this rank's index among them.
"""
from __future__ import annotations

import math

import torch
import torch.distributed as dist


class ShardedOptimizer:
    """make_opt(params) -> a torch optimizer with elementwise updates; group: the ranks that hold the same stage and
    gradients (None or a group of one: no sharding, the same code path); master_dtype: the master slice's and the
    optimizer state's dtype (None: the parameters'); dtype: the parameters' working dtype from now on (None: as
    they are), the masters taken from their values before the cast."""

    def __init__(self, params, make_opt, group=None, master_dtype=None, dtype=None, flat_grads: bool = False):
        self.params = [p for p in params if p.requires_grad]
        if not self.params:
            raise ValueError("params: expected at least one parameter that requires grad")
        dtypes = {p.dtype for p in self.params}
        if len(dtypes) != 1:
            raise ValueError(f"params: expected one dtype, got {sorted(map(str, dtypes))}")
        self.group = group
        self.n = dist.get_world_size(group) if group is not None else 1
        self.r = dist.get_rank(group) if group is not None else 0
        self.numel = sum(p.numel() for p in self.params)  # N
        self.per = math.ceil(self.numel / self.n)  # elements per slice (the last one padded)
        self.lo, self.hi = self.r * self.per, min(self.numel, (self.r + 1) * self.per)
        master = self._slice([p.detach() for p in self.params], master_dtype or self.params[0].dtype)  # (per,)
        self.flat = self._flatten(dtype or self.params[0].dtype)  # (n * per,) the parameters are views of it
        self.master = torch.nn.Parameter(master)
        self.inner = make_opt([self.master])
        self.param_groups = self.inner.param_groups  # lr schedules and logging read these
        self.grad_flat = self.grad_slice = None  # flat_grads: (n * per,) accumulators and this rank's reduced (per,)
        if flat_grads:  # each parameter's .main_grad a view of one flat buffer: reduce_scatter reads it in place
            self.grad_flat = torch.zeros(self.n * self.per, dtype=self.master.dtype, device=self.flat.device)
            for p, (a, b) in zip(self.params, self.ranges()):
                p.main_grad = self.grad_flat[a:b].view_as(p)
            self.grad_slice = torch.zeros(self.per, dtype=self.master.dtype, device=self.flat.device)
        self._reduced = False  # this step's gradient is grad_slice, reduced (reduce_scatter), not the parameters'

    @torch.no_grad()
    def reduce_scatter(self, dp: int = 1):
        """The stage's gradient summed over the group, each rank receiving its own slice only (grad_slice), then /dp:
        the mean over DP replicas of the sum over CP shards that an all-reduce over CP and DP gives, at half its
        traffic and with no copy of the gradients (they are views of grad_flat). The parameters' .main_grad keep
        this rank's own, unreduced values: step() reads grad_slice, and gathered_grads() shows the reduced whole."""
        dist.reduce_scatter_tensor(self.grad_slice, self.grad_flat, group=self.group)
        if dp > 1:
            self.grad_slice /= dp
        self._reduced = True

    @torch.no_grad()
    def gathered_grads(self):
        """The reduced gradient written back into every parameter's .main_grad (an all_gather of the slices): what a
        check reads after reduce_scatter. Collective over the group."""
        dist.all_gather_into_tensor(self.grad_flat, self.grad_slice, group=self.group)

    def ranges(self) -> list:
        """[lo, hi) of each parameter in the flat vector, in self.params' order."""
        out, at = [], 0
        for p in self.params:
            out.append((at, at + p.numel()))
            at += p.numel()
        return out

    def _flatten(self, dtype) -> torch.Tensor:  # the parameters moved into one flat buffer, each now a view of it
        flat = torch.zeros(self.n * self.per, dtype=dtype, device=self.params[0].device)
        for p, (a, b) in zip(self.params, self.ranges()):
            flat[a:b].copy_(p.detach().reshape(-1))
            p.data = flat[a:b].view_as(p)
        return flat

    def _slice(self, tensors, dtype) -> torch.Tensor:  # (per,) elements [lo, hi) of the tensors end to end, 0-padded
        out = torch.zeros(self.per, dtype=dtype, device=self.params[0].device)
        for t, (at, end) in zip(tensors, self.ranges()):
            a, b = max(at, self.lo), min(end, self.hi)
            if a < b:
                out[a - self.lo:b - self.lo].copy_(t.reshape(-1)[a - at:b - at])
        return out

    def _grad_slice(self) -> torch.Tensor:  # (per,) g[lo:hi] (each parameter's .main_grad if it has one)
        grads = [getattr(p, "main_grad", p.grad) for p in self.params]
        missing = [i for i, g in enumerate(grads) if g is None]
        if missing:  # a zero gradient would still move AdamW's moments and weight decay; torch skips such a tensor
            raise ValueError(f"ShardedOptimizer.step: parameters {missing} (of {len(self.params)}) have no gradient; "
                             f"ZeRO-1 steps every element, so every parameter needs one (or requires_grad=False)")
        return self._slice(grads, self.master.dtype)

    @torch.no_grad()
    def step(self):
        self.master.grad = self.grad_slice if self._reduced else self._grad_slice()
        self._reduced = False
        self.inner.step()
        self.master.grad = None
        if self.n == 1:
            self.flat.copy_(self.master)
            return
        # every rank's updated slice into its place in the flat buffer, i.e. straight into the parameters
        dist.all_gather(list(self.flat.split(self.per)), self.master.detach().to(self.flat.dtype), group=self.group)

    def zero_grad(self, set_to_none: bool = True):
        self._reduced = False
        for p in self.params:
            if hasattr(p, "main_grad"):
                p.main_grad.zero_()
            if set_to_none:
                p.grad = None
            elif p.grad is not None:
                p.grad.zero_()

    def _layout(self) -> dict:
        return {"ranks": self.n, "rank": self.r, "numel": self.numel, "shapes": [list(p.shape) for p in self.params],
                "master_dtype": str(self.master.dtype).replace("torch.", "")}

    def state_dict(self) -> dict:
        return {"layout": self._layout(), "master": self.master.detach().clone(), "inner": self.inner.state_dict()}

    @torch.no_grad()
    def load_state_dict(self, sd: dict):
        if not isinstance(sd, dict) or "layout" not in sd:
            raise ValueError("state_dict: expected a ShardedOptimizer state (--zero1); this one is unsharded "
                             "(saved without --zero1?)")
        if sd["layout"] != self._layout():
            saved, mine = sd["layout"], self._layout()
            raise ValueError(f"state_dict: sharded for {saved['ranks']} ranks over {saved['numel']} elements with "
                             f"{saved.get('master_dtype')} masters, this run shards {mine['numel']} over "
                             f"{mine['ranks']} with {mine['master_dtype']}: resume with the same layout "
                             f"(--dp, --cp, --dtype, model)")
        self.master.copy_(sd["master"])
        self.inner.load_state_dict(sd["inner"])
        self.flat[self.lo:self.lo + self.per].copy_(self.master)  # and the weights agree with the master slice
