"""Fused trunk + branch ring attention on one GPU: time, TFLOP/s and memory of the torch, triton and flash backends
of attention_cp.ring_branch_attention versus sequence length L (up to 256K), P = 3 branch entries, bf16.

The CP ring is simulated in process: cp virtual ranks are threads on the one GPU, exchanging K/V over the in-process
ThreadRing (branch_mask.py), so every rank runs the real per-rank code and the GPU executes all cp ranks' work one
kernel after another. Reported times are for the whole ring (all cp ranks' work), TFLOP/s is the FLOPs of all ranks
over that time, and memory is torch.cuda.max_memory_allocated over all ranks together (inputs excluded), also / cp.

FLOPs (FlashAttention's convention; one sequence of L tokens, Hq heads, head dim D):

    fwd = 4 Hq D (L (L + 1) / 2 + P L)      (two matmuls, the causal half of the trunk, plus the branch)
    fwd + bwd = 3.5 fwd                     (the backward's five matmuls = 2.5 fwd; recomputation not counted)

    python bench/bench_attention_gpu.py                               # H200: <= ~8 min
                                                                      # -> bench/results/attention_gpu.json
    python bench/bench_attention_gpu.py --lengths=4096,65536 --cp=8 --peak=989
    python bench/bench_attention_gpu.py --device=cpu --quick          # smoke run: tiny L, Triton's CPU interpreter

Sizes run in increasing L and the JSON is rewritten after every measurement, so a run cut short keeps what it has;
a (size, backend) whose estimated time (from the previous size, scaled by L^2) would pass --budget_s is skipped.
"""
from __future__ import annotations

import dataclasses
import json
import os
import platform
import sys
import time
from dataclasses import dataclass

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from parallel.cli import describe, flags_help, wants_help  # noqa: E402

# dense bf16 tensor-core peak in TFLOP/s (vendor datasheets), matched as a substring of the device name
PEAK_BF16_TFLOPS = {"H200": 989.0, "H100 PCIe": 756.0, "H100": 989.0, "H800": 989.0, "GH200": 989.0, "B200": 2250.0,
                    "A100": 312.0, "A800": 312.0, "L40S": 362.0, "L40": 181.0, "A10G": 70.0, "L4": 121.0,
                    "RTX 4090": 165.0, "RTX 3090": 71.0}


@dataclass
class Config:
    device: str = "cuda"
    lengths: str = "4096,16384,32768,65536,131072,262144"  # L of the one sequence, comma-separated, increasing
    cp: int = 4  # virtual CP ranks (threads)
    P: int = 3
    Hq: int = 32
    Hkv: int = 8
    D: int = 128
    dtype: str = "bf16"
    backends: str = "torch,triton,flash"
    triton_tiles: str = ""  # "BM,BN,outer,inner" overrides TritonBlocks' tile choice, e.g. 64,32,64,32
    torch_max_len: int = 32768  # the reference kernel loops over 512x512 tiles in Python: too slow beyond this
    repeats: int = 2  # timed runs per (L, backend, pass), after one warm-up run
    budget_s: float = 420.0  # stop starting measurements that would end after this
    peak: float = 0.0  # TFLOP/s; 0 = look the device name up in PEAK_BF16_TFLOPS
    quick: bool = False  # smoke run: tiny sizes and heads (for --device=cpu)
    out: str = ""  # JSON path; default bench/results/attention_gpu.json (quick: attention_gpu_quick.json)


def parse(argv) -> Config:
    """--key=value overrides of Config, type-checked; unknown keys are an error. --quick first swaps in the smoke
    preset (tiny sizes; fp32 and cp = 2 on CPU), which explicit overrides then change. -h / --help: the flags, then
    exit 0."""
    if wants_help(argv):
        print(describe(__doc__, __file__) + "\n\n" +
              flags_help(Config, default_title="flags (--key=value; a bool also as --key alone)"))
        raise SystemExit(0)
    cfg, fields = Config(), {f.name: f for f in dataclasses.fields(Config)}
    pairs = []
    for arg in argv:
        key, _, val = arg.removeprefix("--").partition("=")
        if not arg.startswith("--") or key not in fields:
            raise SystemExit(f"unknown argument {arg!r}; expected --key=value with key in {sorted(fields)}")
        typ = type(getattr(cfg, key))
        if typ is bool:
            if val not in ("", "1", "0", "true", "false", "True", "False"):
                raise SystemExit(f"--{key}: expected a bool, got {val!r}")
            val = val in ("", "1", "true", "True")
        else:
            try:
                val = typ(val)
            except ValueError:
                raise SystemExit(f"--{key}: expected {typ.__name__}, got {val!r}") from None
        pairs.append((key, val))
    given = dict(pairs)
    if given.get("quick"):
        cfg = dataclasses.replace(cfg, lengths="128,256", Hq=4, Hkv=2, D=16, repeats=1, torch_max_len=1 << 30)
        if given.get("device") == "cpu":
            cfg = dataclasses.replace(cfg, dtype="fp32", cp=2)  # the interpreter has no bf16 dot (attention_triton)
    cfg = dataclasses.replace(cfg, **given)
    cfg.out = cfg.out or os.path.join(ROOT, "bench", "results",
                                      "attention_gpu_quick.json" if cfg.quick else "attention_gpu.json")
    return cfg


def load_backends(cfg):
    """Import the kernel files (each registers its backend); a backend that cannot load is reported, not fatal."""
    if cfg.device == "cpu":
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before attention_triton: triton.jit decides at import
    from attention_cp import register_backend
    status = {}
    for name in cfg.backends.split(","):
        try:
            if name == "triton":
                from backends import attention_triton
                if cfg.triton_tiles:
                    t = [int(x) for x in cfg.triton_tiles.split(",")]
                    register_backend("triton", attention_triton.TritonBlocks(fwd_tiles=t[:2], bwd_tiles=t[2:4]))
            elif name == "flash":
                from backends import attention_flash
                attention_flash.flash_interface()  # the package and a CUDA device; dtype/D are checked per call
            status[name] = "ok"
        except (ImportError, RuntimeError) as e:
            status[name] = f"unavailable: {e}"
    return status


def fwd_flops(L, cfg):
    return 4 * cfg.Hq * cfg.D * (L * (L + 1) / 2 + cfg.P * L)


def make_inputs(L, cfg, dtype, seed=0):
    """Per virtual rank: its zigzag shard of q, k, v, branch_k, branch_v and dout, random (timing needs no global
    tensor: a rank's data only has to have its shape)."""
    T, dev = L // cfg.cp, cfg.device
    ranks = []
    for r in range(cfg.cp):
        g = torch.Generator(dev).manual_seed(seed * 1000 + r)
        rnd = lambda *s: torch.randn(*s, generator=g, device=dev, dtype=torch.float32).to(dtype)  # noqa: E731
        ranks.append(dict(q=rnd(T, cfg.Hq, cfg.D), k=rnd(T, cfg.Hkv, cfg.D), v=rnd(T, cfg.Hkv, cfg.D),
                          bk=rnd(T, cfg.P, cfg.Hkv, cfg.D), bv=rnd(T, cfg.P, cfg.Hkv, cfg.D),
                          dout=rnd(T, cfg.Hq, cfg.D)))
    return ranks


def run_ring(inputs, L, cfg, backend, backward):
    """One forward (and backward) of the whole simulated ring; returns rank 0's output (for the cross-check)."""
    from attention_cp import ring_branch_attention
    from parallel.ring import run_ranks
    cu = torch.tensor([0, L], dtype=torch.int32)

    def rank(ring):
        x = inputs[ring.rank]
        with torch.set_grad_enabled(backward):  # grad mode is per thread
            ins = [x[n].requires_grad_(backward) for n in ("q", "k", "v", "bk", "bv")]
            out = ring_branch_attention(ins[0], ins[1], ins[2], cu, ins[3], ins[4], group=ring, backend=backend)
            if backward:
                out.backward(x["dout"])
                for t in ins:
                    t.grad = None
        return out.detach() if ring.rank == 0 else None

    return run_ranks(cfg.cp, rank, timeout=600)[0]


def compile_once(cfg, backend, dtype):
    """A small cp = 1 forward + backward on this thread, so Triton compiles its kernels once, not in cp threads at
    the same time inside the first timed ring."""
    from attention_cp import ring_branch_attention
    L = 256
    x = make_inputs(L, dataclasses.replace(cfg, cp=1), dtype, seed=99)[0]
    ins = [x[n].requires_grad_() for n in ("q", "k", "v", "bk", "bv")]
    cu = torch.tensor([0, L], dtype=torch.int32)
    ring_branch_attention(ins[0], ins[1], ins[2], cu, ins[3], ins[4], backend=backend).backward(x["dout"])
    sync(cfg)


def sync(cfg):
    if cfg.device == "cuda":
        torch.cuda.synchronize()


def measure(L, cfg, backend, dtype):
    """Warm-up, then `repeats` timed runs of forward and of forward + backward; peak memory of fwd + bwd."""
    inputs = make_inputs(L, cfg, dtype)
    row = dict(L=L, backend=backend)
    sync(cfg)
    if cfg.device == "cuda":
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
    out0 = run_ring(inputs, L, cfg, backend, backward=True)  # warm-up (and Triton's compile at the first size)
    sync(cfg)
    if cfg.device == "cuda":
        peak = (torch.cuda.max_memory_allocated() - base) / 2**30
        row.update(peak_mem_gib=round(peak, 3), peak_mem_gib_per_rank=round(peak / cfg.cp, 3))
    for name, backward in (("fwd_ms", False), ("fwd_bwd_ms", True)):
        times = []
        for _ in range(cfg.repeats):
            sync(cfg)
            t0 = time.perf_counter()
            run_ring(inputs, L, cfg, backend, backward)
            sync(cfg)
            times.append(time.perf_counter() - t0)
        row[name] = round(1e3 * min(times), 3)
    F = fwd_flops(L, cfg)
    row["tflops_fwd"] = float(f"{F / row['fwd_ms'] / 1e9:.4g}")
    row["tflops_fwd_bwd"] = float(f"{3.5 * F / row['fwd_bwd_ms'] / 1e9:.4g}")
    return row, out0.float().cpu()


def machine(cfg):
    info = dict(python=platform.python_version(), torch=torch.__version__, host=platform.node())
    for mod in ("triton", "flash_attn"):
        try:
            info[mod] = __import__(mod).__version__
        except ImportError:
            info[mod] = None
    info["device"] = torch.cuda.get_device_name() if cfg.device == "cuda" else platform.processor() or "cpu"
    return info


def table(rows, peak):
    head = f"{'L':>8} {'backend':>8} {'fwd ms':>10} {'fwd+bwd ms':>11} {'TFLOP/s':>8} {'% peak':>7} {'mem GiB':>8} " \
           f"{'vs torch':>8}  note"
    lines = [head, "-" * len(head)]
    torch_ms = {r["L"]: r.get("fwd_bwd_ms") for r in rows if r["backend"] == "torch"}
    for r in rows:
        if "fwd_bwd_ms" not in r:
            lines.append(f"{r['L']:>8} {r['backend']:>8} {'':>10} {'':>11} {'':>8} {'':>7} {'':>8} {'':>8}  "
                         f"{r.get('status', '')[:70]}")
            continue
        pct = f"{100 * r['tflops_fwd_bwd'] / peak:.1f}" if peak else "n/a"
        vs = f"{torch_ms[r['L']] / r['fwd_bwd_ms']:.2f}x" if torch_ms.get(r["L"]) else ""
        mem = f"{r['peak_mem_gib']:.2f}" if "peak_mem_gib" in r else "n/a"
        lines.append(f"{r['L']:>8} {r['backend']:>8} {r['fwd_ms']:>10.2f} {r['fwd_bwd_ms']:>11.2f} "
                     f"{r['tflops_fwd_bwd']:>8.3g} {pct:>7} {mem:>8} {vs:>8}  {r.get('check', '')}")
    return "\n".join(lines)


def plot(rows, path):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    for backend in dict.fromkeys(r["backend"] for r in rows):
        pts = [(r["L"], r["fwd_bwd_ms"], r.get("peak_mem_gib")) for r in rows
               if r["backend"] == backend and "fwd_bwd_ms" in r]
        if pts:
            a.plot([p[0] for p in pts], [p[1] for p in pts], "o-", label=backend)
            if pts[0][2] is not None:
                b.plot([p[0] for p in pts], [p[2] for p in pts], "o-", label=backend)
    for ax, ylabel in ((a, "fwd + bwd time (ms), whole ring"), (b, "peak memory (GiB), all ranks")):
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("sequence length L")
        ax.set_ylabel(ylabel)
        if ax.lines:  # no memory curve on CPU
            ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return path


def main(argv):
    cfg = parse(argv)
    if cfg.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device=cuda but torch.cuda.is_available() is False; for a smoke run: --device=cpu --quick")
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[cfg.dtype]
    lengths = [int(x) for x in cfg.lengths.split(",")]
    bad = [L for L in lengths if L % (2 * cfg.cp)]
    if bad or lengths != sorted(lengths):
        raise SystemExit(f"--lengths must increase and be multiples of 2*cp={2 * cfg.cp}; got {lengths}")
    status = load_backends(cfg)
    info = machine(cfg)
    peak = cfg.peak or next((v for k, v in PEAK_BF16_TFLOPS.items() if k in info["device"]), 0.0)
    report = dict(machine=info, config=dataclasses.asdict(cfg), peak_tflops=peak or None, backends=status, rows=[])
    os.makedirs(os.path.dirname(cfg.out), exist_ok=True)
    t_start, last_s, ref_out = time.perf_counter(), {}, {}
    print(f"{info['device']}, peak {peak or 'unknown'} TFLOP/s, cp={cfg.cp} virtual ranks, Hq={cfg.Hq} Hkv={cfg.Hkv} "
          f"D={cfg.D} P={cfg.P} {cfg.dtype}; backends {status}")
    for L in lengths:
        for backend in cfg.backends.split(","):
            row = dict(L=L, backend=backend)
            elapsed = time.perf_counter() - t_start
            if status[backend] != "ok":
                row["status"] = status[backend]
            elif backend == "torch" and L > cfg.torch_max_len:
                row["status"] = f"skipped: L > torch_max_len={cfg.torch_max_len}"
            elif backend in last_s and elapsed + last_s[backend][1] * (L / last_s[backend][0]) ** 2 > cfg.budget_s:
                row["status"] = f"skipped: would pass budget_s={cfg.budget_s}"
            else:
                t0 = time.perf_counter()
                try:
                    if backend not in last_s:
                        compile_once(cfg, backend, dtype)
                    row, out = measure(L, cfg, backend, dtype)
                    if L == lengths[0]:  # all backends see the same inputs at the first size: cross-check them
                        ref = ref_out.setdefault("first", (backend, out))
                        row["check"] = f"max|out - {ref[0]}| = {float((out - ref[1]).abs().max()):.1e}"
                except torch.cuda.OutOfMemoryError as e:
                    row["status"] = f"OOM: {str(e)[:120]}"
                except (RuntimeError, TypeError, ValueError, TimeoutError) as e:  # a hung ring: a row, not a crash
                    row["status"] = f"error: {type(e).__name__}: {str(e)[:200]}"
                if cfg.device == "cuda":
                    torch.cuda.empty_cache()
                last_s[backend] = (L, (time.perf_counter() - t0))
            report["rows"].append(row)
            report["elapsed_s"] = round(time.perf_counter() - t_start, 1)
            with open(cfg.out, "w") as f:  # incremental: a run cut short keeps every finished row
                json.dump(report, f, indent=1)
            print(table(report["rows"], peak).splitlines()[-1], flush=True)
    print("\n" + table(report["rows"], peak))
    png = plot(report["rows"], cfg.out.removesuffix(".json") + ".png")
    print(f"\nwrote {cfg.out}" + (f" and {png}" if png else "") + f" in {report['elapsed_s']} s")


if __name__ == "__main__":
    from parallel.cli import run_main  # an error: one line, exit 1 (COSPEC_TRACEBACK=1: the traceback)
    run_main(main, __file__, sys.argv[1:])
