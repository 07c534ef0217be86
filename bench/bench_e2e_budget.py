"""The draft-training budget against plain GRPO: train.py runs at --draft_every 1, 2, 4, 8 (the drafts train on 1/n of
the policy's updates; the offline-extended control is trained as much) and a --no_spec run, on several RL seeds, then
per budget the acceptance at the end, each seed's co-trained - offline-extended interval and the e2e step measured
against the plain run of the same seed (harness/e2e.py, wall and CPU).

    python bench/bench_e2e_budget.py --seeds 0,1,2 --budgets 1,2,4,8 --parallel 2      # ~1 h on 2 cores, cached
    python bench/bench_e2e_budget.py --seeds 0 --budgets 1 -- --preset smoke           # any train.py flags after --

Runs go to runs/budget/<every>_s<seed> and runs/budget/plain_s<seed> (a finished run is kept and not rerun: delete
it to redo it). Each run is one process at --threads 1; --parallel N runs N at once (2 on 2 cores: they share the
machine alike). The warm-ups are trained once first (python -m harness.warmup), then read from the cache by every
run. Writes bench/results/e2e_budget.json and .md (--name: another name).

    python bench/bench_e2e_budget.py --budgets 2 --parallel 1 --runs runs/default_e2e --name e2e_default
                                    # the default budget, each run alone on the machine: wall times comparable too
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path.insert(0, ROOT)
from harness.report import add_baseline  # noqa: E402

RESULTS = os.path.join(ROOT, "bench", "results")


def run(out: str, flags: list) -> str:
    """train.py into `out` unless it already finished there; -> out."""
    if os.path.isfile(os.path.join(out, "summary.json")):
        return out
    log = out + ".log"
    os.makedirs(os.path.dirname(out), exist_ok=True)
    with open(log, "w") as f:
        r = subprocess.run([sys.executable, "train.py", f"--out={out}", "--overwrite", *flags], cwd=ROOT, stdout=f,
                           stderr=subprocess.STDOUT)
    if r.returncode:
        raise SystemExit(f"{out}: train.py failed (exit {r.returncode}); see {log}")
    return out


def mean_sd(xs: list) -> str:
    return f"{statistics.mean(xs):.3f} ± {statistics.stdev(xs):.3f}" if len(xs) > 1 else f"{xs[0]:.3f}"


def table(res: dict, seeds: list) -> str:
    lines = ["| budget (--draft_every) | acceptance, co-trained | acceptance, offline-ext. | co-trained − offline "
             "(95% CI per seed) | e2e vs plain, wall | e2e vs plain, CPU | e2e, computed |",
             "|---|---:|---:|---|---:|---:|---:|"]
    for every, runs in res["budgets"].items():
        col = lambda k: [r[k] for r in runs]  # noqa: E731
        ci = " ".join(f"[{a:+.2f}, {b:+.2f}]" for a, b in col("accept_gain_vs_offline_ci"))
        lines.append(f"| 1/{every} | {mean_sd(col('accept_len_cotrained'))} | {mean_sd(col('accept_len_offline'))} | "
                     f"{ci} | {mean_sd(col('e2e_step_speedup_measured'))} | "
                     f"{mean_sd(col('e2e_step_speedup_measured_cpu'))} | {mean_sd(col('e2e_step_speedup'))} |")
    return "\n".join(lines)


KEEP = ("accept_len_cotrained", "accept_len_offline", "accept_len_frozen", "accept_gain_vs_offline_ci",
        "accept_gain_vs_frozen_ci", "tau_hat_cotrained_last", "rollout_speedup", "e2e_step_speedup",
        "e2e_step_speedup_measured", "e2e_step_speedup_measured_ci", "e2e_step_speedup_measured_cpu",
        "e2e_step_speedup_measured_cpu_ci", "e2e_parts", "e2e_parts_cpu", "eval_reward_last", "kl_last", "wall_s")


def main(argv: list):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seeds", default="0,1,2")
    p.add_argument("--budgets", default="1,2,4,8")
    p.add_argument("--parallel", type=int, default=2)
    p.add_argument("--runs", default=os.path.join("runs", "budget"))
    p.add_argument("--name", default="e2e_budget", help="bench/results/<name>.json and .md")
    args, flags = p.parse_known_args(argv)
    flags = [f for f in flags if f != "--"] + ["--threads=1"]
    seeds, budgets = [int(s) for s in args.seeds.split(",")], [int(b) for b in args.budgets.split(",")]
    subprocess.run([sys.executable, "-m", "harness.warmup", *flags], cwd=ROOT, check=True, stdout=subprocess.DEVNULL)
    spec = [(os.path.join(args.runs, f"{b}_s{s}"), flags + [f"--rl_seed={s}", f"--draft_every={b}"])
            for b in budgets for s in seeds]
    plain = [(os.path.join(args.runs, f"plain_s{s}"), flags + [f"--rl_seed={s}", "--no_spec"]) for s in seeds]
    jobs = spec[:1] + plain + spec[1:]  # the first spec run trains the draft warm-up while the plain runs need none
    with ThreadPoolExecutor(args.parallel) as ex:
        list(ex.map(lambda j: run(*j), jobs))
    res = {"machine": f"{platform.machine()}, {os.cpu_count()} cores, {args.parallel} runs at once, 1 thread each",
           "flags": flags, "seeds": seeds, "budgets": {}}
    for b in budgets:
        res["budgets"][b] = []
        for s in seeds:
            run_dir = os.path.join(args.runs, f"{b}_s{s}")
            add_baseline(run_dir, os.path.join(args.runs, f"plain_s{s}"))
            summary = json.load(open(os.path.join(run_dir, "summary.json")))
            res["budgets"][b].append({"seed": s, **{k: summary.get(k) for k in KEEP}})
    md = table(res, seeds)
    print(md)
    out = os.path.join(RESULTS, args.name)
    os.makedirs(RESULTS, exist_ok=True)
    with open(out + ".json", "w") as f:
        json.dump(res, f, indent=1)
    with open(out + ".md", "w") as f:
        f.write(f"`python bench/bench_e2e_budget.py {' '.join(argv)}` ({res['machine']})\n\n{md}\n")


if __name__ == "__main__":
    from parallel.cli import answer_help, run_main  # an error: one line, exit 1 (COSPEC_TRACEBACK=1: traceback)
    answer_help(__doc__, __file__)  # -h / --help: usage and summary from the docstring, exit 0
    run_main(main, __file__, sys.argv[1:])
