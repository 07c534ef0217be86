"""Triton backend for the block computation of attention_cp.py: the same protocol as TorchBlocks (forward /
backward over a list of Segments, branch_forward / branch_backward), one kernel launch per ring step over all
segments. The algorithm, the layout and the merge are unchanged; only the block arithmetic moves into a kernel.

FlashAttention-2's online softmax, with the scores in base 2 (exp2 is one instruction on a GPU; exp is exp2 and a
multiply), for one query row over key tiles t = 1, 2, ...:

    1. s2_j = (tau log2 e) q.k_j                     (base-2 score: exp(tau q.k_j) = 2^s2_j)
    2. m <- max(m_old, max_j s2_j),  a = 2^(m_old - m)
       l <- a l + sum_j 2^(s2_j - m),   acc <- a acc + sum_j 2^(s2_j - m) v_j
    3. out = acc / l,   lse = ln 2 (m + log2 l)      (natural log: what the merge rule and the ring expect)

The partial result already in (out, lse) enters as tile 0 with m = lse log2 e, l = 1, acc = out (a finished partial
result is exactly that), so step 2 *is* the merge rule (4-5 of attention_cp.py) and the kernel merges in place.
Backward recomputes p_ij = 2^(s2_ij - lse_i log2 e) and adds the terms 6-10 of attention_cp.py: one kernel over
query tiles for dQ, one over key tiles for dK and dV (each program owns its rows: no atomics, deterministic); the
branch likewise, one kernel for dQ (kept in registers over the P entries) and one for dbk, dbv. The kernels themselves
are in attention_triton_kernels.py; this file holds the work tables, the launch settings and the protocol.

Work list: each Segment (q0, q1, k0, k1, causal) is cut into row tiles on the host (a small int32 table, one row per
program: rows [s, e) of the tiled side and the segment's bounds), so one launch covers every sequence of a packed
batch. Causal tiles stop at the diagonal (or, given KeyEnds, at their rows' key ends: the queries of anchors); the
longest tiles go first so the tail of the launch is short.

    python -m backends.attention_triton                        # GPU: the ring (cp = 1, 2 as threads) vs dense fp64
                                                               # (bf16)
    TRITON_INTERPRET=1 python -m backends.attention_triton     # CPU: the same through Triton's interpreter, fp32
    pytest -q tests/test_attention_triton.py          # vs TorchBlocks block by block, and end to end

Importing this module registers backend "triton". On CPU set TRITON_INTERPRET=1 *before* importing it (triton.jit
decides at decoration time whether a kernel is compiled or interpreted).

Letters: T query rows, Tk key rows, Hq / Hkv heads, G = Hq / Hkv (GQA group), D head dim (BD: D rounded up to a power
of 2), P branch entries per anchor, BM / BN query / key rows per tile, BR rows per branch program.
"""
from __future__ import annotations

import functools
import threading

import torch

try:
    import triton
except ImportError as e:  # the message names the backend: this module is imported when backend="triton" is requested
    raise ImportError('backend="triton" needs the triton package (pip install triton; on a CPU-only machine also set '
                      'TRITON_INTERPRET=1 to run its interpreter)') from e

from attention_cp import host_to_device, register_backend
from backends.attention_triton_kernels import (LOG2E, _branch_bwd_dkv_kernel, _branch_bwd_dq_kernel, _branch_fwd_kernel,
                                      _bwd_dkdv_kernel, _bwd_dq_kernel, _fwd_kernel)


# ----------------------------------------------------------------------------------------------- host-side wrapper
try:
    from triton.runtime.interpreter import InterpretedFunction
    INTERPRETED = isinstance(_fwd_kernel, InterpretedFunction)  # TRITON_INTERPRET=1 was set before this import
except ImportError:  # pragma: no cover - a triton without the interpreter module
    INTERPRETED = False
# The interpreter patches triton.language globally while a kernel runs, so two threads (the ranks of the in-process
# ThreadRing) must not interpret at once. Compiled kernels need no lock.
_INTERPRETER_LOCK = threading.Lock()


def _launch(kernel, grid, *args, **meta):
    if INTERPRETED:
        with _INTERPRETER_LOCK:
            kernel[grid](*args, **meta)
    else:
        kernel[grid](*args, **meta)


def _launch_groups(segments):
    """Segments one launch may take together. A program read-modify-writes its rows of out/lse/dq (query side) or
    dk/dv (key side), so the segments of one launch must not share query rows nor key rows; the ring's segments
    never do (one per sequence). Anything else (a hand-made overlapping list) runs one launch per segment."""
    segs = [s for s in segments if s.q1 > s.q0 and s.k1 > s.k0]

    def disjoint(spans):
        spans = sorted(spans)
        return all(a[1] <= b[0] for a, b in zip(spans, spans[1:]))

    if disjoint([(s.q0, s.q1) for s in segs]) and disjoint([(s.k0, s.k1) for s in segs]):
        return [segs] if segs else []
    return [[s] for s in segs]


def tile_table(segments, side: str, rows: int, device, ends=None) -> torch.Tensor:
    """The work list: (n_tiles, 6) int32, one row per program, longest first. side="q": tiles of `rows` query rows,
    each row (qs, qe, q0, k0, k1, causal); side="k": tiles of key rows, (ks, ke, k0, q0, q1, causal). causal is 0
    (full), 1 (the aligned diagonal) or, for a causal segment when the kernel has KeyEnds `ends`, 2 (per-row key
    ends; the kernels read the ends themselves, the table orders tiles by them).
    Built on the host once per (segments, side, rows, device) -- i.e. per (local cu_seqlens, ring step, side) -- and
    cached on the device: the other layers, and the backward, reuse it without a copy or a sync."""
    return _tile_table(tuple(segments), side, rows, torch.device(device), None if ends is None else ends.host)


@functools.lru_cache(maxsize=512)
def _tile_table(segments, side, rows, device, ends):
    seg = torch.tensor([tuple(s) for s in segments], dtype=torch.int64).reshape(-1, 5)  # (q0, q1, k0, k1, causal)
    if ends is not None:
        seg[:, 4] *= 2  # causal segments: per-row key ends
    if side == "k":
        seg = seg[:, [2, 3, 0, 1, 4]]  # the tiled side first: (k0, k1, q0, q1, causal)
    a0, a1, b0, b1, causal = seg.unbind(1)
    n = (a1 - a0 + rows - 1) // rows  # tiles per segment
    first = torch.cumsum(n, 0) - n
    j = torch.arange(int(n.sum())) - torch.repeat_interleave(first, n)  # tile index within its segment
    a0, a1, b0, b1, causal = (x.repeat_interleave(n) for x in (a0, a1, b0, b1, causal))
    s = a0 + j * rows
    e = torch.minimum(s + rows, a1)
    if ends is not None:  # the keys / queries each tile works on, by the rows' ends (non-decreasing in a segment)
        e_host = torch.tensor(ends, dtype=torch.int64)
        if side == "q":  # causal: keys up to the tile's last row's end
            work = torch.where(causal.bool(), torch.minimum(b1, e_host[e - 1]) - b0, b1 - b0)
        else:  # causal: queries from the first whose end lies past the tile's first key
            lo = torch.minimum(torch.maximum(torch.searchsorted(e_host, s, right=True), b0), b1)
            work = torch.where(causal.bool(), b1 - lo, b1 - b0)
    elif side == "q":  # causal: the tile's last query sees keys up to its own offset
        work = torch.where(causal.bool(), torch.minimum(b1 - b0, e - a0), b1 - b0)
    else:  # causal: the tile's first key is seen by the queries from its own offset on
        work = torch.where(causal.bool(), b1 - b0 - (s - a0), b1 - b0)
    table = torch.stack([s, e, a0, b0, b1, causal], 1)[torch.argsort(work, descending=True, stable=True)]
    return host_to_device(table.to(torch.int32), device)


def _ends_on(ends, device) -> torch.Tensor:
    """The kernels' Ends pointer: the rows' key ends (int64, contiguous), or a one-element stand-in they never read
    (no table row has causal = 2 then)."""
    if ends is None:
        return _no_ends(torch.device(device))
    return ends.dev if ends.dev.stride(0) == 1 or ends.dev.numel() < 2 else ends.dev.contiguous()


@functools.lru_cache(maxsize=8)
def _no_ends(device) -> torch.Tensor:
    return torch.zeros(1, dtype=torch.int64, device=device)


def check_tiles(name: str, tiles) -> tuple:
    """Tile sizes as given by a user: each a power of two (tl.arange) and >= 16 (a GPU tl.dot needs M, N, K >= 16;
    a smaller tile runs under the interpreter and fails, or computes garbage, only once compiled)."""
    tiles = tuple(tiles) if isinstance(tiles, (tuple, list)) else (tiles,)
    for t in tiles:
        if not isinstance(t, int) or t < 16 or t & (t - 1):
            raise ValueError(f"{name}={tiles}: every tile size must be a power of two >= 16 (GPU dots need K >= 16)")
    return tiles


def _tf32() -> bool:  # fp32 inputs on CUDA may use TF32 dots where torch's matmuls do (--dtype fp32 allows both)
    return bool(torch.backends.cuda.matmul.allow_tf32)


class TritonBlocks:
    """The block kernel protocol of attention_cp.TorchBlocks on Triton kernels. Inputs fp32/fp16/bf16 (fp32 uses
    exact-fp32 "ieee" dots, not TF32), accumulators (out, lse, dq, dk, dv) fp32.

    Tiles: fwd_tiles = (BM, BN) query x key rows for the forward; bwd_tiles = (outer, inner): the dQ kernel holds
    `outer` query rows and steps over `inner` key rows, the dK/dV kernel holds `outer` key rows and steps over `inner`
    query rows (dkdv_tiles overrides it for dK/dV alone); branch_rows = BR. None picks per head dim (config()).
    Every tile size must be a power of two >= 16."""

    def __init__(self, fwd_tiles=None, bwd_tiles=None, branch_rows=None, dkdv_tiles=None):
        self.fwd_tiles = None if fwd_tiles is None else check_tiles("fwd_tiles", fwd_tiles)
        self.bwd_tiles = None if bwd_tiles is None else check_tiles("bwd_tiles", bwd_tiles)
        self.dkdv_tiles = None if dkdv_tiles is None else check_tiles("dkdv_tiles", dkdv_tiles)
        self.branch_rows = None if branch_rows is None else check_tiles("branch_rows", branch_rows)[0]

    def config(self, q) -> dict:
        """Per kernel: (tiles, launch options), for inputs like q; and "const", the shared constexprs.

        Defaults by row size BD * bytes (BD = D rounded up to a power of two), chosen for register spills, not yet
        tuned for speed on a GPU. Measured with `python bench/triton_spills.py` (Triton 3.9 compiling for sm_90a,
        ptxas -v, bf16; bytes spilled per thread, the old default in brackets):
          <= 128 B (bf16 D <= 64):  fwd 128x64 (0), dq 128x32 (0), dK/dV 64x64 with 8 warps (40) [128x32: 92],
                                    branch 32 rows x 8 warps (0) [64 x 4 warps: 344 / 532 / 1236];
          <= 256 B (bf16 D = 128):  fwd 64x64 x 8 warps (0) [128x64: 504], dq 64x32 (0) [128x32: 360], dK/dV 32x16
                                    (4) [128x32: 2104; 64x64: 448], branch 16 rows x 8 warps (0) [64 x 4: 3036 /
                                    3380 / 15216 -- the (BR, D) fp32 q, dO, bk, bv and accumulators];
          wider (bf16 D = 256, fp32 D >= 128): fwd 32x16 (104) [64x32: 488], dq 32x16 (92), dK/dV 32x16 (84)
                                    [64x32: 2772], branch 16 rows (0 / 0 / 304).
        A spill is a round trip to local memory (L1/L2) on every use inside the inner loop."""
        BD = max(16, triton.next_power_of_2(q.shape[-1]))
        row = BD * q.element_size()
        s2, s3 = dict(num_stages=2), dict(num_stages=3)
        if row <= 128:
            fwd, dq, dkdv, br = ((128, 64), 8, s3), ((128, 32), 8, s2), ((64, 64), 8, s2), (32, 8)
        elif row <= 256:
            fwd, dq, dkdv, br = ((64, 64), 8, s3), ((64, 32), 8, s2), ((32, 16), 8, s2), (16, 8)
        else:
            fwd, dq, dkdv, br = ((32, 16), 4, s2), ((32, 16), 8, s2), ((32, 16), 8, s2), (16, 8)
        opt = lambda k: dict(num_warps=k[1], **k[2])  # noqa: E731
        dkdv_t = self.dkdv_tiles or self.bwd_tiles or dkdv[0]
        return {"fwd": (self.fwd_tiles or fwd[0], opt(fwd)), "dq": (self.bwd_tiles or dq[0], opt(dq)),
                "dkdv": (dkdv_t, opt(dkdv)),
                "branch": (self.branch_rows or br[0], dict(num_warps=br[1])),
                "const": dict(BD=BD, PRECISION="tf32" if q.dtype != torch.float32 or _tf32() else "ieee")}

    @staticmethod
    def _check(q, *accumulators):
        if q.dtype not in (torch.float32, torch.float16, torch.bfloat16):
            raise TypeError(f'backend="triton": inputs must be fp32, fp16 or bf16, got {q.dtype} '
                            f'(fp64 runs on backend="torch")')
        if INTERPRETED and q.dtype == torch.bfloat16:  # it would return garbage, not fail
            raise TypeError('backend="triton" under TRITON_INTERPRET=1: Triton\'s interpreter computes bf16 tl.dot on '
                            'the raw bit patterns (triton-lang/triton#11584); use fp16/fp32 there, bf16 on a GPU')
        if q.device.type == "cpu" and not INTERPRETED:
            raise RuntimeError('backend="triton" got CPU tensors but its kernels are compiled for a GPU; on CPU set '
                               'TRITON_INTERPRET=1 before importing attention_triton (Triton\'s interpreter)')
        for a in accumulators:
            if a.dtype != torch.float32 or a.stride(-1) != 1:
                raise TypeError(f'backend="triton": accumulators must be fp32 with a contiguous last dim, got '
                                f'{a.dtype} strides {a.stride()}')

    key_ends = True  # forward / backward take ends=KeyEnds (anchor_branch_attention needs it)

    def forward(self, q, k, v, segments, scale, out, lse, ends=None):
        """Merge attention of q (T, Hq, D) over k, v (Tk, Hkv, D) along `segments` into out (T, Hq, D), lse (T, Hq).
        ends: None (causal = the aligned diagonal) or KeyEnds, each query row's key end (attention_blocks.py)."""
        self._check(q, out, lse)
        e_dev = _ends_on(ends, q.device)
        q, k, v = (x if x.stride(-1) == 1 else x.contiguous() for x in (q, k, v))
        cfg = self.config(q)
        (BM, BN), opts = cfg["fwd"]
        const = cfg["const"]
        Hq, G, D = q.shape[1], q.shape[1] // k.shape[1], q.shape[2]
        for group in _launch_groups(segments):
            tiles = tile_table(group, "q", BM, q.device, ends)
            _launch(_fwd_kernel, (tiles.shape[0], Hq), q, k, v, out, lse, tiles, e_dev, q.stride(0), q.stride(1),
                    k.stride(0), k.stride(1), v.stride(0), v.stride(1), out.stride(0), out.stride(1), lse.stride(0),
                    scale * LOG2E, G, D, BM=BM, BN=BN, **const, **opts)

    def backward(self, q, k, v, dout, lse, delta, segments, scale, dq, dk, dv, ends=None):
        """Add this block's terms (steps 6-10) to dq (T, Hq, D) and dk, dv (Tk, Hkv, D); ends as in forward."""
        self._check(q, dout, lse, delta, dq, dk, dv)
        e_dev = _ends_on(ends, q.device)
        if dout.stride() != dq.stride() or dk.stride() != dv.stride() or lse.stride() != delta.stride():
            raise ValueError('backend="triton": dout/dq, dk/dv and lse/delta must share their layouts')
        q, k, v = (x if x.stride(-1) == 1 else x.contiguous() for x in (q, k, v))
        cfg = self.config(q)
        ((outer, inner), opts), ((outer_k, inner_k), opts_k) = cfg["dq"], cfg["dkdv"]
        const = cfg["const"]
        Hq, Hkv, D = q.shape[1], k.shape[1], q.shape[2]
        common = (q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), dq.stride(0),
                  dq.stride(1), lse.stride(0))
        for group in _launch_groups(segments):
            tiles = tile_table(group, "q", outer, q.device, ends)
            _launch(_bwd_dq_kernel, (tiles.shape[0], Hq), q, k, v, dout, lse, delta, dq, tiles, e_dev, *common,
                    scale * LOG2E, scale, Hq // Hkv, D, BM=outer, BN=inner, **const, **opts)
            tiles = tile_table(group, "k", outer_k, q.device, ends)
            _launch(_bwd_dkdv_kernel, (tiles.shape[0], Hkv), q, k, v, dout, lse, delta, dk, dv, tiles, e_dev, *common,
                    dk.stride(0), dk.stride(1), scale * LOG2E, scale, Hq // Hkv, D, BM=inner_k, BN=outer_k, **const,
                    **opts_k)

    def branch_forward(self, q, bk, bv, scale, acc):
        """q (T, Hq, D), bk, bv (T, P, Hkv, D) -> out (T, Hq, D), lse (T, Hq) in `acc` (fp32)."""
        T, Hq, D = q.shape
        out, lse = q.new_empty(T, Hq, D, dtype=acc), q.new_empty(T, Hq, dtype=acc)
        self._check(q, out, lse)
        if T == 0:  # a rank that holds no anchor: nothing to launch
            return out, lse
        q, bk, bv = (x if x.stride(-1) == 1 else x.contiguous() for x in (q, bk, bv))
        if bk.stride() != bv.stride():
            bk, bv = bk.contiguous(), bv.contiguous()
        cfg = self.config(q)
        BR, opts = cfg["branch"]
        _launch(_branch_fwd_kernel, (triton.cdiv(T, BR), Hq), q, bk, bv, out, lse, T, bk.shape[1], q.stride(0),
                q.stride(1), bk.stride(0), bk.stride(1), bk.stride(2), out.stride(0), out.stride(1), lse.stride(0),
                scale * LOG2E, Hq // bk.shape[2], D, BR=BR, BD=cfg["const"]["BD"], **opts)
        return out, lse

    def branch_backward(self, q, bk, bv, dout, lse, delta, scale, dq):
        """Steps 6-10 for the branch: adds to dq (T, Hq, D); returns dbk, dbv (T, P, Hkv, D) in dq's dtype."""
        self._check(q, dout, lse, delta, dq)
        if dout.stride() != dq.stride() or lse.stride() != delta.stride():
            raise ValueError('backend="triton": dout/dq and lse/delta must share their layouts')
        q, bk, bv = (x if x.stride(-1) == 1 else x.contiguous() for x in (q, bk, bv))
        if bk.stride() != bv.stride():
            bk, bv = bk.contiguous(), bv.contiguous()
        T, Hq, D = q.shape
        P, Hkv = bk.shape[1], bk.shape[2]
        dbk = torch.empty(bk.shape, dtype=dq.dtype, device=q.device)  # contiguous: dbk, dbv share strides
        dbv = torch.empty_like(dbk)
        if T == 0:
            return dbk, dbv
        cfg = self.config(q)
        BR, opts = cfg["branch"]
        common = (T, P, q.stride(0), q.stride(1), bk.stride(0), bk.stride(1), bk.stride(2), dq.stride(0), dq.stride(1),
                  lse.stride(0))
        _launch(_branch_bwd_dq_kernel, (triton.cdiv(T, BR), Hq), q, bk, bv, dout, lse, delta, dq, *common,
                scale * LOG2E, scale, Hq // Hkv, D, BR=BR, BD=cfg["const"]["BD"], **opts)
        _launch(_branch_bwd_dkv_kernel, (triton.cdiv(T, BR), Hkv), q, bk, bv, dout, lse, delta, dbk, dbv, *common,
                dbk.stride(0), dbk.stride(1), dbk.stride(2), scale * LOG2E, scale, Hq // Hkv, D, BR=BR,
                BD=cfg["const"]["BD"], **opts)
        return dbk, dbv


register_backend("triton", TritonBlocks())


# ------------------------------------------------------------------------------------------------------------- demo
if __name__ == "__main__":
    from parallel.cli import answer_help
    answer_help(__doc__, __file__)  # -h / --help: usage and summary from the docstring, exit 0
    from attention_cp import reference_branch_attention, ring_branch_attention
    from branch_mask import cu_seqlens_from_lengths, pad_for_cp, zigzag_shard, zigzag_unshard
    from parallel.ring import run_ranks

    dev = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if dev == "cuda" else torch.float32  # the interpreter has no bf16 dot
    g = torch.Generator().manual_seed(0)
    for cp in (1, 2):
        cu = pad_for_cp(cu_seqlens_from_lengths([37, 5, 64]), cp).cu_seqlens
        T, Hq, Hkv, D, P = int(cu[-1]), 4, 2, 16, 3
        full = [torch.randn(*s, generator=g, dtype=torch.float64) for s in
                ((T, Hq, D), (T, Hkv, D), (T, Hkv, D), (T, P, Hkv, D), (T, P, Hkv, D))]
        want = reference_branch_attention(*full[:3], cu, *full[3:])[0]

        def rank(ring):
            mine = [zigzag_shard(x, cu, cp, ring.rank).to(dev, dtype) for x in full]
            return ring_branch_attention(*mine[:3], cu, *mine[3:], group=ring, backend="triton").double().cpu()

        got = zigzag_unshard(run_ranks(cp, rank, timeout=600), cu)
        print(f"triton {dev} {dtype} cp={cp}: max |out - dense fp64| = {float((got - want).abs().max()):.2e}")
