"""Shared cases for the CP attention tests: build a packed batch, run the real per-rank code (threads or gloo), and the
dense fp64 oracle. Every tensor a case returns is *unsharded* (zigzag_unshard), so all runs compare row for row."""
from __future__ import annotations

import torch

from attention_cp import TorchBlocks, register_backend
from attention_cp import reference_branch_attention, ring_branch_attention
from branch_mask import cu_seqlens_from_lengths, pad_for_cp, zigzag_shard, zigzag_unshard
from parallel.ring import run_ranks

# tiny tiles exercise the tiling (partial, skipped and masked causal tiles) on small test shapes
for _t in (3, 5):
    register_backend(f"torch_tile{_t}", TorchBlocks(tile=_t))

NAMES = ("out", "lse", "dq", "dk", "dv", "dbk", "dbv")


def make_case(lengths, cp, P, Hkv, G, D, dtype=torch.float64, seed=0, backend="torch_tile3"):
    g = torch.Generator().manual_seed(seed)
    pad = pad_for_cp(cu_seqlens_from_lengths(lengths), cp)
    T, Hq = int(pad.cu_seqlens[-1]), Hkv * G
    rnd = lambda *shape: torch.randn(*shape, generator=g, dtype=torch.float64).to(dtype)  # noqa: E731
    return dict(cu=pad.cu_seqlens, pad=pad, cp=cp, backend=backend, q=rnd(T, Hq, D), k=rnd(T, Hkv, D),
                v=rnd(T, Hkv, D), bk=rnd(T, P, Hkv, D) if P else None, bv=rnd(T, P, Hkv, D) if P else None,
                dout=rnd(T, Hq, D), dlse=rnd(T, Hq))


def run_rank(case, rank, group):
    """This rank's forward + backward of loss = <out, dout> + <lse, dlse>; returns its shards (detached)."""
    cu, cp = case["cu"], case["cp"]
    shard = lambda x: None if x is None else zigzag_shard(x, cu, cp, rank)  # noqa: E731
    ins = [None if case[n] is None else shard(case[n]).requires_grad_() for n in ("q", "k", "v", "bk", "bv")]
    out, lse = ring_branch_attention(ins[0], ins[1], ins[2], cu, ins[3], ins[4], group=group, return_lse=True,
                                     backend=case["backend"])
    ((out * shard(case["dout"])).sum() + (lse * shard(case["dlse"])).sum()).backward()
    return [out.detach(), lse.detach()] + [None if x is None else x.grad for x in ins]


def unshard_all(per_rank, cu):
    return {n: None if per_rank[0][i] is None else zigzag_unshard([p[i] for p in per_rank], cu)
            for i, n in enumerate(NAMES)}


def run_threads(case):
    return unshard_all(run_ranks(case["cp"], lambda ring: run_rank(case, ring.rank, ring), timeout=60), case["cu"])


def reference(case, dtype=torch.float64):
    """Dense oracle in fp64, whatever the case's dtype (dtype=bf16: the dense attention a plain user gets in bf16)."""
    names = ("q", "k", "v", "bk", "bv")
    ins = [None if case[n] is None else case[n].to(dtype, copy=True).requires_grad_() for n in names]
    out, lse = reference_branch_attention(ins[0], ins[1], ins[2], case["cu"], ins[3], ins[4])
    ((out * case["dout"].to(dtype)).sum() + (lse * case["dlse"].to(dtype)).sum()).backward()
    return dict(zip(NAMES, [out.detach(), lse.detach()] + [None if x is None else x.grad for x in ins]))


def assert_all_close(got, want, atol, rtol=0.0, rows=None):
    for n in NAMES:
        if want[n] is None:
            assert got[n] is None, n
            continue
        a, b = got[n].double(), want[n].double()
        if rows is not None:
            a, b = a[rows], b[rows]
        torch.testing.assert_close(a, b, atol=atol, rtol=rtol, msg=lambda m: f"{n}: {m}")


def gloo_worker(rank, world_size, cases):
    """Runs under tests/dist_util.run_distributed: the same per-rank code over a real gloo group."""
    import torch.distributed as dist
    return [run_rank(c, rank, dist.group.WORLD) for c in cases]
