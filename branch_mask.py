"""Who attends to whom, and where each token lives under context parallelism (CP).

A packed batch lays S sequences end to end (T tokens); `cu_seqlens` [S+1] holds the boundaries (flash-attn's name).
Under CP a group of cp ranks shares every sequence in the *zigzag* layout (ring-flash-attention's zigzag ring;
Llama 3 §3.3.2): pad each sequence at its end to a multiple of 2·cp, cut it into 2·cp equal chunks of C tokens, and let
rank r hold chunk r followed by chunk 2·cp−1−r, sequence after sequence. Causal work then balances: every rank owns one
early and one late chunk. The two neighbour facts everything below rests on:

    chunk r+1 lives on rank r+1 (or, for r = cp−1, is this rank's own second chunk);
    chunk 2·cp−r (after my second chunk) lives on rank r−1 (for r = 0 it is past the end).

This file is the single source of truth for the layout (`pad_for_cp`, `pad_ring_of_one` for cp = 1, `zigzag_index`,
`zigzag_shard`/`unshard`, `shard_anchors`: which anchors a rank holds), for the CP-aware shift `cp_shift` (the draft
reads x_{i+d} at anchor i), and for the dense reference masks the tests use as oracles: packed causal, the TTT branch
mask in its two conventions, the anchor mask (any draft's branch: W queries per anchor, j <= a or j < a), and tree
masks. Boundaries drive host-side loops through their host copy, host_cu (parallel/host_copy.py: read once per
tensor).

    python branch_mask.py       # prints the layout and the masks, writes docs/branch_masks.png

Letters: T tokens (T_local on one rank), S sequences, L one sequence's (padded) length, C = L/(2·cp) chunk length,
P branch entries per anchor, N tree nodes, cp CP group size, r rank in the group, d shift / TTT pass.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from parallel.host_copy import host_cu, with_host_copy
from parallel.ring import as_ring


# ------------------------------------------------------------------------------------------------ packing and padding
def cu_seqlens_from_lengths(lengths) -> torch.Tensor:
    """(S,) lengths -> int32 (S+1,) boundaries [0, L_0, L_0+L_1, ...]."""
    lengths = torch.as_tensor(lengths, dtype=torch.long).reshape(-1)
    if bool((lengths < 0).any()):
        raise ValueError(f"lengths: must be >= 0, got {lengths.tolist()}")
    return torch.cat([lengths.new_zeros(1), lengths.cumsum(0)]).to(torch.int32)


def seq_lengths(cu_seqlens: torch.Tensor) -> torch.Tensor:  # (S+1,) -> (S,) int64
    return (cu_seqlens[1:] - cu_seqlens[:-1]).long()


def seq_ids(cu_seqlens: torch.Tensor) -> torch.Tensor:  # (T,) which sequence each token belongs to
    T = host_cu(cu_seqlens)[-1]
    return torch.repeat_interleave(torch.arange(len(cu_seqlens) - 1, device=cu_seqlens.device), seq_lengths(cu_seqlens),
                                   output_size=T)


def position_ids(cu_seqlens: torch.Tensor) -> torch.Tensor:  # (T,) position of each token within its sequence
    T = host_cu(cu_seqlens)[-1]
    starts = torch.repeat_interleave(cu_seqlens[:-1].long(), seq_lengths(cu_seqlens), output_size=T)
    return torch.arange(T, device=cu_seqlens.device) - starts


@dataclass(frozen=True)
class Padded:
    """A packed batch padded for CP: `pad` moves real tokens to their padded rows, `unpad` takes them back."""
    cu_seqlens: torch.Tensor  # int32 (S+1,) padded boundaries, every length a multiple of 2·cp
    index: torch.Tensor  # int64 (T_real,) padded row of each real token
    lengths: torch.Tensor  # int64 (S,) real lengths (the shift's validity uses them)

    def pad(self, x: torch.Tensor, fill=0) -> torch.Tensor:  # (T_real, ...) -> (T_pad, ...)
        out = x.new_full((host_cu(self.cu_seqlens)[-1],) + tuple(x.shape[1:]), fill)
        return out.index_copy(0, self.index, x)

    def unpad(self, x: torch.Tensor) -> torch.Tensor:  # (T_pad, ...) -> (T_real, ...)
        return x.index_select(0, self.index)


def pad_for_cp(cu_seqlens: torch.Tensor, cp: int) -> Padded:
    """Pad every sequence at its end to a multiple of 2·cp. Padding rows are ordinary tokens to attention: they come
    after the real ones, so causal masking already hides them from every real query."""
    if cp < 1:
        raise ValueError(f"cp={cp}: expected >= 1")
    lengths, cu = seq_lengths(cu_seqlens), host_cu(cu_seqlens)
    if any(b < a for a, b in zip(cu, cu[1:])):
        raise ValueError(f"cu_seqlens: must be non-decreasing, got {list(cu)}")
    padded = (lengths + 2 * cp - 1) // (2 * cp) * (2 * cp)
    host = [0]
    for a, b in zip(cu, cu[1:]):
        host.append(host[-1] + (b - a + 2 * cp - 1) // (2 * cp) * (2 * cp))
    cu_pad = with_host_copy(torch.cat([padded.new_zeros(1), padded.cumsum(0)]).to(torch.int32), tuple(host))
    index = torch.repeat_interleave(cu_pad[:-1].long(), lengths, output_size=cu[-1]) + position_ids(cu_seqlens)
    return Padded(cu_pad, index, lengths)


def pad_ring_of_one(cu_seqlens: torch.Tensor) -> Padded | None:
    """Without CP: pad_for_cp(cu_seqlens, 1) when some length is odd, None when every length is already even.

    Why pad at all at cp = 1: cp = 1 is the degenerate zigzag ring (one rank holding both chunks of every sequence,
    one ring step), not a separate code path. attention_cp.ring_branch_attention and cp_shift cut each sequence into
    2·cp equal chunks and check it (check_cp_padded), so the draft's TTT and, with an attention backend, the policy
    run the same code on the same padded shapes at every cp; at cp = 1 that needs even lengths. The padding rows
    follow the real ones (causal masking hides them from real queries) and carry no loss."""
    cu = host_cu(cu_seqlens)
    if not any((b - a) % 2 for a, b in zip(cu, cu[1:])):
        return None
    return pad_for_cp(cu_seqlens, 1)


def cu_local(cu_seqlens: torch.Tensor, cp: int) -> torch.Tensor:
    """cu_seqlens // cp: a CP rank's local boundaries when every length is a multiple of 2·cp."""
    return with_host_copy(cu_seqlens // cp, tuple(c // cp for c in host_cu(cu_seqlens)))


def check_cp_padded(cu_seqlens: torch.Tensor, cp: int, name: str = "cu_seqlens"):
    """Every sequence's length a multiple of 2·cp (pad_for_cp), else a ValueError naming `name`."""
    if not isinstance(cu_seqlens, torch.Tensor) or cu_seqlens.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"{name}: expected an int32 tensor [S+1], got {type(cu_seqlens).__name__} "
                        f"{getattr(cu_seqlens, 'dtype', '')}")
    cu = host_cu(cu_seqlens) if cu_seqlens.dim() == 1 else ()
    if len(cu) < 2 or cu[0] != 0:
        raise ValueError(f"{name}: expected a 1-D tensor [S+1] starting at 0, got {cu_seqlens.tolist()}")
    lengths = [b - a for a, b in zip(cu, cu[1:])]
    if min(lengths) < 0:
        raise ValueError(f"{name}: must be non-decreasing, got {list(cu)}")
    bad = [L for L in lengths if L % (2 * cp)]
    if bad:
        raise ValueError(f"{name}: sequence lengths {bad} are not multiples of 2*cp={2 * cp}; "
                         f"call branch_mask.pad_for_cp(cu_seqlens, cp={cp}) first")


# ------------------------------------------------------------------------------------------------------ zigzag layout
def zigzag_index(cu_seqlens: torch.Tensor, cp: int, rank: int) -> torch.Tensor:
    """(T_local,) packed rows held by `rank`: per sequence chunk r then chunk 2·cp−1−r. T_local = T/cp, and the local
    boundaries are cu_seqlens // cp (each sequence keeps 2·C rows on every rank)."""
    check_cp_padded(cu_seqlens, cp)
    if not 0 <= rank < cp:
        raise ValueError(f"rank={rank}: expected 0 <= rank < cp={cp}")
    parts, cu = [], host_cu(cu_seqlens)
    for start, L in zip(cu[:-1], (b - a for a, b in zip(cu, cu[1:]))):
        C = L // (2 * cp)
        for c in (rank, 2 * cp - 1 - rank):
            parts.append(torch.arange(start + c * C, start + (c + 1) * C))
    idx = torch.cat(parts) if parts else torch.zeros(0, dtype=torch.long)
    return idx.to(cu_seqlens.device)  # index math on the host, the index where the data lives


def shard_anchors(anchor_rows, cu_seqlens: torch.Tensor, cp: int, rank: int):
    """Which anchors `rank` holds: global packed (padded) rows (N,), non-decreasing -> (local_rows, index), both int64
    (n_r,): their rows on rank's zigzag shard (non-decreasing: anchor_branch_attention's `anchors`) and their places in
    the global list (x[index] shards a per-anchor tensor; scatter by index gathers it back). A row at position p of a
    sequence lies in chunk c = p // C, on rank c (c < cp) or 2·cp−1−c, at local offset p % C (+ C in the 2nd chunk)."""
    check_cp_padded(cu_seqlens, cp)
    if not 0 <= rank < cp:
        raise ValueError(f"rank={rank}: expected 0 <= rank < cp={cp}")
    rows = torch.as_tensor(anchor_rows).reshape(-1)
    cu = host_cu(cu_seqlens)
    host = rows.tolist()  # sync point (device rows): an input-preparation step, once per batch
    bad = rows.is_floating_point() or any(not 0 <= a < cu[-1] for a in host)
    if bad or any(b < a for a, b in zip(host, host[1:])):
        raise ValueError(f"anchor_rows: expected integer packed rows in [0, {cu[-1]}), non-decreasing, got "
                         f"{host[:16]}{' ...' if len(host) > 16 else ''}")
    cu_t = torch.tensor(cu, dtype=torch.long, device=rows.device)
    rows = rows.long()
    seq = torch.searchsorted(cu_t[1:], rows, right=True)  # the sequence whose end lies past the row
    start, C = cu_t[seq], (cu_t[seq + 1] - cu_t[seq]) // (2 * cp)
    chunk = (rows - start) // C
    second = chunk >= cp
    owner = torch.where(second, 2 * cp - 1 - chunk, chunk)
    local = start // cp + torch.where(second, C, 0) + (rows - start) % C
    index = torch.nonzero(owner == rank).flatten()
    return local[index], index


@functools.lru_cache(maxsize=64)
def _zigzag_index_cached(cu: tuple, cp: int, rank: int, device) -> torch.Tensor:  # cp_shift's: once per layout
    return zigzag_index(with_host_copy(torch.tensor(cu, dtype=torch.int64), cu), cp, rank).to(device)


def zigzag_shard(x: torch.Tensor, cu_seqlens: torch.Tensor, cp: int, rank: int) -> torch.Tensor:
    return x.index_select(0, zigzag_index(cu_seqlens, cp, rank))  # (T, ...) -> (T/cp, ...)


def zigzag_unshard(shards, cu_seqlens: torch.Tensor) -> torch.Tensor:
    """Inverse of zigzag_shard: list of cp shards (T/cp, ...) -> (T, ...)."""
    cp = len(shards)
    out = shards[0].new_empty((int(cu_seqlens[-1]),) + tuple(shards[0].shape[1:]))
    for r, x in enumerate(shards):
        out[zigzag_index(cu_seqlens, cp, r)] = x
    return out


# ------------------------------------------------------------------------------------------------- the CP-aware shift
def shift_packed(x, cu_seqlens, d: int, fill=0, lengths=None):
    """Unsharded reference: y_i = x_{i+d} within each sequence when 0 <= pos_i + d < length, else `fill`.
    `lengths` are the real lengths (default: the lengths in cu_seqlens). Returns (y, valid (T,) bool)."""
    pos, seq = position_ids(cu_seqlens), seq_ids(cu_seqlens)
    lengths = seq_lengths(cu_seqlens) if lengths is None else torch.as_tensor(lengths, dtype=torch.long,
                                                                               device=cu_seqlens.device)
    valid = (pos + d >= 0) & (pos + d < lengths[seq])
    src = torch.where(valid, torch.arange(len(pos), device=pos.device) + d, 0)
    y = torch.where(_bcast(valid, x), x[src], torch.as_tensor(fill, dtype=x.dtype))
    return y, valid


def cp_shift(x, cu_seqlens, d: int, *, group=None, fill=0, lengths=None):
    """shift_packed on this rank's zigzag shard x (T_local, ...), equal to sharding the unsharded shift.

    Communication: a shift by 0 < h <= C needs, for each local chunk, the first h rows of the next chunk — from rank
    r+1 for the first chunk and from rank r−1 for the second (module docstring). So one hop is two neighbour messages
    of S·h rows each; a shift by d takes ceil(|d| / min C) hops. A negative shift is the positive one on reversed
    sequences: reversing every sequence maps rank r's [chunk r, chunk 2cp−1−r] onto the same rank, reversed.
    Differentiable in x: the adjoint of shifting by d is shifting the (masked) gradient by −d."""
    ring = as_ring(group)
    check_cp_padded(cu_seqlens, ring.size)
    local_cu = tuple(c // ring.size for c in host_cu(cu_seqlens))
    T_local = local_cu[-1]
    if x.shape[0] != T_local:
        raise ValueError(f"x: expected {T_local} rows (this rank's shard of cu_seqlens over cp={ring.size}), "
                         f"got {x.shape[0]}")
    idx = _zigzag_index_cached(host_cu(cu_seqlens), ring.size, ring.rank, cu_seqlens.device)
    pos, seq = position_ids(cu_seqlens)[idx], seq_ids(cu_seqlens)[idx]
    lengths = seq_lengths(cu_seqlens) if lengths is None else torch.as_tensor(lengths, dtype=torch.long,
                                                                               device=cu_seqlens.device)
    valid = (pos + d >= 0) & (pos + d < lengths[seq])
    y = _CPShift.apply(x, local_cu, d, ring, valid)
    return torch.where(_bcast(valid, y), y, torch.as_tensor(fill, dtype=x.dtype)), valid


class _CPShift(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, local_cu, d, ring, valid):
        ctx.local_cu, ctx.d, ctx.ring, ctx.valid = local_cu, d, ring, valid
        return _shift_rows(x, local_cu, d, ring)

    @staticmethod
    def backward(ctx, dy):
        dy = torch.where(_bcast(ctx.valid, dy), dy, 0)  # rows that took `fill` pass no gradient back
        return _shift_rows(dy, ctx.local_cu, -ctx.d, ctx.ring), None, None, None, None


def _shift_rows(x, local_cu, d, ring):
    """x (T_local, ...) zigzag shard -> rows shifted by d within each (padded) sequence; rows past the end are 0.
    local_cu: the local boundaries as host ints."""
    bounds = [(o, (e - o) // 2) for o, e in zip(local_cu[:-1], local_cu[1:])]  # (offset, C) per sequence
    if d < 0:
        return _reverse_sequences(_shift_rows(_reverse_sequences(x, local_cu), local_cu, -d, ring), local_cu)
    nonempty = [C for _, C in bounds if C > 0]
    remaining = min(d, 2 * ring.size * max(nonempty, default=0))  # beyond the longest sequence all rows are fill
    while remaining > 0:
        h = min(remaining, min(nonempty))
        x, remaining = _shift_hop(x, bounds, h, ring), remaining - h
    return x


def _shift_hop(x, bounds, h, ring):  # one hop, 0 < h <= every C
    r, cp = ring.rank, ring.size
    head = lambda second: torch.cat([x[o + C * second: o + C * second + h] for o, C in bounds if C])  # noqa: E731
    from_next = x.new_empty(head(0).shape) if r < cp - 1 else None  # heads of rank r+1's first chunks
    from_prev = x.new_empty(head(0).shape) if r > 0 else None  # heads of rank r−1's second chunks
    sends = ([(r - 1, head(0))] if r > 0 else []) + ([(r + 1, head(1))] if r < cp - 1 else [])
    recvs = ([(r + 1, from_next)] if r < cp - 1 else []) + ([(r - 1, from_prev)] if r > 0 else [])
    ring.exchange(sends, recvs, "cp_shift").wait()  # sync point: tiny (S·h rows), needed before any row is written
    y, k = torch.zeros_like(x), 0
    for o, C in bounds:
        if not C:
            continue
        y[o: o + C - h] = x[o + h: o + C]  # first chunk: its own tail, then the next chunk's head
        y[o + C - h: o + C] = from_next[k: k + h] if r < cp - 1 else x[o + C: o + C + h]
        y[o + C: o + 2 * C - h] = x[o + C + h: o + 2 * C]  # second chunk: its own tail, then rank r−1's head
        if r > 0:
            y[o + 2 * C - h: o + 2 * C] = from_prev[k: k + h]
        k += h
    return y


def _reverse_sequences(x, local_cu):
    return x.index_select(0, _reversal_index(tuple(local_cu), x.device))


@functools.lru_cache(maxsize=64)
def _reversal_index(local_cu: tuple, device) -> torch.Tensor:  # built and copied once per layout, not per call
    idx = torch.cat([torch.arange(e - 1, s - 1, -1) for s, e in zip(local_cu[:-1], local_cu[1:])] or
                    [torch.zeros(0, dtype=torch.long)])
    return idx.to(device)


def _bcast(mask, x):  # (T,) -> broadcastable against x (T, ...)
    return mask.reshape(mask.shape + (1,) * (x.dim() - 1))


# ------------------------------------------------------------------------------------------- dense reference masks
def causal_mask(cu_seqlens) -> torch.Tensor:
    """(T, T) bool: query i sees key j iff same sequence and j <= i."""
    seq, pos = seq_ids(cu_seqlens), position_ids(cu_seqlens)
    return (seq[:, None] == seq[None, :]) & (pos[None, :] <= pos[:, None])


def branch_attention_mask(cu_seqlens, P: int) -> torch.Tensor:
    """(T, (1+P)·T) bool over keys [trunk | branch 0 | ... | branch P−1]: the trunk causally plus the P branch
    entries of the query's own anchor. This is what attention_cp.ring_branch_attention computes without building it."""
    T = int(cu_seqlens[-1])
    return torch.cat([causal_mask(cu_seqlens)] + [torch.eye(T, dtype=torch.bool)] * P, dim=1)


def anchor_attention_mask(cu_seqlens, anchors, W: int, P: int, anchor_visible: bool = True) -> torch.Tensor:
    """(N·W, T + N·P) bool over keys [trunk | anchor 0's P entries | ... | anchor N−1's]: query (n, w) (row n·W + w)
    sees trunk key j iff j is in anchor n's sequence and pos_j <= pos(a_n) (anchor_visible: TTT) or pos_j < pos(a_n)
    (a DFlash block), and all P entries of anchor n. anchors (N,): packed rows. What attention_cp.
    anchor_branch_attention computes without building it; TTT's branch_attention_mask is anchors = all rows, W = 1."""
    anchors = torch.as_tensor(anchors, dtype=torch.long).reshape(-1)
    seq, pos = seq_ids(cu_seqlens).cpu(), position_ids(cu_seqlens).cpu()
    a_seq, a_pos = seq[anchors], pos[anchors]
    seen = pos[None, :] <= a_pos[:, None] if anchor_visible else pos[None, :] < a_pos[:, None]
    trunk = (seq[None, :] == a_seq[:, None]) & seen  # (N, T)
    branch = torch.eye(len(anchors), dtype=torch.bool).repeat_interleave(P, dim=1)  # (N, N·P)
    return torch.cat([trunk, branch], dim=1).repeat_interleave(W, dim=0)


def ttt_labels(cu_seqlens, passes: int, convention: str = "diagonal"):
    """(pass d, sequence, anchor a) of every row of the TTT layout [pass 1 | ... | pass `passes`], each block T rows.

    "diagonal" (EAGLE-3, SpecForge, speculators): row i of every block is anchor i.
    "staircase" (Model Optimizer): row t of block d is the token at position t, i.e. anchor a = t − (d − 1); the first
    d−1 rows of each sequence hold no real anchor (a < 0) and its last d−1 anchors have no row."""
    if convention not in ("diagonal", "staircase"):
        raise ValueError(f"convention={convention!r}: expected 'diagonal' or 'staircase'")
    T = int(cu_seqlens[-1])
    d = torch.arange(1, passes + 1).repeat_interleave(T)
    seq, pos = seq_ids(cu_seqlens).repeat(passes), position_ids(cu_seqlens).repeat(passes)
    return d, seq, pos - (d - 1) if convention == "staircase" else pos


def ttt_mask(cu_seqlens, passes: int, convention: str = "diagonal") -> torch.Tensor:
    """(passes·T, passes·T) bool: pass d at anchor a sees trunk keys (pass 1) at anchors <= a and the keys of passes
    2..d at anchor a itself, all in the same sequence. In the diagonal layout the blocks are [causal | I | I ...]; in
    the staircase layout the identities slide down one row per pass (Model Optimizer's get_ttt_msk_func)."""
    d, seq, a = ttt_labels(cu_seqlens, passes, convention)
    trunk = (d[None, :] == 1) & (a[None, :] <= a[:, None])
    branch = (d[None, :] >= 2) & (d[None, :] <= d[:, None]) & (a[None, :] == a[:, None])
    return (seq[:, None] == seq[None, :]) & (trunk | branch)


def ttt_row_map(cu_seqlens, passes: int):
    """Rows of the two layouts holding the same (pass, sequence, anchor): (rows_diagonal, rows_staircase), both (R,).
    Every (d, a) with 0 <= a and a + d − 1 < L exists in both (the rows TTT trains on); the staircase row is the
    diagonal row moved down d − 1 places."""
    d, seq, a = ttt_labels(cu_seqlens, passes, "diagonal")
    rows = torch.nonzero(a + d - 1 < seq_lengths(cu_seqlens)[seq]).flatten()
    return rows, rows + d[rows] - 1


def tree_mask(parents, prefix_len: int = 0) -> torch.Tensor:
    """(N, prefix_len + N) bool for speculative verification of a token tree: node i sees the whole prefix (the
    context), its ancestors and itself. parents[i] = −1 for a root, else an earlier node (< i: topological order)."""
    parents = torch.as_tensor(parents, dtype=torch.long).reshape(-1)
    N = parents.numel()
    bad = [i for i, p in enumerate(parents.tolist()) if not -1 <= p < i]
    if bad:
        raise ValueError(f"parents: node(s) {bad} point at themselves, a later node or below -1; expected -1 <= "
                         f"parents[i] < i")
    m = torch.eye(N, dtype=torch.bool)
    for i, p in enumerate(parents.tolist()):
        if p >= 0:
            m[i] |= m[p]  # ancestors of i = ancestors of its parent, plus i
    return torch.cat([torch.ones(N, prefix_len, dtype=torch.bool), m], dim=1)


# ------------------------------------------------------------------------------------------------------------- demo
def _text(m: torch.Tensor) -> str:
    return "\n".join("".join("█" if v else "·" for v in row) for row in m.tolist())


if __name__ == "__main__":
    from parallel.cli import answer_help
    answer_help(__doc__, __file__)  # -h / --help: usage and summary from the docstring, exit 0
    import os

    cu = cu_seqlens_from_lengths([5, 3])
    pad = pad_for_cp(cu, cp=2)
    print(f"lengths [5, 3], cp=2 -> padded cu_seqlens {pad.cu_seqlens.tolist()}, real rows {pad.index.tolist()}")
    for r in range(2):
        print(f"  rank {r} holds packed rows {zigzag_index(pad.cu_seqlens, 2, r).tolist()}")
    print("\npacked causal mask (padded):\n" + _text(causal_mask(pad.cu_seqlens)))
    one = cu_seqlens_from_lengths([6])
    masks = {"TTT diagonal (3 passes, L=6)": ttt_mask(one, 3, "diagonal"),
             "TTT staircase (3 passes, L=6)": ttt_mask(one, 3, "staircase"),
             "tree: parents [-1,0,0,1,1,2], prefix 2": tree_mask([-1, 0, 0, 1, 1, 2], prefix_len=2)}
    for name, m in masks.items():
        print(f"\n{name}:\n{_text(m)}")
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise SystemExit("matplotlib not installed: text only")
    panels = {"packed causal, lengths [5,3] padded for cp=2": causal_mask(pad.cu_seqlens), **masks}
    fig, axes = plt.subplots(1, 4, figsize=(17, 4.6))
    for ax, (name, m) in zip(axes, panels.items()):
        ax.imshow(m.numpy(), cmap="Greys", vmin=0, vmax=1.6, interpolation="nearest")
        ax.set_title(name, fontsize=9)
        ax.set_xlabel("key")
        ax.set_ylabel("query")
    for ax in axes[1:3]:  # pass boundaries
        for b in (6, 12):
            ax.axhline(b - 0.5, color="tab:red", lw=0.8)
            ax.axvline(b - 0.5, color="tab:red", lw=0.8)
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "docs", "branch_masks.png")
    os.makedirs(os.path.dirname(path), exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"\nwrote {path}")
