"""How a busy neighbour slows the warm-ups' small steps, by intra-op threads and OpenMP's wait at a barrier.

The step timed is the draft warm-up's: the default policy (`mini`: 6 layers, hidden 64) forwards a batch of 64
sequences of 56 tokens with its taps, the EAGLE-3 draft's TTT loss on them, its backward and an AdamW step. Each
configuration runs in a fresh process (OpenMP reads its environment once, when torch loads it): 1 or 2 intra-op
threads; libgomp's wait (torch's OpenMP) as it comes (spin 300,000 times at a barrier, then sleep), PASSIVE (sleep at
once) or spin=N (GOMP_SPINCOUNT); on a quiet machine and beside one busy process (`while True: pass`) at nice 19
and at nice 0. Per configuration: the median seconds per step over `repeats` runs of `steps` steps each (after
`warm` untimed ones), and its ratio to the quiet time of the same configuration. Every configuration trains the same
weights to the same bits (checked: one digest per configuration, printed). What it decided: the draft warm-up runs
on 1 thread (harness/experiment.build_models).

    python bench/bench_omp_wait.py       # ~4 min on 2 cores, nothing else running: bench/results/omp_wait.{json,md}

Flags: --steps (timed steps per run), --warm, --repeats.
"""
from __future__ import annotations

import hashlib
import json
import os
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIGS = [(1, "default"), (2, "default"), (2, "PASSIVE"), (2, "spin=1000"), (2, "spin=10000")]  # OpenMP's waits
LOADS = {"quiet": None, "busy neighbour, nice 19": 19, "busy neighbour, nice 0": 0}


def one_run(threads: int, steps: int, warm: int) -> dict:
    """In this process (OMP_WAIT_POLICY already set by the parent): seconds per step and a digest of the weights."""
    import torch

    from draft import Eagle3Draft
    from model import ModelConfig, Transformer
    from rl_loop import DraftTrainer, RolloutBatch, draft_loss, pack
    torch.set_num_threads(threads)
    torch.manual_seed(0)
    policy = Transformer(ModelConfig.preset("mini")).requires_grad_(False)
    draft = Eagle3Draft.from_target(policy)
    tr = DraftTrainer(draft, torch.optim.AdamW(draft.parameters(), lr=1e-3))
    g = torch.Generator().manual_seed(1)
    tokens, cu = pack([torch.randint(policy.cfg.vocab_size, (56,), generator=g) for _ in range(64)])
    resp = torch.ones_like(tokens, dtype=torch.bool)
    mb = RolloutBatch(tokens, cu, resp, torch.zeros(tokens.shape), torch.zeros(64), torch.ones(64, dtype=torch.bool))
    with torch.no_grad():
        out = policy(tokens, cu, tap_layers=draft.tap_layers)
    times = []
    for i in range(warm + steps):
        t0 = time.perf_counter()
        loss, _ = draft_loss(tr, out.taps, out.logits, mb)
        tr.opt.zero_grad(set_to_none=True)
        loss.backward()
        tr.opt.step()
        if i >= warm:
            times.append(time.perf_counter() - t0)
    digest = hashlib.sha1(b"".join(p.detach().numpy().tobytes() for p in draft.parameters())).hexdigest()[:12]
    return {"seconds_per_step": statistics.mean(times), "digest": digest}


def measure(threads: int, policy: str, steps: int, warm: int) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    env["OMP_NUM_THREADS"] = str(threads)
    if policy.startswith("spin="):  # libgomp (torch's OpenMP): spin this many times at a barrier, then sleep
        env["GOMP_SPINCOUNT"] = policy[5:]
    elif policy != "default":  # default: libgomp spins 300,000 times, then sleeps
        env["OMP_WAIT_POLICY"] = policy
    code = (f"import json, sys; sys.path.insert(0, {ROOT!r}); sys.path.insert(0, {os.path.dirname(__file__)!r}); "
            f"from bench_omp_wait import one_run; print(json.dumps(one_run({threads}, {steps}, {warm})))")
    out = subprocess.run([sys.executable, "-c", code], env=env, cwd=ROOT, capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv=None):
    from parallel.cli import parser
    ap = parser(__doc__, __file__)
    ap.add_argument("--steps", type=int, default=20, help="timed steps per run (default: %(default)s)")
    ap.add_argument("--warm", type=int, default=3, help="untimed steps first (default: %(default)s)")
    ap.add_argument("--repeats", type=int, default=3, help="runs per configuration (default: %(default)s)")
    args = ap.parse_args(argv)
    rows = []
    for load, nice in LOADS.items():
        hog = None
        if nice is not None:
            hog = subprocess.Popen(["nice", "-n", str(nice), sys.executable, "-c", "while True: pass"])
            time.sleep(1.0)
        try:
            for threads, policy in CONFIGS:
                runs = [measure(threads, policy, args.steps, args.warm) for _ in range(args.repeats)]
                rows.append({"load": load, "threads": threads, "wait_policy": policy,
                             "seconds_per_step": statistics.median(r["seconds_per_step"] for r in runs),
                             "spread": [min(r["seconds_per_step"] for r in runs),
                                        max(r["seconds_per_step"] for r in runs)],
                             "digest": runs[0]["digest"], "same_bits_every_run": len({r["digest"] for r in runs}) == 1})
        finally:
            if hog is not None:
                hog.kill()
    quiet = {(r["threads"], r["wait_policy"]): r["seconds_per_step"] for r in rows if r["load"] == "quiet"}
    for r in rows:
        r["vs_quiet"] = r["seconds_per_step"] / quiet[(r["threads"], r["wait_policy"])]
    lines = ["| load | threads | wait policy | s / step (median; min-max) | vs quiet | weights digest |",
             "|---|---|---|---|---|---|"]
    lines += [f"| {r['load']} | {r['threads']} | {r['wait_policy']} | {r['seconds_per_step']:.4f} "
              f"({r['spread'][0]:.4f}-{r['spread'][1]:.4f}) | {r['vs_quiet']:.2f}x | {r['digest']} |" for r in rows]
    print("\n".join(lines))
    os.makedirs(os.path.join(ROOT, "bench", "results"), exist_ok=True)
    meta = {"steps": args.steps, "warm": args.warm, "repeats": args.repeats, "cpus": os.cpu_count(),
            "date": time.strftime("%Y-%m-%d")}
    with open(os.path.join(ROOT, "bench", "results", "omp_wait.json"), "w") as f:
        json.dump({"meta": meta, "rows": rows}, f, indent=1)
    with open(os.path.join(ROOT, "bench", "results", "omp_wait.md"), "w") as f:
        f.write(f"`python bench/bench_omp_wait.py` ({meta})\n\n" + "\n".join(lines) + "\n")


if __name__ == "__main__":
    sys.path.insert(0, ROOT)
    from parallel.cli import run_main  # an error: one line, exit 1 (COSPEC_TRACEBACK=1: the traceback)
    run_main(main, __file__, sys.argv[1:])
