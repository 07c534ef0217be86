"""mixed_precision.MixedPrecision: a bf16 training step against the same step in fp32. With SGD the update is
lr * gradient, so the comparison isolates what bf16 changes: the forward/backward rounding. Bar: per tensor,
max |dw_bf16 - dw_fp32| <= 3% of max |dw_fp32| (measured: <= 1.2% on this model), loss within 1%; the master
weights stay fp32 and the working copy is exactly their bf16 rounding; gradients of M microbatches add in fp32, and
PipelineSchedule (world size 1) reduces and returns the same fp32 gradients as a plain loop."""
import copy

import pytest
import torch
import torch.nn.functional as F

from modeling.mixed_precision import MixedPrecision
from model import ModelConfig, Transformer
from modeling.layers import at_least_f32
from parallel.grid import Grid
from pipeline import Microbatch, PipelineSchedule

pytestmark = pytest.mark.usefixtures("one_thread")
LR, REL = 0.5, 0.03


def _setup(M=3):
    torch.manual_seed(0)
    cfg = ModelConfig.preset("tiny", num_hidden_layers=2)
    g = torch.Generator().manual_seed(1)
    cu = torch.tensor([0, 10, 24], dtype=torch.int32)
    mbs = [Microbatch(torch.randint(cfg.vocab_size, (24,), generator=g), cu) for _ in range(M)]
    return cfg, Transformer(cfg), mbs


def loss_fn(logits, mb):  # softmax statistics in fp32 (at_least_f32), as the training loop must do for bf16 logits
    return F.cross_entropy(at_least_f32(logits)[:-1], mb.tokens[1:])


def test_bf16_step_matches_fp32_step():
    cfg, ref, mbs = _setup()
    model = copy.deepcopy(ref)
    w0 = {n: p.detach().clone() for n, p in ref.named_parameters()}
    opt = torch.optim.SGD(ref.parameters(), lr=LR)
    ref_loss = sum(loss_fn(ref(mb.tokens, mb.cu_seqlens).logits, mb) for mb in mbs)
    ref_loss.backward()
    opt.step()
    mp = MixedPrecision(model, lambda ps: torch.optim.SGD(ps, lr=LR))
    loss = 0.0
    for mb in mbs:  # one backward per microbatch: the fp32 accumulator adds them
        lv = loss_fn(model(mb.tokens, mb.cu_seqlens).logits, mb)
        lv.backward()
        loss += float(lv.detach())
    ref_loss = float(ref_loss.detach())
    assert abs(loss - ref_loss) <= 0.01 * abs(ref_loss)
    mp.step()
    want = dict(ref.named_parameters())
    at = 0
    for name, p in model.named_parameters():
        w32 = mp.master[at:at + p.numel()].view_as(p)  # the masters, parameter after parameter
        at += p.numel()
        assert p.dtype == torch.bfloat16 and w32.dtype == torch.float32 and torch.equal(p, w32.detach().bfloat16())
        d_ref, d_mp = want[name].detach() - w0[name], w32.detach() - w0[name]
        err = float((d_mp - d_ref).abs().max() / d_ref.abs().max())
        assert err <= REL, f"{name}: bf16 update off by {err:.3f} of the fp32 update"
    assert all(float(p.main_grad.abs().max()) == 0 and p.grad is None for p in mp.params)  # zeroed for next step


def test_pipeline_schedule_reduces_the_fp32_accumulator():
    cfg, ref, mbs = _setup()
    a, b = copy.deepcopy(ref), copy.deepcopy(ref)
    mp_a, mp_b = (MixedPrecision(m, lambda ps: torch.optim.SGD(ps, lr=LR)) for m in (a, b))
    for mb in mbs:
        loss_fn(a(mb.tokens, mb.cu_seqlens).logits, mb).backward()
    sched = PipelineSchedule(b, Grid.build(), [(0, cfg.num_hidden_layers)])  # built after the bf16 conversion
    sched.step(mbs, loss_fn)
    for p, q in zip(mp_a.params, mp_b.params):
        assert q.main_grad.dtype == torch.float32 and q.grad is None
        torch.testing.assert_close(q.main_grad, p.main_grad, atol=1e-6, rtol=1e-5)


def test_loud_on_a_bad_dtype():
    with pytest.raises(ValueError, match="dtype=torch.float32"):
        MixedPrecision(torch.nn.Linear(2, 2), torch.optim.SGD, dtype=torch.float32)
