"""The memory claim of CP branch attention, measured: per-rank peak memory and time of one forward + backward of the
draft's attention (trunk causal + P = 3 branch entries per anchor) versus total tokens L and CP size, over gloo CPU
processes (one process per rank), one sequence of L tokens in the zigzag layout. Methods, side by side:

  ours            attention_cp.ring_branch_attention: trunk K/V ring, branch local, LSE merge. O((L/cp)(P+1)) per rank
  gathered        the prior approach (b): the draft's inputs all-gathered to full length on every rank (trunk and branch
                  K/V, as CP draft-training code gathers hidden states before the draft runs), then attention of the
                  local queries over them, tiled (same block kernel, no L x L scores). O((P+1) L) per rank
  trunk_gathered  (b'): all-gather of the trunk K/V only, branch local. O(L + P L/cp) per rank
  dense           (c): gathered inputs and a dense mask: scores of the local queries against all (1+P) L keys. O(L^2/cp)

Memory = growth of the rank process's peak resident set over its baseline, around the measured call: inputs (shard
of q, k, v, branch_k, branch_v, dout) are built first, then gc + malloc_trim(0), the kernel's high-water mark is
reset (`echo 5 > /proc/self/clear_refs`) and VmRSS read as the baseline; after forward + backward (+ gradient
all-reduce for the gathered methods) peak_bytes_per_rank = VmHWM - baseline, the max over ranks. glibc's mmap
threshold is pinned at its default 128 KiB (MALLOC_MMAP_THRESHOLD_; glibc otherwise raises it as big blocks are
freed): every tensor bigger than that is mapped on allocation and unmapped on free, so RSS follows live tensors
instead of heap the allocator keeps. Every method first runs once at a tiny size (warm-up: imports, gloo connections).
Seconds: wall time of the call, max over ranks (noisy on a shared 2-core machine; read the ratios). Rows whose
estimated memory (all ranks together) would pass --budget_gib are recorded as skipped (infeasible), not run.

    python bench/bench_attention.py             # full grid, ~25 min on 2 cores; bench/results/attention.{json,md,png}
    python bench/bench_attention.py --quick     # <= 2 min; bench/results/attention_quick.{json,md,png}
    python bench/bench_attention.py --replot    # table and plot again from bench/results/attention.json
"""
from __future__ import annotations

import ctypes
import dataclasses
import gc
import json
import math
import os
import platform
import sys
import tempfile
import time
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from attention_cp import BACKENDS, Segment, merge_  # noqa: E402
from attention_cp import ring_branch_attention  # noqa: E402
from parallel.cli import describe, flags_help, wants_help  # noqa: E402
from branch_mask import branch_attention_mask, zigzag_index, zigzag_unshard  # noqa: E402

METHODS = ("ours", "gathered", "trunk_gathered", "dense")


@dataclasses.dataclass
class Config:
    quick: bool = False
    P: int = 3
    Hq: int = 2  # small heads: the score work per token is what a 2-core CPU can afford at L = 64K
    Hkv: int = 1
    D: int = 32
    budget_gib: float = 10.0  # all ranks of one row together
    timeout_s: float = 1800.0  # per (L, cp) group of processes; a hang fails the row, never the benchmark
    out: str = ""  # path prefix; default bench/results/attention (quick: attention_quick)
    replot: bool = False  # rewrite the table and plot from <out>.json without measuring


def grid(cfg):
    """(L, cp, methods, (Hq, Hkv, D)) groups; every group is one set of cp fresh processes."""
    heads = (cfg.Hq, cfg.Hkv, cfg.D)
    if cfg.quick:
        return [(L, cp, METHODS if L == 2048 else METHODS[:3], heads) for L in (2048, 8192) for cp in (1, 2, 4)]
    rows = [(L, cp, METHODS if L <= 16384 or cp == 4 else ("ours", "gathered", "dense"), heads)
            for L in (4096, 16384, 65536) for cp in (1, 2, 4, 8)]
    return rows + [(262144, 8, ("ours",), (1, 1, cfg.D))]  # the long-context row: small heads, ours only


# --------------------------------------------------------------------------------------------- memory measurement
def _status(key):
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(key))


def reset_peak() -> int:
    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)  # hand free heap pages back, so the baseline is live memory only
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # VmHWM := VmRSS
    return _status("VmRSS:")


def estimate_bytes(method, L, cp, P, Hq, Hkv, D) -> float:
    """Rough per-rank bytes, only to skip rows that cannot fit (fp32)."""
    T = L // cp
    if method == "ours":
        return 4 * T * (8 * Hq * D + (8 + 2 * P) * Hkv * D) + 64e6
    if method == "dense":
        return 4 * 4 * Hq * T * (1 + P) * L + L * (1 + P) * L + 4 * 6 * (1 + P) * L * Hkv * D
    kv = (1 + P) if method == "gathered" else 1
    return 4 * 5 * kv * L * Hkv * D + 4 * T * (8 * Hq * D + 2 * P * Hkv * D) + 64e6


# ---------------------------------------------------------------------------------------------- the three baselines
class GatherZigzag(torch.autograd.Function):
    """(T_local, ...) shard -> (L, ...) full tensor in global order on every rank; backward: all-reduce the full
    gradient, keep my rows (gloo has no reduce-scatter; the memory is the same full-length gradient)."""

    @staticmethod
    def forward(ctx, x, cu, group, idx):
        parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, x.contiguous(), group=group)
        ctx.group, ctx.idx = group, idx
        return zigzag_unshard(parts, cu)

    @staticmethod
    def backward(ctx, g):
        g = g.contiguous()
        dist.all_reduce(g, group=ctx.group)
        return g.index_select(0, ctx.idx), None, None, None


def gathered_segments(cu, cp, rank):
    """Local query chunks over full-length keys: everything before the chunk, then the chunk itself causally."""
    segs, off = [], 0
    for start, L in zip(cu[:-1].tolist(), (cu[1:] - cu[:-1]).tolist()):
        C = L // (2 * cp)
        for half, c in enumerate((rank, 2 * cp - 1 - rank)):
            q0 = off + half * C
            if c:
                segs.append(Segment(q0, q0 + C, start, start + c * C, False))
            segs.append(Segment(q0, q0 + C, start + c * C, start + (c + 1) * C, True))
        off += 2 * C
    return segs


class SegmentAttention(torch.autograd.Function):
    """Local queries over given (full-length) K/V along segments, plus a local branch: attention_cp's kernel."""

    @staticmethod
    def forward(ctx, q, k, v, bk, bv, segments, scale):
        kernel = BACKENDS["torch"]
        out = torch.zeros_like(q)
        lse = q.new_full(q.shape[:2], float("-inf"))
        kernel.forward(q, k, v, segments, scale, out, lse)
        merge_(out, lse, *kernel.branch_forward(q, bk, bv, scale, q.dtype))
        ctx.save_for_backward(q, k, v, bk, bv, out, lse)
        ctx.segments, ctx.scale = segments, scale
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, bk, bv, out, lse = ctx.saved_tensors
        kernel, delta = BACKENDS["torch"], (dout * out).sum(-1)
        dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
        kernel.backward(q, k, v, dout, lse, delta, ctx.segments, ctx.scale, dq, dk, dv)
        dbk, dbv = kernel.branch_backward(q, bk, bv, dout, lse, delta, ctx.scale, dq)
        return dq, dk, dv, dbk, dbv, None, None


def attend(method, q, k, v, bk, bv, cu, group, rank, cp):
    scale = 1.0 / math.sqrt(q.shape[-1])
    if method == "ours":
        return ring_branch_attention(q, k, v, cu, bk, bv, group=group)
    idx = zigzag_index(cu, cp, rank)
    full = lambda x: GatherZigzag.apply(x, cu, group, idx)  # noqa: E731
    kf, vf = full(k), full(v)
    if method == "trunk_gathered":
        return SegmentAttention.apply(q, kf, vf, bk, bv, gathered_segments(cu, cp, rank), scale)
    bkf, bvf = full(bk), full(bv)  # the draft ran on the full length: its branch K/V exist for every anchor
    if method == "gathered":
        return SegmentAttention.apply(q, kf, vf, bkf[idx], bvf[idx], gathered_segments(cu, cp, rank), scale)
    P, G = bk.shape[1], q.shape[1] // k.shape[1]  # dense: scores (Hq, T_local, (1+P) L) and an explicit mask
    keys = torch.cat([kf] + [bkf[:, p] for p in range(P)]).repeat_interleave(G, 1)
    vals = torch.cat([vf] + [bvf[:, p] for p in range(P)]).repeat_interleave(G, 1)
    s = torch.einsum("qhd,khd->hqk", q * scale, keys).masked_fill(~branch_attention_mask(cu, P)[idx], float("-inf"))
    return torch.einsum("hqk,khd->qhd", torch.softmax(s, -1), vals)


# ------------------------------------------------------------------------------------------------------ one rank
def rank_main(rank, cp, store_path, L, methods, heads, P, q_out):
    try:
        torch.set_num_threads(1)  # ranks share the cores; intra-op threads on a busy machine only add stalls
        dist.init_process_group("gloo", store=dist.FileStore(store_path, cp), rank=rank, world_size=cp)
        group, (Hq, Hkv, D) = dist.group.WORLD, heads
        cu, T = torch.tensor([0, L], dtype=torch.int32), L // cp
        g = torch.Generator().manual_seed(1000 * rank + L)

        def inputs(T):
            rnd = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
            x = [rnd(T, Hq, D), rnd(T, Hkv, D), rnd(T, Hkv, D), rnd(T, P, Hkv, D), rnd(T, P, Hkv, D)]
            return [t.requires_grad_() for t in x], rnd(T, Hq, D)

        for method in methods:  # warm-up at a tiny size: lazy imports, gloo connections, first-call caches
            x, dout = inputs(64)
            (attend(method, *x, torch.tensor([0, 64 * cp], dtype=torch.int32), group, rank, cp) * dout).sum().backward()
        for method in methods:
            x, dout = inputs(T)
            in_bytes = sum(t.numel() * 4 for t in x) + dout.numel() * 4
            dist.barrier()
            base = reset_peak()
            t0 = time.perf_counter()
            try:
                (attend(method, *x, cu, group, rank, cp) * dout).sum().backward()
                status = "ok"
            except (RuntimeError, MemoryError) as e:  # the allocator's "can't allocate memory"
                status = "out of memory" if "alloc" in str(e) or isinstance(e, MemoryError) else f"error: {e}"
            seconds = time.perf_counter() - t0
            peak = _status("VmHWM:") - base
            q_out.put((rank, method, dict(peak=peak, seconds=seconds, inputs=in_bytes, status=status)))
            del x, dout
            if status != "ok":
                break  # the other ranks may be stuck in a collective: let the parent end the group
            dist.barrier()
        dist.destroy_process_group()
    except BaseException:  # noqa: BLE001 - reported to the parent
        q_out.put((rank, None, traceback.format_exc()))


def run_group(L, cp, methods, heads, cfg):
    """Spawn cp ranks, run `methods` in turn; returns {method: row}. Skipped rows are decided here, before spawning."""
    rows, todo = {}, []
    for m in methods:
        est = estimate_bytes(m, L, cp, cfg.P, *heads) * cp
        base = dict(method=m, L=L, cp=cp, P=cfg.P, Hq=heads[0], Hkv=heads[1], head_dim=heads[2])
        if est > cfg.budget_gib * 2**30:
            rows[m] = dict(base, peak_bytes_per_rank=None, input_bytes_per_rank=None, seconds=None,
                           status=f"skipped: infeasible (est. {est / 2**30:.0f} GiB > {cfg.budget_gib:g} GiB)")
        else:
            rows[m] = dict(base, peak_bytes_per_rank=None, input_bytes_per_rank=None, seconds=None, status="not run")
            todo.append(m)
    if not todo:
        return rows
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        procs = [ctx.Process(target=rank_main, args=(r, cp, os.path.join(tmp, "store"), L, todo, heads, cfg.P, q),
                             daemon=True) for r in range(cp)]
        for p in procs:
            p.start()
        got, deadline = {}, time.monotonic() + cfg.timeout_s
        try:
            while len(got) < cp * len(todo):
                try:
                    rank, m, res = q.get(timeout=1.0)
                except Exception:  # queue.Empty: check for dead ranks (the OOM killer) and the deadline
                    dead = [p.exitcode for p in procs if p.exitcode not in (None, 0)]
                    if dead or time.monotonic() > deadline:
                        why = "out of memory (killed)" if -9 in dead else ("timeout" if not dead else f"died {dead}")
                        for mm in todo:
                            if rows[mm]["status"] == "not run":
                                rows[mm]["status"] = why
                        break
                    continue
                if m is None:
                    print(res, file=sys.stderr)
                    break
                got[(rank, m)] = res
                per = [got[(r, m)] for r in range(cp) if (r, m) in got]
                if len(per) == cp:
                    bad = [x["status"] for x in per if x["status"] != "ok"]
                    rows[m].update(peak_bytes_per_rank=max(x["peak"] for x in per),
                                   input_bytes_per_rank=max(x["inputs"] for x in per),
                                   seconds=round(max(x["seconds"] for x in per), 3), status=bad[0] if bad else "ok")
                elif res["status"] != "ok":
                    rows[m]["status"] = res["status"]
                    break
        finally:
            for p in procs:
                p.join(timeout=2.0)
                if p.is_alive():
                    p.kill()
    return rows


# ------------------------------------------------------------------------------------------------------- reporting
def claims(rows):
    """The three headline numbers, from the ours / gathered rows (None where a row is missing)."""
    ok = {(r["method"], r["L"], r["cp"], r["Hq"]): r["peak_bytes_per_rank"] for r in rows if r["status"] == "ok"}
    out = {"ours_mem_cp1_over_cp4": {}, "ours_over_gathered_cp4": {}}
    for (m, L, cp, H), b in ok.items():
        if m == "ours" and cp == 4 and L >= 65536:
            if ("ours", L, 1, H) in ok:
                out["ours_mem_cp1_over_cp4"][L] = round(ok[("ours", L, 1, H)] / b, 2)
            if ("gathered", L, 4, H) in ok:
                out["ours_over_gathered_cp4"][L] = round(b / ok[("gathered", L, 4, H)], 3)
    long = [r for r in rows if r["method"] == "ours" and r["L"] >= 262144 and r["cp"] == 8]
    out["ours_256K_cp8"] = long[0]["status"] if long else None
    return out


def markdown(rows, cl, cmd, machine):
    mib = lambda b: "" if b is None else f"{b / 2**20:.1f}"  # noqa: E731
    lines = [f"`{cmd}` on {machine}", "",
             "| method | L | cp | P | heads (q/kv) | head dim | peak MiB / rank | inputs MiB / rank | seconds "
             "| status |",
             "|---|---:|---:|---:|---|---:|---:|---:|---:|---|"]
    for r in rows:
        lines.append(f"| {r['method']} | {r['L']} | {r['cp']} | {r['P']} | {r['Hq']}/{r['Hkv']} | {r['head_dim']} | "
                     f"{mib(r['peak_bytes_per_rank'])} | {mib(r['input_bytes_per_rank'])} | "
                     f"{'' if r['seconds'] is None else r['seconds']} | {r['status']} |")
    lines += ["", f"ours, mem(cp=1) / mem(cp=4): {cl['ours_mem_cp1_over_cp4']}  (target >= 2.5)",
              f"ours / gathered at cp=4: {cl['ours_over_gathered_cp4']}  (target <= 0.5)",
              f"ours at L=256K, cp=8, fwd+bwd: {cl['ours_256K_cp8']}"]
    return "\n".join(lines) + "\n"


def plot(rows, path):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    style = {"ours": "-", "gathered": "--", "trunk_gathered": ":", "dense": "-."}
    main_heads = max({(r["Hq"], r["Hkv"], r["head_dim"]) for r in rows},
                     key=lambda h: sum((r["Hq"], r["Hkv"], r["head_dim"]) == h for r in rows))
    for m in METHODS:
        for cp in sorted({r["cp"] for r in rows}):
            for heads in sorted({(r["Hq"], r["Hkv"], r["head_dim"]) for r in rows}):
                pts = sorted((r["L"], r["peak_bytes_per_rank"] / 2**20, r["seconds"]) for r in rows
                             if (r["method"], r["cp"], (r["Hq"], r["Hkv"], r["head_dim"])) == (m, cp, heads)
                             and r["status"] == "ok")
                if not pts:
                    continue
                other = heads != main_heads  # a row with other heads is its own series, marked by a star
                kw = dict(ls=style[m], marker="*" if other else "o", ms=9 if other else 3,
                          color=f"C{[1, 2, 4, 8].index(cp) if cp in (1, 2, 4, 8) else 5}",
                          label=f"{m} cp={cp}" + (f" (heads {heads[0]}/{heads[1]})" if other else ""))
                axes[0].plot([p[0] for p in pts], [p[1] for p in pts], **kw)
                axes[1].plot([p[0] for p in pts], [p[2] for p in pts], **kw)
    h = main_heads
    for ax, title in zip(axes, (f"peak memory growth per rank (MiB), P=3, heads {h[0]}/{h[1]}, D={h[2]}",
                                "fwd+bwd seconds (slowest rank; 2 shared cores)")):
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("total tokens L")
        ax.set_title(title, fontsize=10)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return True


def parse(argv) -> Config:
    """--key=value overrides of Config, type-checked; unknown keys are an error. -h / --help: the flags, exit 0."""
    if wants_help(argv):
        print(describe(__doc__, __file__) + "\n\n" +
              flags_help(Config, default_title="flags (--key=value; a bool also as --key alone)"))
        raise SystemExit(0)
    cfg, fields = Config(), {f.name: f for f in dataclasses.fields(Config)}
    for arg in argv:
        key, _, val = arg.removeprefix("--").partition("=")
        if not arg.startswith("--") or key not in fields:
            raise SystemExit(f"unknown argument {arg!r}; expected --key=value with key in {sorted(fields)}")
        typ = type(getattr(cfg, key))
        try:
            setattr(cfg, key, val in ("", "1", "true", "True") if typ is bool else typ(val))
        except ValueError:
            raise SystemExit(f"--{key}: expected {typ.__name__}, got {val!r}") from None
    cfg.out = cfg.out or os.path.join(ROOT, "bench", "results", "attention_quick" if cfg.quick else "attention")
    return cfg


def main(argv):
    cfg = parse(argv)
    os.environ["MALLOC_MMAP_THRESHOLD_"] = str(128 << 10)  # inherited by the spawned ranks (glibc reads it at start)
    machine = f"{platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}, gloo CPU processes"
    cmd = "python bench/bench_attention.py" + (" " + " ".join(argv) if argv else "")
    os.makedirs(os.path.dirname(cfg.out), exist_ok=True)
    rows, t0 = [], time.time()
    if cfg.replot:
        with open(cfg.out + ".json") as f:
            saved = json.load(f)
        rows, cmd, machine = saved["rows"], saved["command"], saved["machine"]
    for L, cp, methods, heads in [] if cfg.replot else grid(cfg):
        for m, r in run_group(L, cp, methods, heads, cfg).items():
            rows.append(r)
            peak = "" if r["peak_bytes_per_rank"] is None else f"{r['peak_bytes_per_rank'] / 2**20:9.1f} MiB/rank"
            secs = "" if r["seconds"] is None else f"{r['seconds']:8.2f}s"
            print(f"[{time.time() - t0:6.0f}s] {m:15s} L={L:7d} cp={cp} {peak:>18s} {secs:>9s} {r['status']}",
                  flush=True)
        cl = claims(rows)  # rewritten after every group: a run cut short keeps what it has
        with open(cfg.out + ".json", "w") as f:
            json.dump(dict(command=cmd, machine=machine, config=dataclasses.asdict(cfg), rows=rows, claims=cl), f,
                      indent=1)
    cl = claims(rows)
    md = markdown(rows, cl, cmd, machine)
    with open(cfg.out + ".md", "w") as f:
        f.write(md)
    print("\n" + md)
    if plot(rows, cfg.out + ".png"):
        print(f"wrote {cfg.out}.json, .md, .png")


if __name__ == "__main__":
    from parallel.cli import run_main  # an error: one line, exit 1 (COSPEC_TRACEBACK=1: the traceback)
    run_main(main, __file__, sys.argv[1:])
