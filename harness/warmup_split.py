"""The warm-ups split over every rank of a run: the one-process result, each rank doing 1/n of the work.

A warm-up's costly parts are an RL step's: sampling, and training steps over batches. They split the same way
(group None: one process, nothing split, the same code):

  1. Sampling. Prompt i's response draws from its own stream, row_keys(seed, i) (decoding/row_streams.py), and the
     pool is cut into blocks of `rows` prompts; block j is generated on rank j mod n, then every rank gets every block
     (all_gather_object). A row's tokens depend on its key alone: the pool is bit-identical on any n.
  2. Training, data parallel. Every rank draws the step's batch from the same seeded sampler, so every rank knows the
     whole batch, and each loss is a SUM of parts with weights fixed by the whole batch:
         SFT:    L = sum_seq sum_t (-log p_t) m_t / sum_batch m       rank r: sequences r, r + n, ...
         draft:  L = (1 / M) sum_j L_draft(micro-batch j)              rank r: micro-batches r, r + n, ...
     Each rank backpropagates its parts and the gradients are summed over the ranks (all_reduce): the one-process
     gradient up to the order of the fp32 additions. Every rank then clips by the same global norm and takes the same
     AdamW step, so the weights stay identical on every rank: no broadcast.
  3. Precision (MasterOptimizer). The warm-up computes in the run's dtype: in bf16 a bf16 forward and backward with
     fp32 master weights, each backward's gradient added to an fp32 accumulator, summed over the ranks in fp32, AdamW
     on the masters, the bf16 working copy refreshed from them. In fp32 the masters are the parameters themselves.
  4. The cache (harness/warmup.py). A hit only if every rank sees a complete entry (`agree`): else every rank trains,
     rank 0 alone writes (atomically), and the others keep the identical weights they trained.

A collective that fails (a stopped rank, one past --dist_timeout) raises parallel.waits.WaitFailed naming it, which
harness/mesh.py's Mesh.phase turns into one line naming the phase and the ranks. The cache check and the samples'
gather travel on gloo (host tensors); the gradient sum of CUDA tensors on NCCL, whose watchdog ends a stuck rank
with NCCL's own message instead (parallel/waits.py says why).

    python -m pytest -q tests/test_warmup_split.py    # 2 gloo ranks vs one process: the same policy and draft

Letters: n ranks, M micro-batches of a draft step.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from parallel.waits import WaitFailed

HALF = (torch.bfloat16, torch.float16)
BUCKET_MIB = 64  # the gradient sum's flat buckets (fp32)
MICRO = 8  # a draft step's micro-batches: the largest divisor of its batch <= MICRO (the same on every mesh)


def rank_world(group) -> tuple:
    """(rank, n) in `group`; (0, 1) for None (one process)."""
    return (0, 1) if group is None else (dist.get_rank(group), dist.get_world_size(group))


def mine(parts: int, group) -> range:
    """The parts (sequences, micro-batches) 0..parts-1 this rank computes: r, r + n, ..."""
    r, n = rank_world(group)
    return range(r, parts, n)


def micro_count(batch: int) -> int:
    """M: the largest divisor of `batch` that is at most MICRO (a fixed rule, so the step is the same on any mesh)."""
    return max(d for d in range(1, min(batch, MICRO) + 1) if batch % d == 0)


def _collective(what: str, fn, group):
    """fn() (a collective of the warm-up); a failure becomes WaitFailed naming this rank and `what`."""
    try:
        return fn()
    except Exception as e:  # noqa: BLE001 -- gloo raises RuntimeError, NCCL DistBackendError
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise WaitFailed(f"rank {rank_world(group)[0]}: warm-up {what} failed ({first[:160]})") from e


def agree(ok: bool, group) -> bool:
    """True iff `ok` on every rank (a cache hit counts only if every rank sees the entry)."""
    if group is None:
        return ok
    t = torch.tensor([int(ok)])
    _collective("cache check (all_reduce)", lambda: dist.all_reduce(t, op=dist.ReduceOp.MIN, group=group), group)
    return bool(t.item())


def gather_blocks(n_items: int, rows: int, generate, group) -> list:
    """[generate(range) for each block of `rows` items] end to end, block j computed on rank j mod n and the results
    gathered to every rank, in item order. generate(items) -> a list (picklable, on the CPU), one entry per item."""
    r, n = rank_world(group)
    done = {j: generate(range(j * rows, min(n_items, (j + 1) * rows))) for j in range(r, -(-n_items // rows), n)}
    parts = [done]
    if n > 1:
        parts = [None] * n
        _collective("sampling (all_gather_object)", lambda: dist.all_gather_object(parts, done, group=group), group)
    blocks = {j: b for p in parts for j, b in p.items()}
    return [x for j in sorted(blocks) for x in blocks[j]]


class MasterOptimizer:
    """make_opt over fp32 master weights of `params`: for a 16-bit working `dtype` fp32 clones taken now (before the
    caller casts the module to dtype), else the parameters themselves. Per step: accumulate() after each backward,
    sum_grads() over the group, step(clip)."""

    def __init__(self, params, make_opt, dtype=torch.float32):
        self.params = [p for p in params if p.requires_grad]
        self.half = dtype in HALF
        self.master = ([p.detach().float().clone().requires_grad_(True) for p in self.params] if self.half
                       else self.params)
        self.opt = make_opt(self.master)
        self.param_groups = self.opt.param_groups  # the lr schedule writes these

    def accumulate(self):
        """After a backward: each 16-bit gradient added to its fp32 master's .grad (fp32: already there)."""
        if not self.half:
            return
        for p, m in zip(self.params, self.master):
            if p.grad is not None:
                g = p.grad.float()
                m.grad = g if m.grad is None else m.grad.add_(g)
                p.grad = None

    @torch.no_grad()
    def sum_grads(self, extra: torch.Tensor, group) -> torch.Tensor:
        """The masters' gradients summed over the group (a rank without parts adds zeros), and `extra` (k,) fp32
        (e.g. the parts' loss sums) with them; returns the summed extra. The gradients travel end to end in flat
        buckets of at most BUCKET_MIB (one all_reduce per bucket, not one per tensor)."""
        for m in self.master:
            if m.grad is None:
                m.grad = torch.zeros_like(m)
        if group is None:
            return extra
        grads, extra = [m.grad for m in self.master], extra.to(self.master[0].grad.device, torch.float32)
        cap, bucket, size = int(BUCKET_MIB * 2**20) // 4, [], 0
        for i, g in enumerate(grads):
            bucket.append(g)
            size += g.numel()
            if size >= cap or i == len(grads) - 1:
                last = i == len(grads) - 1
                flat = torch.cat([t.reshape(-1) for t in bucket] + ([extra] if last else []))
                _collective("gradient sum (all_reduce)", lambda: dist.all_reduce(flat, group=group), group)
                for t, part in zip(bucket, flat.split([t.numel() for t in bucket] + [extra.numel()] * last)):
                    t.copy_(part.view_as(t))
                if last:
                    extra = flat[-extra.numel():].clone()
                bucket, size = [], 0
        return extra

    @torch.no_grad()
    def step(self, grad_clip: float) -> float:
        """Clip the summed gradients by their global norm, step the masters, refresh the working copy; zero the
        gradients. Returns the norm before clipping."""
        norm = torch.nn.utils.clip_grad_norm_(self.master, grad_clip)
        self.opt.step()
        if self.half:
            for p, m in zip(self.params, self.master):
                p.copy_(m)
        self.opt.zero_grad(set_to_none=True)
        for p in self.params:
            p.grad = None
        return float(norm)
