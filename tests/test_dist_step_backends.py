"""dist_step's --attn_backend and --logprob_chunk wiring: one co-training step with every attention through
ring_branch_attention's Triton kernel (TRITON_INTERPRET=1 on CPU) equals the torch kernel and the padded default
(fp32, small), single process and under a 2-stage pipeline (gloo); the drafts' fused teacher (hidden + head, streamed)
equals the logits teacher (fp64, 1e-10)."""
import os

import pytest
import torch

from backends.attention_padded import padded_branch_attention, padded_causal_attention
from dist_step import DistCotrainer
from dist_util import run_distributed
from pipeline import Grid
from test_dist_step import _max_diff, _summary, grpo, make_batch, make_models, make_policy_opt, state

pytestmark = pytest.mark.usefixtures("one_thread")


def step(grid, *, dtype=torch.float64, backend=None, chunk=0):
    """One DistCotrainer step + refit -> (stats, full policy and drafts after it)."""
    policy, drafts = make_models()
    policy.to(dtype)
    for tr in drafts:
        tr.draft.to(dtype)
        tr.draft.attach(policy)
        tr.attn_fn = padded_branch_attention  # the default at cp = 1 (train.py's); attn_backend replaces it
    batch = make_batch(policy)
    ct = DistCotrainer(policy, drafts, grid, make_policy_opt, grad_clip=0.5, attn_fn=padded_causal_attention,
                       attn_backend=backend, logprob_chunk=chunk)
    st = ct.step(batch, grpo("global-token"), 2)
    ct.refit(policy)
    return {"stats": _summary(st), **state(policy, drafts)}


def assert_close(a, b, tol):
    diff = {k: _max_diff(a[k], b[k]) for k in a}
    assert max(diff.values()) < tol, diff


def triton_ok():
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1"


def test_fused_teacher_equals_logits_teacher():
    ref = step(Grid.build())
    assert_close(step(Grid.build(), chunk=5), ref, 1e-10)


def test_ring_of_one_equals_padded_default():
    """attn_backend="torch" at cp = 1: policy and drafts through ring_branch_attention (even-padded batch)."""
    assert_close(step(Grid.build(), backend="torch"), step(Grid.build()), 1e-10)


@pytest.mark.skipif(not triton_ok(), reason="needs triton (CUDA, or TRITON_INTERPRET=1 on CPU)")
def test_triton_backend_equals_torch_single_process():
    ref = step(Grid.build(), dtype=torch.float32, backend="torch")
    assert_close(step(Grid.build(), dtype=torch.float32, backend="triton"), ref, 2e-4)


def _pipeline_worker(rank, world):
    return {b: step(Grid.build(pp=2), dtype=torch.float32, backend=b) for b in ("torch", "triton")}


@pytest.mark.skipif(not triton_ok(), reason="needs triton (CUDA, or TRITON_INTERPRET=1 on CPU)")
def test_triton_backend_equals_torch_under_pipeline():
    for r in run_distributed(_pipeline_worker, 2, timeout=240):
        assert_close(r["triton"], r["torch"], 2e-4)
