"""The streamed LM head's precision and speed on one device: fused_logprob.token_logp, forward + backward, with bf16
weights (16-bit GEMM inputs, fp32 accumulation, dW into an fp32 .main_grad) against fp32 weights, at Qwen3-8B's head.

    z = x W^T / tau (T, V),  log p(y) = z[y] - lse(z);  four GEMMs of 2 T V H FLOPs each: z in forward, z again in
    backward (recomputed), dx = dz W and dW = dz^T x -- 8 T V H FLOPs for forward + backward.

Errors are max |. - fp64| of log p, dx and dW on the first --check_rows rows, against token_logp_dense in fp64 on
the same bf16 values, for three heads: the fused bf16 head (ours), the dense bf16 head (bf16 logits, plain autograd:
the bar, ours within twice its error) and the fused fp32 head. Times are the median of --repeats runs of forward +
backward over all T rows (CUDA: synchronised; peak memory from torch.cuda). The table names the GEMM path that ran:
"out_dtype" (torch >= 2.8 on CUDA) or "fp32 blocks" (modeling.layers' fallback: the CPU, older torch).

    python bench/lm_head_check.py                 # CUDA: T = 4096, V = 151936, H = 4096; ~15 GB, well under a minute
    python bench/lm_head_check.py --tiny          # any device: T = 64, V = 4096, H = 64; a second on a CPU
    python bench/lm_head_check.py --step_bytes=bf16   # CPU: one RL step's bytes at V = 151936 (~25 s)

Prints a table; writes bench/results/lm_head_check.json (--tiny: lm_head_check_tiny.json; --step_bytes:
lm_head_step_bytes_<dtype>.json), or --out. The FLOP rate needs a GPU: on a CPU the times say nothing about it.

Letters: T rows, V vocabulary, H hidden.
"""
from __future__ import annotations

import contextlib
import json
import os
import pathlib
import statistics
import sys
import time

import torch
import torch.nn.functional as F

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from backends.fused_logprob import budget_rows, token_logp, token_logp_dense  # noqa: E402
from modeling import layers  # noqa: E402
from modeling.mixed_precision import use_main_grads  # noqa: E402
from parallel.cli import parser, run_main  # noqa: E402
from rl_loop import token_logp as logp_from_logits  # noqa: E402

FULL, TINY = dict(T=4096, V=151936, H=4096), dict(T=64, V=4096, H=64)


def leaves(T: int, V: int, H: int, device="cpu", seed: int = 0) -> dict:
    """x (T, H), W (V, H) bf16 (the values every head reads, in its own dtype), y (T,) targets, g (T,) upstream
    weights of a backward. W's scale gives logits of a few units, as a trained head's."""
    gen = torch.Generator(device).manual_seed(seed)
    x = torch.randn(T, H, generator=gen, device=device).bfloat16()
    W = (torch.randn(V, H, generator=gen, device=device) * (3.0 / H ** 0.5)).bfloat16()
    return dict(x=x, W=W, y=torch.randint(V, (T,), generator=gen, device=device),
                g=torch.randn(T, generator=gen, device=device))


def run_head(kind: str, x, W, y, g, *, chunk: int, tau: float = 1.0):
    """One forward + backward of a head on leaves of x's / W's dtype -> (log p, dx, dW) as float64 on the CPU.
    kind: "fused" (token_logp; a 16-bit W gets an fp32 .main_grad, as under --dtype bf16), "fused_buffer" (token_logp,
    no .main_grad: the dW buffer), "dense" (logits in W's dtype, plain autograd) or "fp64" (token_logp_dense)."""
    x = x.detach().clone().requires_grad_()
    W = torch.nn.Parameter(W.detach().clone())
    if kind == "fused" and W.dtype in layers.HALF:
        use_main_grads([W])
    if kind.startswith("fused"):
        out = token_logp(x, W, y, chunk=chunk, temperature=tau)
    elif kind == "dense":
        out = logp_from_logits(F.linear(x, W), y, tau)
    else:
        out = token_logp_dense(x, W, y, temperature=tau)
    (out * g.to(out.dtype)).sum().backward()
    dW = W.main_grad if hasattr(W, "main_grad") else W.grad
    return tuple(t.detach().double().cpu() for t in (out, x.grad, dW))


def errors(T: int, V: int, H: int, device="cpu", *, chunk: int = 0, tau: float = 1.0, seed: int = 0) -> dict:
    """{head: {"logp", "dx", "dW": max |head - fp64|}} for the heads "bf16 fused", "bf16 fused (dW buffer)",
    "bf16 dense" and "fp32 fused", and "scale": max |fp64| of each. chunk: rows per chunk (0: the byte budget's)."""
    a = leaves(T, V, H, device, seed)
    chunk = chunk or budget_rows(V)
    ref = run_head("fp64", a["x"].double(), a["W"].double(), a["y"], a["g"], chunk=chunk, tau=tau)
    arms = {"bf16 fused": ("fused", torch.bfloat16), "bf16 fused (dW buffer)": ("fused_buffer", torch.bfloat16),
            "bf16 dense": ("dense", torch.bfloat16), "fp32 fused": ("fused", torch.float32)}
    out = {"scale": dict(zip(("logp", "dx", "dW"), (float(r.abs().max()) for r in ref)))}
    for name, (kind, dt) in arms.items():
        got = run_head(kind, a["x"].to(dt), a["W"].to(dt), a["y"], a["g"], chunk=chunk, tau=tau)
        out[name] = dict(zip(("logp", "dx", "dW"), (float((r - o).abs().max()) for r, o in zip(ref, got))))
    return out


def timing(T: int, V: int, H: int, device, dtype, repeats: int, seed: int = 0) -> dict:
    """Forward + backward of the fused head over T rows in `dtype` (bf16: W with an fp32 .main_grad): median seconds,
    TFLOP/s (8 T V H FLOPs), peak memory above the inputs (CUDA; 0 elsewhere)."""
    a = leaves(T, V, H, device, seed)
    x, W = a["x"].to(dtype).requires_grad_(), torch.nn.Parameter(a["W"].to(dtype))
    if dtype in layers.HALF:
        use_main_grads([W])
    cuda, times = torch.device(device).type == "cuda", []
    for i in range(repeats + 1):  # the first run warms up (kernels, the out_dtype probe)
        x.grad = W.grad = None
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
        t0 = time.perf_counter()
        (token_logp(x, W, a["y"], chunk=budget_rows(V)) * a["g"]).sum().backward()
        if cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    s = statistics.median(times[1:])
    return dict(seconds=s, tflops=8 * T * V * H / s / 1e12,
                peak_bytes=torch.cuda.max_memory_allocated() - base if cuda else 0)


def gemm_path(device) -> str:
    """Which GEMMs modeling.layers runs for 16-bit operands on `device`."""
    if torch.device(device).type != "cuda":
        return "fp32 blocks (no out_dtype off CUDA)"
    mm, addmm = layers.out_dtype_ops()
    return f"z: {'out_dtype' if mm else 'fp32 blocks'}, dW: {'out_dtype' if addmm else 'fp32 blocks'}"


@contextlib.contextmanager
def without_out_dtype():
    """modeling.layers as on a torch without out_dtype (< 2.8): the fp32-block fallback, with TF32 on CUDA."""
    probe = layers.out_dtype_ops
    layers.out_dtype_ops = lambda: (False, False)
    try:
        yield
    finally:
        layers.out_dtype_ops = probe


def check(*, tiny: bool = False, device=None, check_rows: int = 64, repeats: int = 3) -> dict:
    """The whole check: errors on check_rows rows, timings of bf16 and fp32 over all rows; on CUDA also bf16 as a
    torch without out_dtype runs it. The function a GPU script calls (bench/gpu_check.sh)."""
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    size, cuda = TINY if tiny else FULL, torch.device(device).type == "cuda"
    T, V, H = size["T"], size["V"], size["H"]
    res = dict(size, device=torch.cuda.get_device_name() if cuda else str(device), torch=torch.__version__,
               gemm=gemm_path(device))
    res["errors"] = errors(min(check_rows, T), V, H, device)
    res["time"] = {"bf16": timing(T, V, H, device, torch.bfloat16, repeats),
                   "fp32": timing(T, V, H, device, torch.float32, repeats)}
    if cuda:
        with without_out_dtype():
            res["errors"]["bf16 fused, fp32 blocks"] = errors(min(check_rows, T), V, H, device)["bf16 fused"]
            res["time"]["bf16, fp32 blocks"] = timing(T, V, H, device, torch.bfloat16, repeats)
    return res


def step_bytes(dtype: str = "bf16") -> dict:
    """One RL step in HF mode on a random Qwen3 at V = 151936 (hidden 32, tied head; --chunk_mib 4, one co-trained
    EAGLE-3 draft) on the CPU, under tests/test_memory_plan.py's storage tracker: bytes of the update's transient peak
    and of the pipeline schedule's forward + backward alone (the optimizer step left out), with their (V, H)-shaped
    ("head") and (rows, V)-shaped ("logits") parts; "vh_fp32" is one fp32 (V, H), 4 V H bytes."""
    import tempfile
    import pipeline
    sys.path.insert(0, os.path.join(ROOT, "tests"))
    import test_memory_plan as plan
    from harness import memory_track as mt
    from harness.config import parse_args
    from harness.experiment import build
    from harness.mesh import Mesh
    from hf_util import write_jsonl, write_tiny_qwen3
    from parallel.grid import Grid
    d = pathlib.Path(tempfile.mkdtemp())
    data = write_jsonl(d / "p.jsonl", [{"prompt": f"What is {a} + {b} ?", "answer": a + b}
                                                    for a in range(3) for b in range(3)])
    cfg = parse_args(["--preset=test", f"--cache_dir={d}/cache", f"--out={d}/out", "--warmup_threads=1", "--steps=1",
                      f"--model={write_tiny_qwen3(d / 'qwen3', 'What is + ? 0 1 2 3 4 5'.split())}",
                      f"--data={data}", "--eval_fraction=0.3", "--max_new_tokens=6", "--rollout_batch=4",
                      "--chunk_mib=4", "--draft_warmup_steps=1", "--draft_warmup_batch=2", "--draft_warmup_pool=4",
                      "--cold_arm=false", "--offline_arm=false", f"--dtype={dtype}"])
    mesh = Mesh(Grid(), torch.device("cpu"))
    s = build(cfg, mesh, log=lambda *a, **k: None)
    m, peaks, step = s.policy.cfg, [], pipeline.PipelineSchedule.step

    def tracked(sched, *a, **k):
        with mt.StorageTracker(plan.classifier(m)) as tr:
            out = step(sched, *a, **k)
        peaks.append((tr.peak(), tr.peak("head"), tr.peak("logits")))
        return out
    pipeline.PipelineSchedule.step = tracked
    try:
        got = plan.measure(s, mesh)[0]
    finally:
        pipeline.PipelineSchedule.step = step
    return dict(dtype=dtype, V=m.vocab_size, H=m.hidden_size, vh_fp32=4 * m.vocab_size * m.hidden_size,
                update_peak=got["update_peak"], update_head=got["head_buffers"], update_logits=got["logits_chunks"],
                **dict(zip(("schedule_peak", "schedule_head", "schedule_logits"), map(max, zip(*peaks)))))


def table(res: dict) -> str:
    e, t = res["errors"], res["time"]
    rows = [f"LM head T={res['T']} V={res['V']} H={res['H']} on {res['device']} (torch {res['torch']}; "
            f"GEMMs {res['gemm']})", f"  {'max |. - fp64|':24s} {'log p':>9s} {'dx':>9s} {'dW':>9s}"]
    rows += [f"  {k:24s} " + " ".join(f"{v[n]:9.2e}" for n in ("logp", "dx", "dW")) for k, v in e.items()]
    rows += [f"  {dt:18s} fwd+bwd {v['seconds'] * 1e3:9.2f} ms  {v['tflops']:7.2f} TFLOP/s  peak "
             f"{v['peak_bytes'] / 2**30:6.2f} GiB" for dt, v in t.items()]
    return "\n".join(rows)


def main(argv=None):
    ap = parser(__doc__, __file__)
    ap.add_argument("--tiny", action="store_true", help="T = 64, V = 4096, H = 64 on any device")
    ap.add_argument("--device", default=None, help="cuda when available, else cpu")
    ap.add_argument("--check_rows", type=int, default=64, help="rows compared against fp64")
    ap.add_argument("--repeats", type=int, default=3, help="timed runs of forward + backward per dtype")
    ap.add_argument("--out", default=None, help="JSON path (default bench/results/lm_head_check[_tiny].json)")
    ap.add_argument("--step_bytes", default=None, choices=["bf16", "fp32"],
                    help="instead: one RL step's bytes at V = 151936 on the CPU (step_bytes) in this dtype")
    a = ap.parse_args(argv)
    if a.step_bytes:
        res = step_bytes(a.step_bytes)
        print("  ".join(f"{k} {v}" for k, v in res.items()))
    else:
        res = check(tiny=a.tiny, device=a.device, check_rows=a.check_rows, repeats=a.repeats)
        print(table(res))
    name = f"lm_head_step_bytes_{a.step_bytes}" if a.step_bytes else f"lm_head_check{'_tiny' if a.tiny else ''}"
    out = a.out or os.path.join(ROOT, "bench", "results", f"{name}.json")
    with open(out, "w") as f:
        json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    run_main(main, __file__, sys.argv[1:])
