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

The draft families side by side (--drafters): the same experiment per family (train.py --drafter=NAME: its own
warm-up, co-trained, frozen and offline-extended drafts), the same seeds and the same plain runs; per family and
budget the acceptance of the three arms at the run's eval k (the same k for every family: a block drafter needs
k <= block_size - 1), the paired-bootstrap CIs of co-trained - frozen and co-trained - offline per seed, the rollout
speedup inside the loop, the e2e step against plain GRPO (wall and CPU) and the draft's training seconds per step.
Runs go to runs/budget/<drafter>_<every>_s<seed>; writes bench/results/families.{json,md} (--name: another). A
train.py flag only some of the families read (--block_size) goes to their runs alone (family_flags).

    python bench/bench_e2e_budget.py --drafters eagle3,dflash,dspark --seeds 0,1,2 --budgets 2 --parallel 1 \
        --runs runs/fam_l1 -- --draft_layers=1 --block_size=8 --anchors=8   # the one-layer table (each run alone)
    python bench/bench_e2e_budget.py --drafters eagle3,dflash,dspark --seeds 0 --budgets 1 --runs runs/fam_test \
        --name families_test -- --preset test   # ~10 min on 2 shared cores: every column filled for every family
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
from harness.drafters import FAMILIES as DRAFTERS, family_list  # noqa: E402
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
        "e2e_step_speedup_measured_cpu_ci", "e2e_parts", "e2e_parts_cpu", "eval_reward_last", "kl_last", "wall_s",
        "eval_k", "steps")
FAMILY_COLUMNS = ("accept_len_cotrained", "accept_len_frozen", "accept_len_offline", "accept_gain_vs_frozen_ci",
                  "accept_gain_vs_offline_ci", "rollout_speedup", "e2e_step_speedup_measured",
                  "e2e_step_speedup_measured_cpu", "draft_train_s_per_step", "eval_k")


def record(run_dir: str, plain_dir: str, seed: int) -> dict:
    """The run's summary fields KEEP, its measured e2e step against the plain run of its seed added first, and the
    co-trained draft's training seconds per step (e2e_parts: the draft_train share of one step, wall)."""
    add_baseline(run_dir, plain_dir)
    with open(os.path.join(run_dir, "summary.json")) as f:
        summary = json.load(f)
    out = {"seed": seed, **{k: summary.get(k) for k in KEEP}}
    out["draft_train_s_per_step"] = ((summary.get("e2e_parts") or {}).get("spec") or {}).get("draft_train")
    return out


def family_table(res: dict) -> str:
    """One row per (family, budget): the arms' acceptance, the per-seed CIs, the rollout and e2e speedups, the draft's
    training seconds per step (mean ± sd over seeds; "-" where a run lacks the field)."""
    lines = ["| family | budget | k | acceptance co-trained | frozen | offline-ext. | co-trained − frozen (95% CI "
             "per seed) | co-trained − offline (95% CI per seed) | rollout speedup | e2e vs plain, wall | e2e vs "
             "plain, CPU | draft train s / step |", "|---|---|---:|" + "---:|" * 3 + "---|---|" + "---:|" * 4]
    for drafter, budgets in res["families"].items():
        for every, runs in budgets.items():
            def col(k):
                vals = [r[k] for r in runs if r.get(k) is not None]
                return mean_sd(vals) if len(vals) == len(runs) and vals else "-"

            def cis(k):
                vals = [r.get(k) for r in runs]
                return " ".join(f"[{a:+.2f}, {b:+.2f}]" for a, b in vals) if all(vals) else "-"
            k = ",".join(sorted({str(r.get("eval_k")) for r in runs}))  # the same k for every family: one value
            lines.append(f"| {drafter} | 1/{every} | {k} | {col('accept_len_cotrained')} | "
                         f"{col('accept_len_frozen')} | {col('accept_len_offline')} | "
                         f"{cis('accept_gain_vs_frozen_ci')} | {cis('accept_gain_vs_offline_ci')} | "
                         f"{col('rollout_speedup')} | {col('e2e_step_speedup_measured')} | "
                         f"{col('e2e_step_speedup_measured_cpu')} | {col('draft_train_s_per_step')} |")
    return "\n".join(lines)


def missing(res: dict) -> list:
    """["family 1/every seed s: field", ...] for every family-table field a run left empty."""
    return [f"{d} 1/{b} seed {r['seed']}: {k}" for d, budgets in res["families"].items() for b, runs in budgets.items()
            for r in runs for k in FAMILY_COLUMNS if r.get(k) is None]


def parse(argv: list):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seeds", default="0,1,2")
    p.add_argument("--budgets", default="1,2,4,8")
    p.add_argument("--parallel", type=int, default=2)
    p.add_argument("--runs", default=os.path.join("runs", "budget"))
    p.add_argument("--drafters", default="", help="comma-separated draft families (eagle3,dflash,dspark): the "
                   "experiment per family -> bench/results/families.{json,md}; empty: EAGLE-3 alone, the budget table")
    p.add_argument("--name", default=None, help="bench/results/<name>.json and .md (default: e2e_budget, or "
                   "families with --drafters)")
    args, flags = p.parse_known_args(argv)
    try:
        args.drafters and family_list(args.drafters)
    except ValueError as e:
        p.error(str(e))
    if any(f.startswith("--drafter=") for f in flags):
        p.error("--drafter=...: give the families with --drafters, not as a train.py flag")
    args.drafters = [d for d in args.drafters.split(",") if d] or None
    args.name = args.name or ("families" if args.drafters else "e2e_budget")
    return args, [f for f in flags if f != "--"] + ["--threads=1"]


def family_flags(flags: list, drafter: str, drafters: list) -> list:
    """The train.py `flags` less those `drafter` does not read while one of `drafters` does: a block flag given for
    the side by side (--block_size=8) stays out of EAGLE-3's and the plain runs' commands, which would refuse it
    (config_checks.check_family_flags). --key=value and --key value alike; a flag no listed family reads stays."""
    drop = set().union(*(DRAFTERS[d].flags for d in drafters)) - DRAFTERS[drafter].flags
    out, i = [], 0
    while i < len(flags):
        key, eq, _ = flags[i].partition("=")
        n = 1 if eq or i + 1 == len(flags) or flags[i + 1].startswith("--") else 2
        if key[2:] not in drop:
            out += flags[i:i + n]
        i += n
    return out


def run_name(drafter, every: int, seed: int) -> str:  # EAGLE-3's budget runs keep their names without --drafters
    return f"{every}_s{seed}" if drafter is None else f"{drafter}_{every}_s{seed}"


def main(argv: list):
    args, flags = parse(argv)
    seeds, budgets = [int(s) for s in args.seeds.split(",")], [int(b) for b in args.budgets.split(",")]
    drafters = args.drafters or [None]
    own = lambda d: (family_flags(flags, d or "eagle3", args.drafters or [])  # noqa: E731
                     + ([f"--drafter={d}"] if d else []))
    for d in drafters:  # each family's warm-up trained once, then read from the cache by its runs
        subprocess.run([sys.executable, "-m", "harness.warmup", *own(d)], cwd=ROOT, check=True,
                       stdout=subprocess.DEVNULL)
    spec = [(os.path.join(args.runs, run_name(d, b, s)), own(d) + [f"--rl_seed={s}", f"--draft_every={b}"])
            for d in drafters for b in budgets for s in seeds]
    plain = [(os.path.join(args.runs, f"plain_s{s}"),
              family_flags(flags, "eagle3", args.drafters or []) + [f"--rl_seed={s}", "--no_spec"]) for s in seeds]
    jobs = spec[:1] + plain + spec[1:]  # the first spec run trains the draft warm-up while the plain runs need none
    with ThreadPoolExecutor(args.parallel) as ex:
        list(ex.map(lambda j: run(*j), jobs))
    res = {"machine": f"{platform.machine()}, {os.cpu_count()} cores, {args.parallel} runs at once, 1 thread each",
           "flags": flags, "seeds": seeds, "budgets": {}, "families": {}}
    for d in drafters:
        per = {b: [record(os.path.join(args.runs, run_name(d, b, s)), os.path.join(args.runs, f"plain_s{s}"), s)
                   for s in seeds] for b in budgets}
        res["families"][d or "eagle3"] = per
        if d in (None, "eagle3"):
            res["budgets"] = per
    if args.drafters:
        res["missing"] = missing(res)
        md = family_table(res) + ("\n\nmissing: " + "; ".join(res["missing"]) if res["missing"] else "")
    else:
        del res["families"]
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
