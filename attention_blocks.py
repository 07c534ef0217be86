"""The block computation under ring attention: exact attention of query segments over key segments, as mergeable
partial results. attention_cp.py decides *which* blocks each ring step needs; this file computes them.

For one query row q over a key set K (scale tau, FlashAttention's notation):

    1. s_j = tau * q.k_j            2. lse = log sum_j exp(s_j)            3. out = sum_j exp(s_j - lse) v_j

(step 2 in its stable form per tile: m = max_j s_j, l = sum_j exp(s_j - m), lse = m + log l, out = (sum_j ... v_j) / l).

Partial results over disjoint key sets A and B merge exactly (naive: recompute over A u B; stable form):

    4. lse = logaddexp(lse_A, lse_B)            5. out = exp(lse_A - lse) out_A + exp(lse_B - lse) out_B

An empty part has lse = -inf and weight exactly 0, so merging it changes nothing and never makes a NaN. Every partial
result in cospec (a tile, a ring step, the local branch) is folded in with this one rule, in >= fp32 (fp64 stays fp64).

Backward (FlashAttention-2), given the *final* lse and delta_i = dO_i.O_i - dlse_i (dlse: gradient reaching lse):

    6. p_ij = exp(s_ij - lse_i)     7. dv_j += sum_i p_ij dO_i     8. ds_ij = p_ij (dO_i.v_j - delta_i)
    9. dq_i += tau sum_j ds_ij k_j      10. dk_j += tau sum_i ds_ij q_i

so blocks need no merging going backward: each adds its own terms. Only tile x tile scores ever exist.

Backends: a kernel is any object with forward / backward / branch_forward / branch_backward as in TorchBlocks;
`register_backend("triton", kernel)` makes `ring_branch_attention(..., backend="triton")` use it. A kernel may also
have prepare_backward(q, dout, delta) -> kernel, called once per backward before the ring loop: work that depends on
the rows only (and any host check it needs) goes there, not into every ring step. No kernel reads the device inside a
ring step: host-side tables are cached per layout (host_to_device).

Letters: T rows (queries or keys), Hq / Hkv query / key-value heads, G = Hq / Hkv (GQA group), D head dim,
P branch entries per anchor, tq / tk tile rows.
"""
from __future__ import annotations

import importlib
from typing import NamedTuple

import torch

NEG_INF = float("-inf")


class Segment(NamedTuple):
    """Query rows [q0, q1) attend to key rows [k0, k1) of one sequence; causal: key offset k - k0 <= query offset
    q - q0 (aligned starts, as for a rank's own [chunk r, chunk 2cp-1-r] pair, whose positions increase)."""
    q0: int
    q1: int
    k0: int
    k1: int
    causal: bool


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
    """Tiled pure-PyTorch kernel: tiles of `tile` query rows x `tile` key rows, any device, fp64/fp32/bf16 inputs
    (tiles are upcast to the accumulator dtype, fp32 or fp64)."""

    def __init__(self, tile: int = 256):
        self.tile = tile

    def _tiles(self, seg: Segment):
        """(q tile, k tile, needs mask) pairs of a segment; causal tiles wholly above the diagonal are skipped."""
        t = self.tile
        for qs in range(seg.q0, seg.q1, t):
            qe = min(qs + t, seg.q1)
            for ks in range(seg.k0, seg.k1, t):
                ke = min(ks + t, seg.k1)
                if seg.causal and ks - seg.k0 > qe - 1 - seg.q0:
                    break
                yield slice(qs, qe), slice(ks, ke), seg.causal and ke - 1 - seg.k0 > qs - seg.q0

    @staticmethod
    def _scores(qh, kh, seg, qsl, ksl, masked):  # qh (Hkv, G*tq, D) pre-scaled by tau, kh (Hkv, tk, D)
        s = torch.bmm(qh, kh.transpose(1, 2))  # (Hkv, G*tq, tk): step 1, the tile's one big tensor
        if masked:
            qi = torch.arange(qsl.start - seg.q0, qsl.stop - seg.q0, device=s.device).repeat(s.shape[1] // (qsl.stop - qsl.start))
            kj = torch.arange(ksl.start - seg.k0, ksl.stop - seg.k0, device=s.device)
            s.masked_fill_(kj[None, :] > qi[:, None], NEG_INF)
        return s

    def forward(self, q, k, v, segments, scale, out, lse):
        """Merge attention of q (T, Hq, D) over k, v (Tk, Hkv, D) along `segments` into out (T, Hq, D), lse (T, Hq)."""
        acc, Hkv = out.dtype, k.shape[1]
        for seg in segments:
            for qsl, ksl, masked in self._tiles(seg):
                s = self._scores(_heads(q[qsl].to(acc) * scale, Hkv), _heads(k[ksl].to(acc), Hkv), seg, qsl, ksl,
                                 masked)
                m = _safe(s.amax(dim=-1, keepdim=True))  # (Hkv, G*tq, 1): row max, the usual stabiliser
                p = s.sub_(m).exp_()  # in place: the tile's scores become its unnormalised probabilities
                l = p.sum(dim=-1, keepdim=True)  # 0 for a row with no visible key in this tile
                o_t = torch.bmm(p, _heads(v[ksl].to(acc), Hkv)) / torch.where(l == 0, 1.0, l)  # (Hkv, G*tq, D)
                lse_t = m + torch.log(l)  # step 2: lse = m + log l (-inf where l = 0)
                merge_(out[qsl], lse[qsl], _unheads(o_t, (qsl.stop - qsl.start)), _unheads(lse_t, (qsl.stop - qsl.start)).squeeze(-1))

    def backward(self, q, k, v, dout, lse, delta, segments, scale, dq, dk, dv):
        """Add this block's terms (steps 6-10) to dq (T, Hq, D) and dk, dv (Tk, Hkv, D)."""
        acc, Hkv = dq.dtype, k.shape[1]
        for seg in segments:
            for qsl, ksl, masked in self._tiles(seg):
                qh = _heads(q[qsl].to(acc) * scale, Hkv)  # (Hkv, G*tq, D), pre-scaled
                doh = _heads(dout[qsl].to(acc), Hkv)
                kh, vh = _heads(k[ksl].to(acc), Hkv), _heads(v[ksl].to(acc), Hkv)  # (Hkv, tk, D)
                rows = lambda x: _heads(x[qsl].unsqueeze(-1), Hkv)  # noqa: E731  (T, Hq) -> (Hkv, G*tq, 1)
                p = self._scores(qh, kh, seg, qsl, ksl, masked).sub_(_safe(rows(lse))).exp_()  # (Hkv, G*tq, tk)
                dv[ksl] += torch.bmm(p.transpose(1, 2), doh).transpose(0, 1)
                ds = torch.bmm(doh, vh.transpose(1, 2)).sub_(rows(delta)).mul_(p)
                dq[qsl] += _unheads(torch.bmm(ds, kh), (qsl.stop - qsl.start)) * scale
                dk[ksl] += torch.bmm(ds.transpose(1, 2), qh).transpose(0, 1)  # qh carries the tau

    def branch_forward(self, q, bk, bv, scale, acc):
        """Each query row i over the P branch entries of its own anchor: q (T, Hq, D), bk, bv (T, P, Hkv, D) ->
        out (T, Hq, D), lse (T, Hq) in `acc`. Row tiles bound the upcast copies."""
        T, Hq, D = q.shape
        out, lse = q.new_empty(T, Hq, D, dtype=acc), q.new_empty(T, Hq, dtype=acc)
        for i in range(0, T, 8 * self.tile):
            r = slice(i, min(i + 8 * self.tile, T))
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
        for i in range(0, q.shape[0], 8 * self.tile):
            r = slice(i, min(i + 8 * self.tile, q.shape[0]))
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


BACKENDS = {"torch": TorchBlocks()}


def register_backend(name: str, kernel) -> None:
    """Make `backend=name` available to ring_branch_attention (e.g. a Triton or flash-attn kernel file calls this)."""
    BACKENDS[name] = kernel


_LAZY = {"triton": "attention_triton", "flash": "attention_flash"}  # GPU kernels: imported on first request


def get_backend(name: str):
    if name not in BACKENDS and name in _LAZY:
        importlib.import_module(_LAZY[name])  # registers itself; a missing triton / flash_attn names the backend
    if name not in BACKENDS:
        raise ValueError(f"backend={name!r} is not registered; known: {sorted(BACKENDS)} "
                         f"(add one with attention_blocks.register_backend)")
    return BACKENDS[name]
