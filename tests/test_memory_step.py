"""The plan's optimizer-step term (memory_model.step_bytes) against the storages a real step allocates.

A pipeline stage of the tiny policy, its gradients filled, steps once (AdamW's state made first, so that only the
step's temporaries are transient) under memory_track.StorageTracker: a plain fp32 AdamW, and the bf16 path's
ShardedOptimizer over fp32 masters (parallel/zero1.py with n = 1), each with foreach (CUDA's default) and with the
CPU's single-tensor loop. The peak of the step's transient storages must be the planned bytes within 5%. ZeRO-1's
all_gather copies (n > 1) are counted from torch's ProcessGroup code, not measured here: the backend allocates them
on its own thread, out of the tracker's sight. Adds ~2 s.
"""
import pytest
import torch

from harness import memory_model as mm
from harness import memory_track as mt
from model import ModelConfig, Transformer
from modeling.mixed_precision import master_optimizer

TOL = 0.05


def stage(dtype):
    torch.manual_seed(0)
    m = ModelConfig.preset("tiny", vocab_size=151)
    return Transformer(m, layers=(0, 2)).to(dtype), m


def fill_grads(params):
    for p in params:
        g = torch.randn(p.shape)
        if hasattr(p, "main_grad"):
            p.main_grad.copy_(g)
        else:
            p.grad = g.to(p.dtype)


def measured_step(opt, params) -> int:
    fill_grads(params)
    opt.step()  # AdamW's m and v (and step counters) exist from here on
    fill_grads(params)
    with mt.StorageTracker() as tr:
        opt.step()
    return tr.peak()


@pytest.mark.parametrize("foreach", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_optimizer_step_term_is_what_a_step_allocates(foreach, dtype):
    model, m = stage(torch.float32)
    params = [p for p in model.parameters() if p.requires_grad]
    N, largest = sum(p.numel() for p in params), max(p.numel() for p in params)
    opt = master_optimizer(params, lambda ps: torch.optim.AdamW(ps, lr=1e-3, foreach=foreach), dtype=dtype)
    got = measured_step(opt, params)
    want = mm.step_bytes(N, largest, 1, 2 if dtype == torch.bfloat16 else 4, gpu=foreach)
    assert abs(want - got) <= TOL * got, (want, got)


def test_zero1_counts_the_gathers_copies():
    N = 1000
    assert mm.step_bytes(N, N, 4, 2, gpu=True) == 4 * 250 + 4 * 250 + 2 * 250 + 2 * 4 * 250
    assert mm.step_bytes(N, N, 4, 4, gpu=True) == 4 * 250 + 4 * 250 + 4 * 4 * 250  # fp32: no cast, the flat copy
    assert mm.step_bytes(N, 10, 1, 4, gpu=True) == 4 * N and mm.step_bytes(N, 10, 1, 4, gpu=False) == 80
