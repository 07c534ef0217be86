"""CUDA only (skipped without): ring_branch_attention with backend="triton" and backend="flash" in bf16, end to end
(out, lse and the grads of q, k, v, branch_k, branch_v) against dense fp64 attention, at cp = 1 and 2 (in-process ring
on one GPU). Bar, per tensor: max |ours - fp64| <= 2 max |dense bf16 - fp64| + 1e-3, where "dense bf16" is the masked
dense attention of attention_cp.reference_branch_attention run in bf16 (what a plain PyTorch user would get).
Also the compiled fp32 path at its default (wide-row) tiles against fp64.
"""
import pytest
import torch

if not torch.cuda.is_available():  # before importing attention_triton: on CPU it must be imported interpreted
    pytest.skip("needs CUDA", allow_module_level=True)

from attention_cp import reference_branch_attention, ring_branch_attention  # noqa: E402
from branch_mask import cu_seqlens_from_lengths, pad_for_cp, zigzag_shard, zigzag_unshard  # noqa: E402
from parallel.ring import run_ranks  # noqa: E402

NAMES = ("out", "lse", "dq", "dk", "dv", "dbk", "dbv")


def _case(cp, dtype, D=128, seed=0):
    g = torch.Generator().manual_seed(seed)
    cu = pad_for_cp(cu_seqlens_from_lengths([1000, 333, 2100]), cp).cu_seqlens
    T, Hq, Hkv, P = int(cu[-1]), 8, 2, 3
    rnd = lambda *s: torch.randn(*s, generator=g, dtype=torch.float64)  # noqa: E731
    x = dict(q=rnd(T, Hq, D), k=rnd(T, Hkv, D), v=rnd(T, Hkv, D), bk=rnd(T, P, Hkv, D), bv=rnd(T, P, Hkv, D),
             dout=rnd(T, Hq, D), dlse=rnd(T, Hq))
    return cu, {n: t.to(dtype) for n, t in x.items()}


def _dense(cu, x, dtype):
    ins = [x[n].cuda().to(dtype).requires_grad_() for n in ("q", "k", "v", "bk", "bv")]
    out, lse = reference_branch_attention(ins[0], ins[1], ins[2], cu, ins[3], ins[4])
    ((out * x["dout"].cuda().to(dtype)).sum() + (lse * x["dlse"].cuda().to(dtype)).sum()).backward()
    return dict(zip(NAMES, [t.detach().double().cpu() for t in [out, lse] + [i.grad for i in ins]]))


def _ring(cu, x, cp, backend):
    def rank(ring):
        shard = lambda t: zigzag_shard(t, cu, cp, ring.rank).cuda()  # noqa: E731
        ins = [shard(x[n]).requires_grad_() for n in ("q", "k", "v", "bk", "bv")]
        out, lse = ring_branch_attention(ins[0], ins[1], ins[2], cu, ins[3], ins[4], group=ring, return_lse=True,
                                         backend=backend)
        ((out * shard(x["dout"])).sum() + (lse * shard(x["dlse"])).sum()).backward()
        return [t.detach().double().cpu() for t in [out, lse] + [i.grad for i in ins]]
    per_rank = run_ranks(cp, rank, timeout=300)
    return {n: zigzag_unshard([p[i] for p in per_rank], cu) for i, n in enumerate(NAMES)}


def _backend(name):
    if name == "triton":
        pytest.importorskip("triton")
        from backends import attention_triton  # noqa: F401
    else:
        pytest.importorskip("flash_attn")
        from backends import attention_flash
        attention_flash.flash_interface()
    return name


@pytest.mark.parametrize("cp", [1, 2])
@pytest.mark.parametrize("backend", ["triton", "flash"])
def test_bf16_end_to_end_within_twice_dense_bf16_error(backend, cp):
    backend = _backend(backend)
    cu, x = _case(cp, torch.bfloat16, seed=cp)
    exact = _dense(cu, {n: t.double() for n, t in x.items()}, torch.float64)
    dense16 = _dense(cu, x, torch.bfloat16)
    ours = _ring(cu, x, cp, backend)
    for n in NAMES:
        err, bar = (ours[n] - exact[n]).abs().max().item(), 2 * (dense16[n] - exact[n]).abs().max().item() + 1e-3
        assert err <= bar, f"{backend} cp={cp} {n}: max error {err:.3e} > 2 x dense bf16 error + 1e-3 = {bar:.3e}"


def test_fp32_default_tiles_match_fp64():
    _backend("triton")
    cu, x = _case(2, torch.float32, D=128, seed=7)
    exact = _dense(cu, {n: t.double() for n, t in x.items()}, torch.float64)
    ours = _ring(cu, x, 2, "triton")
    for n in NAMES:
        torch.testing.assert_close(ours[n], exact[n], atol=2e-4, rtol=2e-4, msg=lambda m: f"{n}: {m}")
