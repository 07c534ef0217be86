"""What a run shows and leaves behind: the live table, metrics.jsonl, summary.json, config.json and train.png. Rank 0
reports; every other rank's Report is silent (world size 1 is a plain program: its one process is rank 0).

    rep = Report(cfg, out_dir, main=mesh.main)
    rep.train(row) / rep.eval(ev)       one line on the console and one JSON record per step / evaluation
    summary = rep.finish(warm_info, wall_s)     summary.json + train.png, returns the summary

    python -m harness.report runs/default runs/seed1 runs/seed2      # the seeds table (mean +- sd over runs), markdown
    python -m harness.report runs/default --baseline runs/plain      # the e2e step measured against plain GRPO
                                                                     # (train.py --no_spec; harness/e2e.py)

Records: {"kind": "train", "step", reward..., "rank_rows", "time": {"rollout", "rollout_rank_s", "rollout_rank_cpu_s",
"policy_train", "draft_train", "watch", "eval", "cpu": {"rollout", "policy_train", "draft_train", "watch"}}}
(rank_rows / rollout_rank_*: per rank, the rows it generated and its wall / CPU seconds for them; the live table shows
the slowest and fastest rank's wall seconds, r_max / r_min; "cpu": CPU seconds per phase, summed over the ranks) and
{"kind": "eval", "step", "kl", reward..., accept_<arm>, tok_s_<arm>, speedup_<arm>}.
"""
from __future__ import annotations

import dataclasses
import json
import os
from typing import TYPE_CHECKING

import torch

from harness.e2e import step_parts
from harness.logger import MetricsLogger, parse_backends
from harness.plots import plot_run

if TYPE_CHECKING:
    from harness.config import Config

HEADER = (f"{'step':>4} {'reward':>6} {'acc':>5} {'expl':>5} {'len':>5} {'KL':>6} {'zero':>4} {'clip':>5} "
          f"{'accept':>6} {'tau^c':>5} {'tau^f':>5} {'tau^o':>5} {'tok/s':>6} {'t_roll':>6} {'r_max':>5} {'r_min':>5} "
          f"{'t_pol':>5} {'t_dft':>5} {'lp_err':>6}")  # r_max / r_min: the slowest / fastest rank's rollout seconds;
# lp_err: token_mult_prob_error, mean exp|log pi_gen - log pi_old| over the trained tokens (1: rollout and update agree)


class Report:
    def __init__(self, cfg: Config, out_dir: str, *, main: bool):
        self.cfg, self.out_dir, self.main = cfg, out_dir, main
        self.rows, self.evals = [], []
        if main:
            os.makedirs(out_dir, exist_ok=True)
        self.metrics_path = os.path.join(out_dir, "metrics.jsonl")  # + TensorBoard / wandb with --log (logger.py)
        self.logger = MetricsLogger(out_dir, parse_backends(cfg.log), enabled=main, config=dataclasses.asdict(cfg))

    def print(self, *a, **k):
        if self.main:
            print(*a, **k, flush=True)

    def _write(self, record: dict):
        self.logger.log(record)

    def restore(self, records: list):
        """A resumed run's records so far (from its checkpoint): nothing lost, nothing repeated."""
        for r in records:
            (self.rows if r["kind"] == "train" else self.evals).append(r)
            self._write(r)

    def records(self) -> list:  # in step order, a step's eval after its train row
        return sorted(self.rows + self.evals, key=lambda r: (r["step"], r["kind"] == "eval"))

    def train(self, row: dict):
        self.rows.append(row)
        self._write(row)
        t = row["time"]
        ranks = t.get("rollout_rank_s") or [t["rollout"]]  # each rank's generate + score + reference seconds
        # none: an arm the run does not hold or did not train this step, a KL without a reference
        tau = " ".join(_num(row.get(f"tau_hat_{a}"), 5) for a in ("cotrained", "frozen", "offline"))
        self.print(f"{row['step']:4d} {row['reward']:6.3f} {row['correct']:5.2f} {row['explicit']:5.2f} "
                   f"{row['resp_len']:5.1f} {_num(row['kl'], 6, 3)} {row['zero_var_groups']:4d} "
                   f"{row['clip_frac']:5.3f} "
                   f"{_num(row['accept_len'], 6)} {tau} {row['rollout_tok_s']:6.0f} "
                   f"{t['rollout']:6.2f} {max(ranks):5.2f} {min(ranks):5.2f} {t['policy_train']:5.2f} "
                   f"{t['draft_train']:5.2f} {_num(row.get('token_mult_prob_error'), 6, 4)}")

    def eval(self, ev: dict | None):  # None: nothing to report (not rank 0, or no evaluation this step)
        if ev is None:
            return
        self.evals.append(ev)
        self._write(ev)
        head = (f"  eval @ {ev['step']}: held-out reward {ev['reward']:.3f} (acc {ev['correct']:.2f}, explicit "
                f"{ev['explicit']:.2f})")
        if "accept_cotrained" not in ev:  # --no_spec: autoregressive only
            self.print(f"{head} | AR {ev['tok_s_ar']:.0f} tok/s")
            return
        more = "".join(f" {a} {_num(ev[f'accept_{a}'])}" for a in ("frozen", "offline", "cold") if f"accept_{a}" in ev)
        ci = "".join(f" | c-{a[:3]} [{ev[k][0]:+.2f}, {ev[k][1]:+.2f}]" for a in ("frozen", "offline")
                     if (k := f"accept_gain_vs_{a}_ci") in ev and ev[k] is not None)
        frozen = f" (frozen {ev['speedup_frozen']:.2f}x)" if "speedup_frozen" in ev else ""
        spread = " [{:.2f}-{:.2f}]".format(*ev["speedup_range"]) if "speedup_range" in ev else ""
        self.print(f"{head} | acceptance (k={ev.get('eval_k', '?')}) co-trained {_num(ev['accept_cotrained'])}{more}"
                   f"{ci} | rollout speedup {ev['speedup']:.2f}x{spread}{frozen}")  # the paired chunks' median

    def finish(self, warm: dict, wall_s: float, eval_prompts: int | None = None) -> dict:
        """summary.json and train.png (rank 0); returns the summary ({} on other ranks). eval_prompts: how many
        held-out prompts the evals had (fewer than --eval_prompts when the task holds fewer: the summary says so)."""
        self.logger.close()
        if not self.main:
            return {}
        c = self.cfg
        summary = summarize(c, self.rows, self.evals, warm, wall_s)
        if eval_prompts is not None:
            summary["eval_prompts"] = eval_prompts
            if eval_prompts < c.eval_prompts:
                summary["eval_prompts_note"] = (f"--eval_prompts={c.eval_prompts} asked for more held-out prompts "
                                                f"than the task holds: evaluated {eval_prompts}")
        with open(os.path.join(self.out_dir, "summary.json"), "w") as f:
            json.dump(summary, f, indent=2)
        with open(os.path.join(self.out_dir, "config.json"), "w") as f:  # what harness/cost_check.py reads
            json.dump(dataclasses.asdict(c), f, indent=1)
        plot_run(self.rows, self.evals, os.path.join(self.out_dir, "train.png"),
                 title=f"{c.name}: {c.steps} GRPO steps, {c.prompts_per_step}x{c.group_size} rollouts/step")
        self.print(json.dumps(summary, indent=2))
        self.print(f"wrote {self.metrics_path}, summary.json, train.png")
        return summary


def _num(v, width: int = 0, digits: int = 2) -> str:
    """A metric for the console: two decimals, or "none" (an acceptance without any verification forward, an arm the
    run does not hold or did not train this step, a KL without a reference)."""
    return f"{'none' if v is None else f'{v:.{digits}f}':>{width}}"


def summarize(cfg: Config, rows: list, evals: list, warm: dict, wall_s: float) -> dict:
    n = max(1, len(rows) // 10)  # first / last 10% of steps (rollout rewards are noisy step to step)
    first, last = evals[0], evals[-1]
    tsum = {k: sum(r["time"].get(k, 0.0) for r in rows)
            for k in ("rollout", "policy_train", "draft_train", "eval", "watch", "offline_sample", "offline_train")}
    out = {"steps": len(rows),
           "reward_first": sum(r["reward"] for r in rows[:n]) / n,
           "reward_last": sum(r["reward"] for r in rows[-n:]) / n,
           "eval_reward_first": first["reward"], "eval_reward_last": last["reward"],
           "correct_first": first["correct"], "correct_last": last["correct"],
           "explicit_first": first["explicit"], "explicit_last": last["explicit"],
           "kl_last": rows[-1]["kl"], "ar_tok_s": last["tok_s_ar"],
           "time_s": {**{k: round(v, 1) for k, v in tsum.items()}, "sft_warmup": round(warm["sft_s"], 1),
                      "draft_warmup": round(warm["draft_warmup_s"], 1)},
           "warmup_cached": {"policy": warm["policy_cached"], "draft": warm["draft_cached"]},
           "cold_start": cfg.cold_start, "no_spec": cfg.no_spec, "draft_every": cfg.draft_every,
           "wall_s": round(wall_s, 1)}
    out["time_s"]["cpu"] = {k: round(sum(r["time"].get("cpu", {}).get(k, 0.0) for r in rows), 1)
                            for k in ("rollout", "policy_train", "draft_train")}
    if "speedup" in last:  # a draft drove the rollouts (not --no_spec)
        out.update(rollout_speedup=last["speedup"], spec_tok_s=last["tok_s_cotrained"])
    for arm in ("cotrained", "frozen", "cold", "offline"):
        if f"accept_{arm}" in last:
            out[f"accept_len_{arm}_first"], out[f"accept_len_{arm}"] = first[f"accept_{arm}"], last[f"accept_{arm}"]
    for arm in ("frozen", "offline"):
        if f"accept_gain_vs_{arm}_ci" in last:
            out[f"accept_gain_vs_{arm}_ci"] = last[f"accept_gain_vs_{arm}_ci"]
    if "speedup_frozen" in last:
        out["rollout_speedup_frozen"] = last["speedup_frozen"]
        out["speedup_agreement_eval0"] = first["speedup_frozen"] / first["speedup_cotrained"]  # same draft at eval 0
    for arm in ("cotrained", "frozen", "offline", "cold"):  # teacher-forced, on the last 10% of the steps that
        vals = [r[f"tau_hat_{arm}"] for r in rows if r.get(f"tau_hat_{arm}") is not None]  # trained the drafts
        if vals:
            tail = vals[-max(1, len(vals) // 10):]
            out[f"tau_hat_{arm}_last"] = sum(tail) / len(tail)
    if "speedup" in last:
        out.update(e2e_step_times(rows, evals))
    out["temperature"], out["eval_k"], out["rl_seed"], out["lr"] = cfg.temperature, cfg.eval_k, cfg.run_seed, cfg.lr
    return out


def e2e_step_times(rows: list, evals: list) -> dict:
    """End-to-end RL step time, speculative vs autoregressive rollouts (rollout + update + co-training), per step:

        spec = t_rollout + t_policy_train + t_draft_train / trained_drafts    (measured: the run itself, e2e.step_parts)
        ar   = t_rollout * speedup + t_policy_train                           (the same step with AR rollouts, no draft)

    speedup = the co-trained draft's measured paired rollout speedup at the latest eval before that step. The
    controls' costs (the cold arm's share of t_draft_train: the drafts trained on the same taps are the same size, so
    the co-trained one's share is 1 / trained_drafts; timers "watch", "offline_*") and the eval are not part of
    either. e2e_step_speedup = sum ar / sum spec over the run. (harness/e2e.py measures ar with a --no_spec run.)"""
    parts = step_parts(rows)  # (steps,) per component
    sp = torch.tensor([max((e for e in evals if e["step"] < r["step"]), key=lambda e: e["step"],
                           default=evals[0])["speedup"] for r in rows], dtype=torch.float64)
    spec, ar = sum(parts.values()), parts["rollout"] * sp + parts["policy_train"]
    n = max(len(rows), 1)
    return {"e2e_step_s_spec": float(spec.sum()) / n, "e2e_step_s_ar": float(ar.sum()) / n,
            "e2e_step_speedup": float(ar.sum()) / max(float(spec.sum()), 1e-9)}


SEED_KEYS = (("accept_len_cotrained", "acceptance, co-trained"), ("accept_len_offline", "acceptance, offline-extended"),
             ("accept_len_frozen", "acceptance, frozen"), ("accept_len_cold", "acceptance, cold start"),
             ("tau_hat_cotrained_last", "tau_hat (teacher-forced), co-trained"),
             ("tau_hat_offline_last", "tau_hat (teacher-forced), offline-extended"),
             ("tau_hat_frozen_last", "tau_hat (teacher-forced), frozen"),
             ("eval_reward_last", "held-out reward"), ("correct_last", "held-out accuracy"),
             ("kl_last", "KL at the end"),
             ("rollout_speedup", "rollout speedup, co-trained"), ("e2e_step_speedup", "e2e step speedup (computed)"),
             ("e2e_step_speedup_measured", "e2e step speedup vs plain GRPO (measured, wall)"),
             ("e2e_step_speedup_measured_cpu", "e2e step speedup vs plain GRPO (measured, CPU)"))


def seeds_table(summaries: dict) -> str:
    """{run name: summary} -> a markdown table: one column per run, then mean +- sd (sample sd over runs), plus the
    co-trained - offline / - frozen intervals of each run."""
    import statistics
    names = list(summaries)
    lines = ["| | " + " | ".join(names) + " | mean ± sd |", "|---|" + "---:|" * (len(names) + 1)]
    for key, label in SEED_KEYS:
        vals = [summaries[n].get(key) for n in names]
        if any(v is None for v in vals):
            continue
        sd = statistics.stdev(vals) if len(vals) > 1 else 0.0
        cells = " | ".join(f"{v:.2f}" for v in vals)
        lines.append(f"| {label} | {cells} | {statistics.mean(vals):.2f} ± {sd:.2f} |")
    for arm in ("offline", "frozen"):
        key = f"accept_gain_vs_{arm}_ci"
        if all(key in summaries[n] for n in names):
            lines.append(f"| co-trained − {arm}, 95% CI | " + " | ".join(
                f"[{summaries[n][key][0]:+.2f}, {summaries[n][key][1]:+.2f}]" for n in names) + " | |")
    return "\n".join(lines)


def add_baseline(run: str, base: str) -> dict:
    """The measured e2e step of `run` against the plain-GRPO run `base` (harness/e2e.py), added to run's
    summary.json (written atomically) -> the measurement."""
    from harness.e2e import measured_e2e, read_rows
    m = {"baseline": base, **measured_e2e(read_rows(run), read_rows(base))}
    path = os.path.join(run, "summary.json")
    with open(path) as f:
        summary = json.load(f)
    summary.update(m)
    with open(path + ".tmp", "w") as f:
        json.dump(summary, f, indent=2)
    os.replace(path + ".tmp", path)
    return m


def main(argv: list):
    """RUN ... : the seeds table; RUN --baseline BASE: the measured e2e step."""
    if "--baseline" in argv:
        i = argv.index("--baseline")
        if len(argv) != 3 or i != 1:
            raise SystemExit("usage: python -m harness.report RUN --baseline BASE_RUN")
        from harness.e2e import table
        m = add_baseline(argv[0], argv[2])
        print(table(m))
        print(f"wrote the e2e_step_* fields into {os.path.join(argv[0], 'summary.json')}")
        return
    runs = argv or ["runs/default"]
    print(seeds_table({os.path.basename(r.rstrip("/")): json.load(open(os.path.join(r, "summary.json")))
                       for r in runs}))


if __name__ == "__main__":
    import sys

    from parallel.cli import answer_help, run_main
    answer_help(__doc__, __file__)  # -h / --help: usage and summary from the docstring, exit 0
    run_main(main, __file__, sys.argv[1:])  # an error: one line naming the file, exit 1
