"""The block computation of attention_cp.py: one ring step's attention of query rows over one block of K/V, tiled, with
the exact (out, lse) merge (steps 1-10 of attention_cp.py's docstring, which the code points back to).

A Segment says which query rows see which key rows. Its causal kind is either the aligned diagonal (a rank's own rows:
query offset i sees key offsets <= i) or, when the kernel is given KeyEnds, a per-row limit: query row i sees key rows
j < ends[i]. The second is how a query that belongs to an anchor (TTT's pass at anchor a, a DFlash block at anchor a)
sees the trunk up to its anchor: ends = a + 1 (anchor visible, j <= a) or a (j < a). Both kinds are non-decreasing in
i within a segment, so a query tile stops at its last row's limit and needs a mask only past its first row's.

    python attention_cp.py      # the ring over these blocks, cp = 1..4 as threads, vs dense fp64

Letters: T query rows, Tk key rows, Hq / Hkv heads, G = Hq / Hkv (GQA group), D head dim, P branch entries per anchor,
tq / tk tile rows.
"""
from __future__ import annotations

from typing import NamedTuple

import torch

# ------------------------------------------------------------------------------------------ block computation
NEG_INF = float("-inf")


class Segment(NamedTuple):
    """Query rows [q0, q1) attend to key rows [k0, k1) of one sequence. causal: query row i sees key rows j < end(i),
    end(i) = ends[i] when the kernel is given KeyEnds, else the aligned diagonal k0 + (i - q0) + 1 (key offset <= query
    offset, as for a rank's own [chunk r, chunk 2cp-1-r] pair, whose positions increase)."""
    q0: int
    q1: int
    k0: int
    k1: int
    causal: bool


class KeyEnds(NamedTuple):
    """Per query row, the end (exclusive) of the key rows its causal segments show it: non-decreasing in the row.
    The same numbers twice: on the host (tile bounds, work tables: no device read) and on the device (the masks)."""
    host: tuple  # (Tq,) python ints
    dev: torch.Tensor  # int64 (Tq,) on the queries' device


def causal_end(seg: Segment, i: int, ends) -> int:
    """end(i) of Segment's docstring: key rows j < end(i) are visible to query row i of a causal segment."""
    return ends.host[i] if ends is not None else seg.k0 + (i - seg.q0) + 1


def merge_(out, lse, out_b, lse_b):
    """(out, lse) <- (out, lse) (+) (out_b, lse_b) in place, steps 4-5. out (..., D), lse (...)."""
    new = torch.logaddexp(lse, lse_b)
    ref = torch.where(torch.isinf(new), 0.0, new)  # both parts empty: keep lse = -inf, weights exp(-inf) = 0
    out.mul_(torch.exp(lse - ref).unsqueeze(-1)).add_(torch.exp(lse_b - ref).unsqueeze(-1) * out_b)
    lse.copy_(new)


def _heads(x, Hkv):  # (t, Hq, D) -> (Hkv, G*t, D): each kv head's G query heads stacked, rows g-major
    t, Hq, D = x.shape
    return x.reshape(t, Hkv, Hq // Hkv, D).permute(1, 2, 0, 3).reshape(Hkv, Hq // Hkv * t, D)


def _unheads(x, t):  # inverse of _heads: (Hkv, G*t, D) -> (t, Hq, D)
    Hkv, Gt, D = x.shape
    return x.reshape(Hkv, Gt // t, t, D).permute(2, 0, 1, 3).reshape(t, Hkv * (Gt // t), D)


def _safe(lse):  # exp(s - lse) with lse = -inf (a row with no key in this tile) must give 0, not NaN
    return torch.where(torch.isinf(lse), 0.0, lse)


class TorchBlocks:
    """Tiled pure-PyTorch kernel: tiles of `tile` query rows (fewer past 8 query heads per kv head: _rows) x `tile`
    key rows, any device, fp64/fp32/bf16 inputs (tiles are upcast to the accumulator dtype, fp32 or fp64)."""

    key_ends = True  # forward / backward take ends=KeyEnds (anchor_branch_attention needs it)

    def __init__(self, tile: int = 256):
        self.tile = tile

    @staticmethod
    def _rows(rows: int, G: int) -> int:
        """Query rows per tile for G query heads per kv head: `rows` up to G = 8, fewer beyond, so that a tile holds at
        most 8 rows' worth of scores per kv head (anchor_branch_attention's W queries per anchor multiply G)."""
        return max(1, min(rows, rows * 8 // G))

    def _tiles(self, seg: Segment, ends=None, G: int = 1):
        """(q tile, k tile, needs mask) triples of a segment. end(i) is non-decreasing, so a causal q tile stops at its
        last row's end (tiles past every row's limit are skipped) and needs a mask only past its first row's."""
        t, tq = self.tile, self._rows(self.tile, G)
        for qs in range(seg.q0, seg.q1, tq):
            qe = min(qs + tq, seg.q1)
            first, last = (causal_end(seg, qs, ends), causal_end(seg, qe - 1, ends)) if seg.causal else (seg.k1,) * 2
            for ks in range(seg.k0, min(seg.k1, last), t):
                ke = min(ks + t, seg.k1)
                yield slice(qs, qe), slice(ks, ke), ke > first

    @staticmethod
    def _scores(qh, kh, seg, qsl, ksl, masked, ends):  # qh (Hkv, G*tq, D) pre-scaled by tau, kh (Hkv, tk, D)
        s = torch.bmm(qh, kh.transpose(1, 2))  # (Hkv, G*tq, tk): step 1, the tile's one big tensor
        if masked:  # key row j is hidden from query row i where j >= end(i)
            if ends is None:
                end = torch.arange(qsl.start, qsl.stop, device=s.device) + (seg.k0 - seg.q0 + 1)
            else:
                end = ends.dev[qsl]
            end = end.repeat(s.shape[1] // (qsl.stop - qsl.start))  # rows g-major, as _heads stacks them
            kj = torch.arange(ksl.start, ksl.stop, device=s.device)
            s.masked_fill_(kj[None, :] >= end[:, None], NEG_INF)
        return s

    def forward(self, q, k, v, segments, scale, out, lse, ends=None):
        """Merge attention of q (T, Hq, D) over k, v (Tk, Hkv, D) along `segments` into out (T, Hq, D), lse (T, Hq)."""
        acc, Hkv = out.dtype, k.shape[1]
        for seg in segments:
            for qsl, ksl, masked in self._tiles(seg, ends, q.shape[1] // Hkv):
                s = self._scores(_heads(q[qsl].to(acc) * scale, Hkv), _heads(k[ksl].to(acc), Hkv), seg, qsl, ksl,
                                 masked, ends)
                m = _safe(s.amax(dim=-1, keepdim=True))  # (Hkv, G*tq, 1): row max, the usual stabiliser
                p = s.sub_(m).exp_()  # in place: the tile's scores become its unnormalised probabilities
                l = p.sum(dim=-1, keepdim=True)  # 0 for a row with no visible key in this tile
                o_t = torch.bmm(p, _heads(v[ksl].to(acc), Hkv)) / torch.where(l == 0, 1.0, l)  # (Hkv, G*tq, D)
                lse_t = m + torch.log(l)  # step 2: lse = m + log l (-inf where l = 0)
                nq = qsl.stop - qsl.start
                merge_(out[qsl], lse[qsl], _unheads(o_t, nq), _unheads(lse_t, nq).squeeze(-1))

    def backward(self, q, k, v, dout, lse, delta, segments, scale, dq, dk, dv, ends=None):
        """Add this block's terms (steps 6-10) to dq (T, Hq, D) and dk, dv (Tk, Hkv, D)."""
        acc, Hkv = dq.dtype, k.shape[1]
        for seg in segments:
            for qsl, ksl, masked in self._tiles(seg, ends, q.shape[1] // Hkv):
                qh = _heads(q[qsl].to(acc) * scale, Hkv)  # (Hkv, G*tq, D), pre-scaled
                doh = _heads(dout[qsl].to(acc), Hkv)
                kh, vh = _heads(k[ksl].to(acc), Hkv), _heads(v[ksl].to(acc), Hkv)  # (Hkv, tk, D)
                rows = lambda x: _heads(x[qsl].unsqueeze(-1), Hkv)  # noqa: E731  (T, Hq) -> (Hkv, G*tq, 1)
                p = self._scores(qh, kh, seg, qsl, ksl, masked, ends).sub_(_safe(rows(lse))).exp_()  # (Hkv, G*tq, tk)
                dv[ksl] += torch.bmm(p.transpose(1, 2), doh).transpose(0, 1)
                ds = torch.bmm(doh, vh.transpose(1, 2)).sub_(rows(delta)).mul_(p)
                dq[qsl] += _unheads(torch.bmm(ds, kh), (qsl.stop - qsl.start)) * scale
                dk[ksl] += torch.bmm(ds.transpose(1, 2), qh).transpose(0, 1)  # qh carries the tau

    def branch_forward(self, q, bk, bv, scale, acc):
        """Each query row i over the P branch entries of its own anchor: q (T, Hq, D), bk, bv (T, P, Hkv, D) ->
        out (T, Hq, D), lse (T, Hq) in `acc`. Row tiles bound the upcast copies."""
        T, Hq, D = q.shape
        out, lse = q.new_empty(T, Hq, D, dtype=acc), q.new_empty(T, Hq, dtype=acc)
        rows = self._rows(8 * self.tile, Hq // bk.shape[2])
        for i in range(0, T, rows):
            r = slice(i, min(i + rows, T))
            qt = q[r].to(acc).unflatten(1, (bk.shape[2], -1))  # (t, Hkv, G, D)
            s = torch.einsum("thgd,tphd->thgp", qt, bk[r].to(acc)) * scale  # (t, Hkv, G, P)
            lse_t = torch.logsumexp(s, dim=-1)
            out[r] = torch.einsum("thgp,tphd->thgd", torch.exp(s - lse_t.unsqueeze(-1)), bv[r].to(acc)).flatten(1, 2)
            lse[r] = lse_t.flatten(1)
        return out, lse

    def branch_backward(self, q, bk, bv, dout, lse, delta, scale, dq):
        """Steps 6-10 for the branch: adds to dq (T, Hq, D); returns dbk, dbv (T, P, Hkv, D) in dq's dtype."""
        acc, Hkv = dq.dtype, bk.shape[2]
        dbk, dbv = torch.empty_like(bk, dtype=acc), torch.empty_like(bv, dtype=acc)
        rows = self._rows(8 * self.tile, q.shape[1] // Hkv)
        for i in range(0, q.shape[0], rows):
            r = slice(i, min(i + rows, q.shape[0]))
            qt, dot = (x[r].to(acc).unflatten(1, (Hkv, -1)) for x in (q, dout))  # (t, Hkv, G, D)
            bkt, bvt = bk[r].to(acc), bv[r].to(acc)
            s = torch.einsum("thgd,tphd->thgp", qt, bkt) * scale
            p = torch.exp(s - lse[r].unflatten(1, (Hkv, -1)).unsqueeze(-1))  # (t, Hkv, G, P)
            dbv[r] = torch.einsum("thgp,thgd->tphd", p, dot)
            ds = p * (torch.einsum("thgd,tphd->thgp", dot, bvt) - delta[r].unflatten(1, (Hkv, -1)).unsqueeze(-1))
            dq[r] += torch.einsum("thgp,tphd->thgd", ds, bkt).flatten(1, 2) * scale
            dbk[r] = torch.einsum("thgp,thgd->tphd", ds, qt) * scale
        return dbk, dbv


def host_to_device(t: torch.Tensor, device) -> torch.Tensor:
    """A small host-built table (tiles, row indices) onto `device` without a host sync: a pageable host->GPU copy
    waits for the stream, a pinned non_blocking one does not (the caching host allocator keeps the pinned buffer
    until the copy is done). Callers cache the result per layout, so it happens once per new layout."""
    device = torch.device(device)
    if device.type == "cuda":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)
