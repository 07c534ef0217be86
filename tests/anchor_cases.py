"""Shared cases for anchor_branch_attention's tests: a packed batch, anchors picked by rule (random, chunk edges, one
row, none), the per-rank run over the ring (threads) and the dense fp64 oracle. Per-anchor results come back in the
global anchor order (scattered by shard_anchors' index), trunk grads unsharded, so every run compares row for row."""
from __future__ import annotations

import torch

from attention_cp import anchor_branch_attention, reference_anchor_attention
from branch_mask import cu_seqlens_from_lengths, pad_for_cp, shard_anchors, zigzag_shard, zigzag_unshard
from parallel.ring import run_ranks

NAMES = ("out", "lse", "dq", "dk", "dv", "dbk", "dbv")
PICKS = ("random", "edges", "first_row", "none", "all")


def pick_anchors(cu, cp, pick: str, g) -> torch.Tensor:
    """Global anchor rows (ascending). edges: the first and last row of every zigzag chunk of every other sequence
    (a sequence's first and last rows among them, and sequences with no anchor); first_row: row 0 only (every rank
    but rank 0 holds none); all: every row (TTT's layout)."""
    T = int(cu[-1])
    if pick == "random":
        rows = torch.nonzero(torch.rand(T, generator=g) < 0.3).flatten()
    elif pick == "edges":
        bounds = cu.tolist()
        rows = []
        for s, (a, b) in enumerate(zip(bounds, bounds[1:])):
            C = (b - a) // (2 * cp)
            if s % 2 == 0 and C:
                rows += [a + c * C + x for c in range(2 * cp) for x in sorted({0, C - 1})]
        rows = torch.tensor(rows, dtype=torch.long)
    elif pick == "first_row":
        rows = torch.zeros(1, dtype=torch.long)
    elif pick == "none":
        rows = torch.zeros(0, dtype=torch.long)
    else:
        rows = torch.arange(T)
    return rows


def make_case(lengths, cp, W, P, Hkv, G, D, visible=True, pick="random", dtype=torch.float64, seed=0,
              backend="torch_tile3"):
    g = torch.Generator().manual_seed(seed)
    cu = pad_for_cp(cu_seqlens_from_lengths(lengths), cp).cu_seqlens
    anchors = pick_anchors(cu, cp, pick, g)
    T, N, Hq = int(cu[-1]), len(anchors), Hkv * G
    rnd = lambda *shape: torch.randn(*shape, generator=g, dtype=torch.float64).to(dtype)  # noqa: E731
    return dict(cu=cu, cp=cp, anchors=anchors, visible=visible, backend=backend, q=rnd(N, W, Hq, D),
                k=rnd(T, Hkv, D), v=rnd(T, Hkv, D), bk=rnd(N, P, Hkv, D) if P else None,
                bv=rnd(N, P, Hkv, D) if P else None, dout=rnd(N, W, Hq, D), dlse=rnd(N, W, Hq))


def _loss(out, lse, dout, dlse):  # <out, dout> + <lse, dlse> over the queries that see a key (lse finite)
    return (out * dout).sum() + torch.where(torch.isfinite(lse), lse * dlse, 0).sum()


def run_rank(case, rank, group, device="cpu"):
    """This rank's forward + backward; returns (index of its anchors, [out, lse, dq, dk, dv, dbk, dbv]) detached."""
    cu, cp = case["cu"], case["cp"]
    local, index = shard_anchors(case["anchors"], cu, cp, rank)
    trunk = lambda x: zigzag_shard(x, cu, cp, rank)  # noqa: E731
    per_anchor = lambda x: None if x is None else x[index]  # noqa: E731
    ins = [per_anchor(case["q"]), trunk(case["k"]), trunk(case["v"]), per_anchor(case["bk"]), per_anchor(case["bv"])]
    ins = [None if x is None else x.to(device).requires_grad_() for x in ins]
    out, lse = anchor_branch_attention(ins[0], ins[1], ins[2], cu, local.to(device), ins[3], ins[4],
                                       anchor_visible=case["visible"], group=group, return_lse=True,
                                       backend=case["backend"])
    _loss(out, lse, case["dout"][index].to(device), case["dlse"][index].to(device)).backward()
    return index, [x.detach().cpu() for x in (out, lse)] + [None if x is None else x.grad.cpu() for x in ins]


def gather(per_rank, case):
    """[(index, results)] of every rank -> one dict over all anchors (global order) and the whole trunk."""
    got = {}
    for i, n in enumerate(NAMES):
        if per_rank[0][1][i] is None:
            got[n] = None
        elif n in ("dk", "dv"):
            got[n] = zigzag_unshard([r[i] for _, r in per_rank], case["cu"])
        else:
            first = per_rank[0][1][i]
            got[n] = first.new_zeros((len(case["anchors"]),) + tuple(first.shape[1:]))
            for index, r in per_rank:
                got[n][index] = r[i]
    return got


def run_threads(case, device="cpu"):
    return gather(run_ranks(case["cp"], lambda ring: run_rank(case, ring.rank, ring, device), timeout=120), case)


def reference(case):
    """Dense fp64 oracle, whatever the case's dtype."""
    ins = [None if case[n] is None else case[n].double().requires_grad_() for n in ("q", "k", "v", "bk", "bv")]
    out, lse = reference_anchor_attention(ins[0], ins[1], ins[2], case["cu"], case["anchors"], ins[3], ins[4],
                                          anchor_visible=case["visible"])
    _loss(out, lse, case["dout"].double(), case["dlse"].double()).backward()
    return dict(zip(NAMES, [out.detach(), lse.detach()] + [None if x is None else x.grad for x in ins]))


def assert_all_close(got, want, atol, rtol=0.0):
    for n in NAMES:
        if want[n] is None:
            assert got[n] is None, n
            continue
        a, b = got[n].double(), want[n].double()
        if n == "lse":  # -inf exactly where the oracle's query sees no key
            assert torch.equal(torch.isinf(a), torch.isinf(b)), "lse: -inf rows differ"
            a, b = torch.where(torch.isinf(b), 0, a), torch.where(torch.isinf(b), 0, b)
        assert not torch.isnan(a).any(), f"{n}: NaN"
        torch.testing.assert_close(a, b, atol=atol, rtol=rtol, msg=lambda m: f"{n}: {m}")
