"""bf16 training with fp32 master weights, fp32 gradient accumulation and fp32 optimizer state (Micikevicius et al.
2018, "Mixed Precision Training"; Megatron's main_grad).

The module's parameters become a bf16 *working copy*: forward and backward run in bf16 (half the memory and
bandwidth, tensor-core matmuls), while everything that accumulates stays fp32:

    1. w16 = bf16(w32)                          working weights, refreshed after every optimizer step
    2. g32 += fp32(dL/dw16)                     per backward (a hook), so M microbatches add in fp32, not bf16
    3. w32 <- opt(w32, g32)  (fp32 state)       the update itself never sees bf16 rounding
    4. softmax / log-sum-exp statistics in fp32 inside the model: RMSNorm, the attention kernels (fp32 accumulators
       and lse), and the loss through modeling.layers.at_least_f32(logits)

A bf16 update of size lr*g below half an ulp of w (|lr*g| < 2^-9 |w|) would be lost in bf16 weights; in w32 it
accumulates until it shows. pipeline.PipelineSchedule reduces .main_grad (the g32 of step 2) across CP / DP / the
embedding group when a parameter has one.

    mp = MixedPrecision(stage, lambda ps: torch.optim.AdamW(ps, lr=3e-4))    # stage now holds bf16 weights
    loss = loss_fn(stage(x, cu).logits); loss.backward()                    # or PipelineSchedule.step(...)
    mp.step(grad_clip=1.0)                                                  # fp32 update, bf16 copy refreshed

The training path (--dtype bf16) uses the pieces directly: `master_optimizer` gives a module's trainable parameters
the optimizer they need -- for 16-bit ones parallel/zero1.ShardedOptimizer with fp32 masters (over a group: ZeRO-1,
else the whole vector on this rank) after `use_main_grads`; over a group of several ranks the accumulators are views
of one flat buffer that ZeRO-1 reduce-scatters -- and `clip_grads_` clips whichever gradient a parameter
accumulates into. For fp32 parameters both reduce to the plain optimizer and torch's clipping.

Letters: w32 / w16 master and working weights, g32 the fp32 gradient, M microbatches.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from parallel.zero1 import ShardedOptimizer

HALF = (torch.bfloat16, torch.float16)


def use_main_grads(params) -> None:
    """Step 2: an fp32 .main_grad accumulator on each 16-bit parameter, filled after every backward (once). A
    parameter that has one already (a view of ZeRO-1's flat gradient buffer, any dtype) gets only the hook."""
    for p in params:
        if p.dtype in HALF and not hasattr(p, "main_grad"):
            p.main_grad = torch.zeros(p.shape, dtype=torch.float32, device=p.device)
        if hasattr(p, "main_grad") and not getattr(p, "_main_grad_hooked", False):
            p.register_post_accumulate_grad_hook(_accumulate)
            p._main_grad_hooked = True


def _accumulate(p: torch.Tensor):
    """After each backward into a working parameter: add its 16-bit gradient to the fp32 accumulator, drop it (none:
    a backward that wrote into .main_grad itself, as the streamed LM head does)."""
    if p.grad is not None:
        p.main_grad.add_(p.grad)
    p.grad = None


def grads_of(params) -> list:
    """The gradient each parameter accumulates into: its fp32 .main_grad, else .grad (None: left out)."""
    return [g for g in (getattr(p, "main_grad", p.grad) for p in params) if g is not None]


@torch.no_grad()
def clip_grads_(params, max_norm: float) -> float:
    """torch.nn.utils.clip_grad_norm_ over grads_of(params) (fp32 accumulators included); returns the total norm."""
    grads = grads_of(params)
    if not grads:
        return 0.0
    norm = torch.nn.utils.get_total_norm(grads)
    torch.nn.utils.clip_grads_with_norm_(grads, max_norm, norm)
    return float(norm)


def clip_stage_grads_(params: list, opt, max_norm: float, *, skip: set = frozenset(), group=None) -> float:
    """clip_grads_ for one pipeline stage of a model: the norm of the whole model's gradient, its squares summed over
    the stages (`group`: the pipeline group, None for one stage) and, under ZeRO-1 with reduce-scattered gradients
    (opt._reduced), over the slices this rank's optimizer group holds. skip: ids of parameters counted on another
    stage (a tied embedding's copy). Returns the total norm; every gradient is scaled by min(1, max_norm / norm)."""
    sliced = getattr(opt, "_reduced", False)  # ZeRO-1 reduce-scattered: this rank holds its slice only
    if sliced:
        spans = [(max(a, opt.lo), min(b, opt.hi), p) for p, (a, b) in zip(opt.params, opt.ranges())]
        grads = [opt.grad_slice[a - opt.lo:b - opt.lo] for a, b, p in spans if a < b and id(p) not in skip]  # views
    else:
        grads = grads_of([p for p in params if id(p) not in skip])  # fp32 .main_grad under bf16
    sq = torch.zeros((), dtype=torch.float64, device=params[0].device)
    for gr in grads:  # ||g||^2 summed in fp64 from each tensor's own norm: no fp64 copy of a (V, H) gradient
        sq = sq + torch.linalg.vector_norm(gr).double().square()
    if sliced:
        dist.all_reduce(sq, group=opt.group)  # the slices partition the stage
    if group is not None:
        dist.all_reduce(sq, group=group)
    total = float(sq.sqrt())
    coef = min(max_norm / (total + 1e-6), 1.0)
    for gr in [opt.grad_slice] if sliced else grads_of(params):
        gr.mul_(coef)
    return total


def master_optimizer(params, make_opt, group=None, dtype=None):
    """The optimizer `params` need, their working dtype becoming `dtype` (None: as they are). fp32: make_opt(params)
    (or, over a group, ZeRO-1). 16-bit: fp32 master weights (taken before the cast) and optimizer state
    (ShardedOptimizer(master_dtype=float32), sharded over `group` if given), gradients accumulated in fp32
    .main_grad."""
    params = [p for p in params if p.requires_grad]
    dtype = dtype or (params[0].dtype if params else None)
    sharded = group is not None and torch.distributed.get_world_size(group) > 1
    if dtype in HALF:
        opt = ShardedOptimizer(params, make_opt, group, master_dtype=torch.float32, dtype=dtype, flat_grads=sharded)
        use_main_grads(params)
        return opt
    if group is None:
        return make_opt(params)
    opt = ShardedOptimizer(params, make_opt, group, flat_grads=sharded)  # ZeRO-1: gradients reduce-scattered
    use_main_grads(params)
    return opt


class MixedPrecision:
    """Turns `module` into a 16-bit working copy and owns the fp32 master weights and optimizer of its trainable
    parameters (steps 1-3 above)."""

    def __init__(self, module: torch.nn.Module, make_opt, dtype: torch.dtype = torch.bfloat16, group=None):
        if dtype not in HALF:
            raise ValueError(f"dtype={dtype}: expected torch.bfloat16 or torch.float16 for the working copy")
        self.params = [p for p in module.parameters() if p.requires_grad]
        if not self.params:
            raise ValueError("module: no trainable parameters to keep master copies of")
        self.opt = master_optimizer(self.params, make_opt, group, dtype)  # masters from the fp32 values
        module.to(dtype)  # step 1: the module now computes in dtype (the buffers too; the parameters already do)

    @property
    def master(self) -> torch.Tensor:  # (N,) this rank's fp32 master weights, the parameters end to end
        return self.opt.master

    def zero_grad(self):
        self.opt.zero_grad()

    def step(self, grad_clip: float = 0.0) -> float:
        """Step 3 on the masters (gradient norm clipped in fp32 if grad_clip > 0), then step 1 again; returns the
        gradient norm. Zeroes the accumulators for the next step."""
        norm = clip_grads_(self.params, grad_clip if grad_clip > 0 else float("inf"))
        self.opt.step()
        self.zero_grad()
        return norm
