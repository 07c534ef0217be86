"""flash-attn backend for the block computation of attention_cp.py: the trunk blocks of every ring step go through
flash-attn 2's varlen kernels (with their LSE), the local branch part through the PyTorch path, and the merge is the
one rule of attention_cp.py. Same algorithm, same layout; only the trunk block arithmetic changes.

A ring step's Segments (q0, q1, k0, k1, causal) become one varlen call per causal kind: sequence b of the call is
segment b, its queries are rows q0..q1 and its keys rows k0..k1, so

    cu_seqlens_q = [0, n_q(0), n_q(0) + n_q(1), ...]     cu_seqlens_k likewise,     q_var = q[q rows], k_var = k[k rows]

(a gather copy only when the rows are not already one contiguous run). flash-attn's causal mask is aligned at the
bottom right when n_q != n_k (query i sees key j iff j <= i + n_k - n_q); ours is aligned at the top left. They agree on
square segments, so a causal segment is first cut into a square causal part and, for n_q > n_k, a full part (queries
past the last key see all of them); for n_k > n_q the keys nobody sees are dropped. `varlen_plan` does all this and is
what the CPU tests check; the calls themselves need CUDA.

Backward: flash-attn computes delta_i = dO_i.out_i itself, from the `out` it is handed, but ours is
delta_i = dO_i.O_i - dlse_i (the lse is an output too). Any out'_i with dO_i.out'_i = delta_i gives the same gradients,
and out'_i = dO_i delta_i / |dO_i|^2 is one whose bf16 rounding costs a relative eps in delta (same as rounding O). Rows
with dO_i = 0 but delta_i != 0 have no such out'; a call that meets one (or an overflow) runs the PyTorch kernel.

    pip install "flash-attn>=2.7" --no-build-isolation           # CUDA only
    python -c "import backends.attention_flash"                   # registers backend "flash"
    python bench/bench_attention_gpu.py                          # torch vs triton vs flash on one GPU

Importing this module registers backend "flash" even without flash_attn; using it then raises an error that names
backend="flash" and what is missing (the package, CUDA tensors, fp16/bf16 inputs, a head dim the kernels take).

Letters: T query rows, Tk key rows, Hq / Hkv heads (flash-attn takes GQA natively), D head dim, N rows of a varlen
call, B sequences (= segments) of a varlen call.
"""
from __future__ import annotations

import functools
import re
from typing import NamedTuple

import torch

from attention_cp import Segment, TorchBlocks, host_to_device, merge_, register_backend
from branch_mask import cu_seqlens_from_lengths

MIN_VERSION = (2, 7)  # _flash_attn_varlen_forward/_backward with window_size_left/right and (Hq, total_q) LSE


def flash_interface(q: torch.Tensor | None = None):
    """flash_attn.flash_attn_interface, after checking that backend="flash" can run on q; else a RuntimeError that
    says every missing piece."""
    missing, fai = [], None
    try:
        import flash_attn
        from flash_attn import flash_attn_interface as fai
        got = tuple(int(x) for x in re.findall(r"\d+", flash_attn.__version__)[:2])
        if got < MIN_VERSION:
            missing.append(f"flash-attn >= {'.'.join(map(str, MIN_VERSION))} (installed: {flash_attn.__version__})")
    except ImportError as e:
        missing.append(f'the flash_attn package (pip install "flash-attn>={MIN_VERSION[0]}.{MIN_VERSION[1]}" '
                       f"--no-build-isolation; import failed with: {e})")
    if not torch.cuda.is_available():
        missing.append("a CUDA device (torch.cuda.is_available() is False)")
    if q is not None:
        if q.device.type != "cuda":
            missing.append(f"CUDA tensors (got {q.device})")
        if q.dtype not in (torch.float16, torch.bfloat16):
            missing.append(f'fp16/bf16 inputs (got {q.dtype}; fp32/fp64 run on backend="triton" or "torch")')
        if q.shape[-1] % 8 or q.shape[-1] > 256:
            missing.append(f"a head dim that is a multiple of 8 and <= 256 (got D={q.shape[-1]})")
    if missing:
        raise RuntimeError('backend="flash" is unavailable here; it needs ' + "; ".join(missing))
    return fai


class VarlenPlan(NamedTuple):
    """One flash-attn varlen call: q_var = q[q_rows], k_var = k[k_rows] (a slice when the rows are one run), the
    boundaries of its B sequences and their longest lengths."""
    q_rows: slice | torch.Tensor
    k_rows: slice | torch.Tensor
    cu_seqlens_q: torch.Tensor  # int32 (B+1,)
    cu_seqlens_k: torch.Tensor  # int32 (B+1,)
    max_seqlen_q: int
    max_seqlen_k: int
    causal: bool
    segments: list  # the (square-causal or full) Segments it covers, for the PyTorch fallback


def _square(seg: Segment):
    """Our top-left causal segment as flash-attn-compatible pieces: square causal, plus full rows below it."""
    nq, nk = seg.q1 - seg.q0, seg.k1 - seg.k0
    if not seg.causal or nq == nk:
        return [seg]
    if nk > nq:  # keys past the last query's offset are seen by nobody
        return [Segment(seg.q0, seg.q1, seg.k0, seg.k0 + nq, True)]
    return [Segment(seg.q0, seg.q0 + nk, seg.k0, seg.k1, True), Segment(seg.q0 + nk, seg.q1, seg.k0, seg.k1, False)]


def _rows(spans, device):
    """Row spans [(a, b), ...] -> a slice if they are one contiguous run (a view, no copy), else an index tensor."""
    if all(p[1] == n[0] for p, n in zip(spans, spans[1:])):
        return slice(spans[0][0], spans[-1][1])
    return host_to_device(torch.cat([torch.arange(a, b) for a, b in spans]), device)


def _cu(lengths, device):
    return host_to_device(cu_seqlens_from_lengths(lengths), device)


def varlen_plan(segments, device="cpu"):
    """Segments of one ring step -> flash-attn varlen calls: one per causal kind (causal ones squared first), split
    further only if query rows repeat within a kind (the merge writes each query row once per call). Cached per
    (segments, device): every layer and every step of a layout reuses its device tables."""
    return _varlen_plan(tuple(segments), torch.device(device))


@functools.lru_cache(maxsize=256)
def _varlen_plan(segments, device):
    pieces = [p for s in segments if s.q1 > s.q0 and s.k1 > s.k0 for p in _square(s)]
    plans = []
    for causal in (True, False):
        kind = [s for s in pieces if s.causal == causal]
        spans = sorted((s.q0, s.q1) for s in kind)
        groups = [kind] if all(a[1] <= b[0] for a, b in zip(spans, spans[1:])) else [[s] for s in kind]
        for group in groups:
            if not group:
                continue
            nq, nk = [s.q1 - s.q0 for s in group], [s.k1 - s.k0 for s in group]
            plans.append(VarlenPlan(_rows([(s.q0, s.q1) for s in group], device),
                                    _rows([(s.k0, s.k1) for s in group], device),
                                    _cu(nq, device), _cu(nk, device), max(nq), max(nk), causal, group))
    return plans


def out_for_delta(do, delta):
    """An `out` for flash-attn's backward, which computes delta_i = dO_i.out_i itself: out'_i = dO_i delta_i / |dO_i|^2
    in do's dtype (N, Hq, D), so that dO_i.out'_i = delta_i (ours, dlse included) up to one rounding of out', a
    relative error of eps * |delta_i| (|dO_i.err| <= eps sum_d |dO_id| |out'_id| = eps |delta_i|). None when some row
    has dO_i = 0 but delta_i != 0, or out' overflows do's dtype (fp16). do (N, Hq, D), delta (N, Hq) fp32."""
    d32 = do.float()
    norm2 = (d32 * d32).sum(-1)  # (N, Hq) |dO_i|^2
    out = (d32 * (delta / torch.where(norm2 > 0, norm2, 1.0)).unsqueeze(-1)).to(do.dtype)
    bad = ((norm2 == 0) & (delta != 0)).any() | ~torch.isfinite(out).all()
    if bool(bad):  # the one host sync: once per backward when called from FlashBlocks.prepare_backward
        return None
    return out


def _add_rows(acc, rows, x):  # acc[rows] += x; index_add_ also sums keys that appear twice
    if isinstance(rows, slice):
        acc[rows] += x
    else:
        acc.index_add_(0, rows, x.to(acc.dtype))


class FlashBlocks:
    """The block kernel protocol of attention_cp.TorchBlocks with flash-attn's varlen kernels for the trunk."""

    def __init__(self, deterministic: bool = False):
        self.deterministic = deterministic  # flash-attn's dQ uses atomics unless deterministic=True
        self.torch = TorchBlocks()  # the branch part, and the rare backward flash-attn cannot express

    def forward(self, q, k, v, segments, scale, out, lse):
        """Merge attention of q (T, Hq, D) over k, v (Tk, Hkv, D) along `segments` into out (T, Hq, D), lse (T, Hq)."""
        fai = flash_interface(q)
        for plan in varlen_plan(segments, q.device):
            out_b, lse_b = fai._flash_attn_varlen_forward(
                q[plan.q_rows], k[plan.k_rows], v[plan.k_rows], plan.cu_seqlens_q, plan.cu_seqlens_k,
                plan.max_seqlen_q, plan.max_seqlen_k, dropout_p=0.0, softmax_scale=scale, causal=plan.causal)[:2]
            # out_b (N, Hq, D) in q's dtype; lse_b (Hq, N) fp32, natural log. Squared segments leave no row without
            # keys (flash-attn would give such a row lse = +inf).
            o, l = out[plan.q_rows], lse[plan.q_rows]  # views for a slice, copies for an index
            merge_(o, l, out_b, lse_b.t())
            if not isinstance(plan.q_rows, slice):
                out[plan.q_rows], lse[plan.q_rows] = o, l

    def prepare_backward(self, q, dout, delta):
        """Once per backward, before the ring loop: dO in the input dtype and flash-attn's stand-in `out` for every
        row (out_for_delta and its one host check), which every ring step then slices."""
        do = dout.to(q.dtype)  # (T, Hq, D): flash-attn's dO is in the input dtype
        return _PreparedFlash(self, do, out_for_delta(do, delta))

    def backward(self, q, k, v, dout, lse, delta, segments, scale, dq, dk, dv, prepared=None):
        """Add this block's terms to dq (T, Hq, D) and dk, dv (Tk, Hkv, D). prepared = (dO, out') for all rows from
        prepare_backward (else computed here, with a host check per call)."""
        fai = flash_interface(q)
        do_all, fake_all = prepared or (None, None)
        if prepared is not None and fake_all is None:  # rare: a row flash-attn's backward cannot express
            return self.torch.backward(q, k, v, dout, lse, delta, segments, scale, dq, dk, dv)
        for plan in varlen_plan(segments, q.device):
            qv, kv, vv = q[plan.q_rows], k[plan.k_rows], v[plan.k_rows]
            if prepared is not None:
                do, out_fake = do_all[plan.q_rows], fake_all[plan.q_rows]
            else:
                do = dout[plan.q_rows].to(q.dtype)
                out_fake = out_for_delta(do, delta[plan.q_rows])
            if out_fake is None:
                self.torch.backward(q, k, v, dout, lse, delta, plan.segments, scale, dq, dk, dv)
                continue
            dq_b, dk_b, dv_b = torch.empty_like(qv), torch.empty_like(kv), torch.empty_like(vv)
            fai._flash_attn_varlen_backward(
                do, qv, kv, vv, out_fake, lse[plan.q_rows].t().contiguous(), dq_b, dk_b, dv_b, plan.cu_seqlens_q,
                plan.cu_seqlens_k, plan.max_seqlen_q, plan.max_seqlen_k, dropout_p=0.0, softmax_scale=scale,
                causal=plan.causal, window_size_left=-1, window_size_right=-1, softcap=0.0, alibi_slopes=None,
                deterministic=self.deterministic, rng_state=None)
            _add_rows(dq, plan.q_rows, dq_b)  # flash-attn sums the G query heads into dk_b, dv_b (Hkv heads)
            _add_rows(dk, plan.k_rows, dk_b)
            _add_rows(dv, plan.k_rows, dv_b)

    def branch_forward(self, q, bk, bv, scale, acc):
        flash_interface(q)  # one clear error, not a half-run ring, when flash-attn is missing
        return self.torch.branch_forward(q, bk, bv, scale, acc)

    def branch_backward(self, q, bk, bv, dout, lse, delta, scale, dq):
        return self.torch.branch_backward(q, bk, bv, dout, lse, delta, scale, dq)


class _PreparedFlash:
    """FlashBlocks for one backward: the per-row tensors prepared once (prepare_backward)."""

    def __init__(self, blocks, do, out_fake):
        self.blocks, self.prepared = blocks, (do, out_fake)

    def backward(self, *args):
        return self.blocks.backward(*args, prepared=self.prepared)

    def branch_backward(self, *args):
        return self.blocks.branch_backward(*args)


register_backend("flash", FlashBlocks())
