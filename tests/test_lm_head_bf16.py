"""The LM head with 16-bit weights: fused_logprob.token_logp, draft_loss's streamed loss and modeling.layers.linear_f32
run their GEMMs on 16-bit inputs with fp32 accumulation, and dW goes into mixed precision's fp32 .main_grad.

1. bf16 forward and backward against dense fp64 on the same bf16 values, V = 4096, H = 64, T = 256 rows in chunks of
   32, tau = 0.7 (bench/lm_head_check.errors): per tensor (log p, dx, dW), max |ours - fp64| <= 2 max |dense bf16 -
   fp64|, dense bf16 being bf16 logits under plain autograd; with .main_grad and with the dW buffer (no .main_grad).
2. The bytes (harness/memory_track.StorageTracker): a bf16 backward with .main_grad forms no tensor of more than one
   cast block of W's rows, and W's 16-bit .grad is never formed; linear_f32 without out_dtype (the CPU, a torch < 2.8)
   casts W CAST_BLOCK_MIB at a time. The control, the grad-enabled full cast, is seen by the same classifier.
3. The draft's streamed loss (draft_loss.StreamingSoftCE) with .main_grad: the same dW as the buffer path to within
   that path's bf16 roundings (2^-7 of the largest; measured 2^-8), every other gradient bit-equal.
4. bench/lm_head_check.py --tiny runs and writes its JSON.
5. CUDA only (skipped without): 1. on the GPU, with torch's out_dtype GEMMs and with the fp32-block fallback a torch
   < 2.8 takes (the feature check patched off).
Adds ~3 s on 2 cores shared with other engineers' tests (pytest --durations: 1. 0.35 s, 2. 1.6 s -- the tracker
sees every op --, 3. 0.3 s, 4. 0.4 s).
"""
import copy
import json
import os
import sys

import pytest
import torch

from backends.fused_logprob import token_logp
from harness.memory_track import StorageTracker
from modeling import layers
from modeling.mixed_precision import use_main_grads

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "bench"))
import lm_head_check  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")
V, H, T = 4096, 64, 256


def assert_within_twice_dense(e):
    for head in ("bf16 fused", "bf16 fused (dW buffer)"):
        for n in ("logp", "dx", "dW"):
            assert e[head][n] <= 2 * e["bf16 dense"][n], (head, n, e[head][n], e["bf16 dense"][n])
    assert e["bf16 fused"]["logp"] <= 1e-6 * e["scale"]["logp"]  # fp32 logits: no bf16 rounding in log p


def test_bf16_head_within_twice_dense_bf16():
    e = lm_head_check.errors(T, V, H, chunk=32, tau=0.7)
    assert_within_twice_dense(e)
    assert all(e["fp32 fused"][n] <= 1e-6 * e["scale"][n] for n in ("logp", "dx", "dW"))


def w_rows_classifier(rows: int):
    """"w_rows" for a 2-D tensor with an H axis and more than `rows` rows of W on the other; "w_grad16" for a
    16-bit (V, H) tensor (W's 16-bit grad)."""
    def classify(t):
        if t.dim() == 2 and t.shape == (V, H) and t.dtype == torch.bfloat16:
            return "w_grad16"
        if t.dim() == 2 and H in t.shape and max(t.shape) > rows:
            return "w_rows"
        return None
    return classify


def test_bf16_backward_holds_no_copy_of_W(monkeypatch):
    monkeypatch.setattr(layers, "CAST_BLOCK_MIB", V * H * 4 / 8 / 2**20)  # a block is an eighth of W in fp32
    a = lm_head_check.leaves(T, V, H)
    x, W = a["x"].requires_grad_(), torch.nn.Parameter(a["W"])
    use_main_grads([W])
    with StorageTracker(w_rows_classifier(V // 8)) as tr:
        (token_logp(x, W, a["y"], chunk=32) * a["g"]).sum().backward()
        with torch.no_grad():  # the rollout's decode: (B, S, H) rows
            layers.linear_f32(x.detach()[:6].reshape(2, 3, H), W.detach())
    assert tr.peak("w_rows") == 0 and tr.peak("w_grad16") == 0 and W.grad is None
    assert W.main_grad.abs().max() > 0 and x.grad is not None
    with StorageTracker(w_rows_classifier(V // 8)) as tr:  # the control: autograd through the full cast
        layers.linear_f32(x[:4], W)
    assert tr.peak("w_rows") == V * H * 4


def test_linear_f32_fallback_is_exact_in_blocks(monkeypatch):
    """Without out_dtype: fp32 math on the bf16 values, W in blocks of an eighth: the fp64 product within fp32
    accumulation (1e-5 relative), where a bf16 matmul's output rounding is ~2^-9."""
    monkeypatch.setattr(layers, "CAST_BLOCK_MIB", V * H * 4 / 8 / 2**20)
    a = lm_head_check.leaves(16, V, H)
    exact = a["x"].double() @ a["W"].double().T
    got = layers.linear_f32(a["x"], a["W"])
    assert got.dtype == torch.float32 and (got.double() - exact).abs().max() <= 1e-5 * exact.abs().max()


def test_draft_streamed_loss_into_main_grad():
    from test_draft import case
    policy, draft, tokens, cu, out = case(lens=[7, 4, 9, 2, 1, 3])
    draft, taps = draft.float().bfloat16(), {k: t.bfloat16() for k, t in out.taps.items()}
    grads = []
    for main in (True, False):
        d = copy.deepcopy(draft)
        if main:
            use_main_grads([p for p in d.parameters() if p.requires_grad])
        loss, _ = d.ttt_loss(taps, tokens, cu, teacher_hidden=out.hidden.bfloat16(),
                             teacher_head=policy.lm_head.weight.bfloat16(), chunk=5)
        loss.backward()
        grads.append({n: getattr(p, "main_grad", p.grad) for n, p in d.named_parameters() if p.requires_grad})
        assert (d.lm_head.weight.grad is None) == main
    main, buf = grads
    W = "lm_head.weight"
    # the buffer path rounds each pass's dW to bf16 and autograd sums the P = 3 of them in bf16 (measured 2^-8)
    assert (main[W] - buf[W].float()).abs().max() <= 2**-7 * buf[W].float().abs().max()
    for n in main:
        if n != W:
            assert torch.equal(main[n], buf[n].float()), n


def test_tiny_check_runs(tmp_path):
    assert lm_head_check.main(["--tiny", "--repeats=1", f"--out={tmp_path / 'c.json'}"]) == 0
    res = json.loads((tmp_path / "c.json").read_text())
    assert (res["V"], res["H"]) == (4096, 64) and set(res["time"]) >= {"bf16", "fp32"}
    assert_within_twice_dense(res["errors"])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("old_torch", [False, True])
def test_bf16_head_on_cuda(old_torch, monkeypatch):
    if old_torch:
        monkeypatch.setattr(layers, "out_dtype_ops", lambda: (False, False))
    assert_within_twice_dense(lm_head_check.errors(T, V, H, "cuda", chunk=32, tau=0.7))
