"""One long bf16 forward on a GPU: ring_branch_attention at T = 262144 tokens, Hq = 64, D = 128 (T * Hq * D = 2^31
elements: every offset must be int64), P = 3 branch entries, checked on sampled query rows against SDPA in fp32.

Row i of one sequence sees keys 0..i and its own P branch entries, so its exact output is SDPA over those i + 1 + P
keys (no mask needed): per kv head, the G query heads of row i form SDPA's "sequence" axis.

    python bench/gpu_long_forward.py                             # ~1 min on an H100/H200; needs ~20 GB
    python bench/gpu_long_forward.py --T=65536 --backend=flash

Letters: T tokens, Hq / Hkv heads, G = Hq / Hkv, D head dim, P branch entries.
"""
from __future__ import annotations

import os
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from parallel.cli import parser  # noqa: E402


def main():
    ap = parser(__doc__, __file__)
    ap.add_argument("--T", type=int, default=262144)
    ap.add_argument("--Hq", type=int, default=64)
    ap.add_argument("--Hkv", type=int, default=8)
    ap.add_argument("--D", type=int, default=128)
    ap.add_argument("--P", type=int, default=3)
    ap.add_argument("--rows", type=int, default=32, help="sampled query rows checked against SDPA")
    ap.add_argument("--backend", default="triton")
    ap.add_argument("--tol", type=float, default=2e-2, help="max |ours - SDPA fp32| over the sampled rows")
    a = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("needs CUDA")
    import attention_cp
    if a.backend == "triton":
        from backends import attention_triton  # noqa: F401  (registers the backend)
    elif a.backend == "flash":
        from backends import attention_flash  # noqa: F401
    T, Hq, Hkv, D, P, G = a.T, a.Hq, a.Hkv, a.D, a.P, a.Hq // a.Hkv
    g = torch.Generator("cuda").manual_seed(0)
    rnd = lambda *s: torch.randn(*s, generator=g, device="cuda", dtype=torch.bfloat16)  # noqa: E731
    q, k, v, bk, bv = rnd(T, Hq, D), rnd(T, Hkv, D), rnd(T, Hkv, D), rnd(T, P, Hkv, D), rnd(T, P, Hkv, D)
    cu = torch.tensor([0, T], dtype=torch.int32, device="cuda")
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    with torch.no_grad():
        out, lse = attention_cp.ring_branch_attention(q, k, v, cu, bk, bv, backend=a.backend, return_lse=True)
    torch.cuda.synchronize()
    dt = time.perf_counter() - t0
    rows = torch.cat([torch.tensor([0, T - 1]), torch.randint(T, (a.rows - 2,), generator=torch.Generator()
                                                              .manual_seed(1))]).tolist()
    err = 0.0
    for i in rows:
        keys = torch.cat([k[: i + 1], bk[i]]).float()  # (i + 1 + P, Hkv, D)
        vals = torch.cat([v[: i + 1], bv[i]]).float()
        qi = q[i].float().view(Hkv, G, D)  # SDPA batch = kv head, its "sequence" = the G query heads
        ref = F.scaled_dot_product_attention(qi, keys.transpose(0, 1), vals.transpose(0, 1)).reshape(Hq, D)
        err = max(err, float((out[i].float() - ref).abs().max()))
    finite = bool(torch.isfinite(out).all()) and bool(torch.isfinite(lse).all())
    ok = finite and err <= a.tol
    print(f"{a.backend} bf16 forward T={T} Hq={Hq} Hkv={Hkv} D={D} P={P}: {dt:.2f} s (incl. compile), "
          f"max |out - SDPA fp32| over {len(rows)} rows = {err:.2e} (tol {a.tol}), all finite: {finite}; "
          f"peak {torch.cuda.max_memory_allocated() / 2**30:.1f} GiB -> {'PASS' if ok else 'FAIL'}")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    from parallel.cli import run_main  # an error: one line, exit 1 (COSPEC_TRACEBACK=1: the traceback)
    run_main(main, __file__)
