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

Letters: w32 / w16 master and working weights, g32 the fp32 gradient, M microbatches.
"""
from __future__ import annotations

import torch


class MixedPrecision:
    """Owns the fp32 master copy and optimizer of `module`'s trainable parameters, whose data become `dtype`."""

    def __init__(self, module: torch.nn.Module, make_opt, dtype: torch.dtype = torch.bfloat16):
        if dtype not in (torch.bfloat16, torch.float16):
            raise ValueError(f"dtype={dtype}: expected torch.bfloat16 or torch.float16 for the working copy")
        self.params = [p for p in module.parameters() if p.requires_grad]
        if not self.params:
            raise ValueError("module: no trainable parameters to keep master copies of")
        self.master = []
        for p in self.params:
            w32 = p.detach().to(torch.float32).clone().requires_grad_()
            self.master.append(w32)
            p.data = p.data.to(dtype)  # step 1: the module now computes in dtype
            p.main_grad = torch.zeros_like(w32)  # step 2's accumulator, read by PipelineSchedule's reductions
            p.register_post_accumulate_grad_hook(_accumulate)
        module.to(dtype)  # buffers too (the parameters already are)
        self.opt = make_opt(self.master)

    def zero_grad(self):
        for p in self.params:
            p.grad = None
            p.main_grad.zero_()

    @torch.no_grad()
    def step(self, grad_clip: float = 0.0) -> float:
        """Step 3 on the masters (gradient norm clipped in fp32 if grad_clip > 0), then step 1 again; returns the
        gradient norm. Zeroes the accumulators for the next step."""
        for p, w32 in zip(self.params, self.master):
            w32.grad = p.main_grad
        norm = torch.nn.utils.clip_grad_norm_(self.master, grad_clip if grad_clip > 0 else float("inf"))
        self.opt.step()
        for p, w32 in zip(self.params, self.master):
            p.copy_(w32)  # round to the working dtype
            w32.grad = None
        self.zero_grad()
        return float(norm)


def _accumulate(p: torch.Tensor):
    """After each backward into a working parameter: add its 16-bit gradient to the fp32 accumulator, drop it."""
    p.main_grad.add_(p.grad)
    p.grad = None
