"""The cost model (harness/cost_model.py) against a measured run: per component, the mean over the run's RL steps of
the measured seconds (metrics.jsonl's "time") and of the prediction from that step's own rows, response length and
acceptance, the run's config and the device figures -- never fitted to the run.

    python -m harness.cost_check docs/examples/cost_check_run     # the stored run (metrics.jsonl, config.json), "cpu"
    python -m harness.cost_check runs/nospec --device cpu --tol 0.15 -- --preset default --no_spec

RUN is a run directory (its metrics.jsonl, and config.json if the run wrote one) or a metrics.jsonl. The config is the
first record's "config" if it has one, else RUN/config.json, else harness.config's defaults; anything after `--` is
train.py's command line (--preset, --key=value) for a run whose config is not stored.

Components, as the run times them: rollout = generate + the reference log-probs (harness/rollout.py), policy_train =
the update without the drafts (harness/update.py), draft_train = every trained draft's TTT (co-trained, and the cold
arm with --cold_arm). `watch`, `offline_*` and `eval` are the controls' and are not predicted. Exit status 1 when a
component misses by more than --tol (relative).

Workload read from the run: rows = sum of rank_rows, W = len(rank_rows), resp_len and accept_len per step (no
accept_len: autoregressive rollouts); from the task: the mean prompt length and tail = E[longest response of a
generate call] / E[response], estimated from the task's demonstrations (built-in task: each step explicit with the
step's measured explicit share; other tasks: --tail).
"""
from __future__ import annotations

import json
import math
import os
import random
import sys
from dataclasses import fields, replace

from parallel.cli import parser, run_main
from harness.cost_inputs import Arch, Device
from harness.cost_model import Workload, predict

COMPONENTS = ("rollout", "policy_train", "draft_train")


def load_run(path: str) -> tuple[list, dict | None]:
    """(the RL steps' records, the stored config or None) of a run directory or a metrics.jsonl."""
    f = os.path.join(path, "metrics.jsonl") if os.path.isdir(path) else path
    if not os.path.isfile(f):
        raise ValueError(f"RUN={path!r}: expected a run directory with metrics.jsonl, or a metrics.jsonl file")
    recs = read_jsonl(f)
    cfg = next((r["config"] for r in recs if isinstance(r.get("config"), dict)), None)
    side = os.path.join(os.path.dirname(f), "config.json")
    if cfg is None and os.path.isfile(side):
        from serving.hf_io import read_json
        cfg = read_json(side)
    steps = [r for r in recs if r.get("kind") == "train" and isinstance(r.get("time"), dict)]
    if not steps:
        raise ValueError(f"{f}: no RL step records (kind 'train' with a 'time')")
    return steps, cfg


def read_jsonl(path: str) -> list:
    """One JSON object per non-empty line; an error names the file and the line."""
    recs = []
    with open(path, encoding="utf-8", errors="replace") as fh:
        for n, line in enumerate(fh, 1):
            if not line.strip():
                continue
            try:
                recs.append(json.loads(line))
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{n}: invalid JSON ({e.msg} at column {e.colno}): expected one metrics "
                                 "record per line (train.py's metrics.jsonl)") from None
            if not isinstance(recs[-1], dict):
                raise ValueError(f"{path}:{n}: expected a JSON object (a metrics record), got "
                                 f"{type(recs[-1]).__name__}")
    return recs


def run_config(stored: dict | None, argv: list):
    """harness.config.Config: the stored fields (unknown ones dropped), then `argv` as train.py's flags."""
    from harness.config import Config, parse_args
    cfg = parse_args(argv)
    if stored:  # fields this checkout's Config lacks, or holds with another type (a newer run's), are left out
        types = {f.name: f.type for f in fields(Config)}
        ok = {"bool": bool, "int": int, "float": (int, float), "str": str, "tuple": list}
        kw = {k: tuple(v) if isinstance(v, list) else v for k, v in stored.items()
              if k in types and (types[k] not in ok or (isinstance(v, ok[types[k]])
                                                         and (types[k] == "bool") == isinstance(v, bool)))}
        cfg = replace(cfg, **kw)
    return cfg


def task_shape(cfg, explicit: float, blocks: int = 200, seed: int = 0) -> tuple[float, float]:
    """(mean prompt tokens, tail) of the built-in task's demonstrations: blocks of rollout_batch rows, group_size
    samples per prompt, each step explicit with probability `explicit`."""
    from tasks.protocol import factory
    task = factory(cfg.task)(replace(cfg, p_explicit=min(max(explicit, 0.0), 1.0)))
    if not hasattr(task, "encode_demo"):
        raise ValueError(f"--task={cfg.task}: no demonstrations to estimate the tail from; pass --tail")
    rng, G, B = random.Random(seed), cfg.group_size, cfg.rollout_batch
    prompts, ratios = [], []
    for _ in range(blocks):
        probs = [p for p in task.sample(max(1, B // G), rng) for _ in range(G)][:B]
        lens = []
        for p in probs:
            toks, n_prompt = task.encode_demo(p, rng)
            prompts.append(n_prompt)
            lens.append(toks.numel() - n_prompt)
        ratios.append(max(lens) / (sum(lens) / len(lens)))
    return sum(prompts) / len(prompts), sum(ratios) / len(ratios)


def _trained_drafts(cfg, spec: bool) -> int:
    """Drafts a step trains: the co-trained one (speculative runs) and the cold arm where it is on."""
    cold = cfg.arm("cold") if hasattr(cfg, "arm") else bool(cfg.cold_arm)
    return int(spec) + int(bool(cold) and spec)


def _draft_share(cfg, step: int) -> float:
    """Share of step `step`'s updates that train the drafts (--draft_every n: global update indices divisible by n)."""
    n, u = getattr(cfg, "draft_every", 1), cfg.updates
    return sum((i % n) == 0 for i in range((step - 1) * u, step * u)) / u


def workload(cfg, rec: dict, prompt_len: float, tail: float, drafts: bool = True, world: int = 0,
             no_spec: bool = False) -> Workload:
    """The step's Workload: the run's config, the record's rows / response length / acceptance. drafts False: the
    run trained none (its draft_train is 0 throughout, e.g. plain GRPO). A record with token_mult_prob_error comes
    from a run that took pi_old from a forward before the updates (older ones: from the rollout); one with
    weights_fingerprint, from a run that refitted once per step and compared the ranks' fingerprints."""
    if cfg.num_draft_tokens == "auto":
        raise ValueError("--num_draft_tokens=auto: k changes per step; the check models a fixed k")
    world = len(rec.get("rank_rows") or []) or world
    if not world:
        raise ValueError("the run's records carry no rank_rows (older runs): pass --world N, its processes")
    dp = cfg.dp or max(1, world // (cfg.pp * cfg.cp))
    pp, cp = (cfg.pp, cfg.cp) if world > 1 else (1, 1)
    acc = rec.get("accept_len")
    spec = acc is not None and not (no_spec or getattr(cfg, "no_spec", False))  # a plain run logs accept_len 1
    return Workload(rows=sum(rec.get("rank_rows") or [cfg.prompts_per_step * cfg.group_size]), prompt_len=prompt_len,
                    resp_len=float(rec["resp_len"]), tail=tail, rollout_batch=cfg.rollout_batch,
                    k=cfg.num_draft_tokens if spec else 0, accept_len=float(acc) if spec else 0.0,
                    updates=cfg.updates, micro_batches=cfg.micro_batches, ttt_passes=cfg.ttt_passes,
                    drafts=_trained_drafts(cfg, spec) if drafts else 0, pp=pp, cp=cp, dp=dp,
                    checkpointing=cfg.activation_checkpointing, draft_vocab=cfg.draft_vocab,
                    draft_share=_draft_share(cfg, int(rec.get("step", 1))),
                    pi_old_forward="token_mult_prob_error" in rec,  # earlier runs read pi_old from the rollout
                    refit_once="weights_fingerprint" in rec)  # and refitted after every update, unchecked


def check(run: str, device: Device, argv: list = (), tail: float = 0.0, prompt_len: float = 0.0,
          world: int = 0, cpu: bool = False) -> dict:
    """{component: (measured mean s, predicted mean s, relative error)} over the run's RL steps. cpu: the records'
    per-phase CPU seconds (time["cpu"]) against the prediction without contention, for a one-process run (a
    multi-rank run's time["cpu"] sums its ranks', harness/update.world_cpu: compare its wall seconds)."""
    if cpu:
        device = replace(device, cores=float("inf"))
    steps, stored = load_run(run)
    if cpu and len(steps[0].get("rank_rows") or [0]) > 1:
        raise ValueError(f"--cpu: {run} ran {len(steps[0]['rank_rows'])} ranks, whose CPU seconds its records sum; "
                         "the model predicts one process's: expected a one-process run (drop --cpu to check wall)")
    cfg = run_config(stored, list(argv))
    arch = Arch.load(cfg.model)
    if not (tail and prompt_len):
        explicit = sum(r.get("explicit", cfg.p_explicit) for r in steps) / len(steps)
        p, t = task_shape(cfg, explicit)
        tail, prompt_len = tail or t, prompt_len or p
    trains = any(float(r["time"].get("draft_train", 0.0)) > 0 for r in steps)  # which drafts exist, not how fast
    meas = {c: 0.0 for c in COMPONENTS}
    pred = {c: 0.0 for c in COMPONENTS}
    for rec in steps:
        w = workload(cfg, rec, prompt_len, tail, trains, world, bool((stored or {}).get("no_spec")))
        out = predict(arch, device, w)
        roll = out["rollout_spec"] if w.k else out["rollout_ar"]
        for c, v in (("rollout", roll + out["reference"] + out["score"]),  # the run's timers: the drafts'
                     ("policy_train", out["policy_train"] + out["draft_opt"]),  # optimizer steps in policy_train
                     ("draft_train", out["draft_train"])):
            pred[c] += v / len(steps)
            meas[c] += float((rec["time"]["cpu"] if cpu else rec["time"]).get(c, 0.0)) / len(steps)
    meas["step"], pred["step"] = sum(meas.values()), sum(pred.values())
    res = {c: (meas[c], pred[c], pred[c] / meas[c] - 1 if meas[c] else (0.0 if not pred[c] else float("inf")))
           for c in meas}
    res["_inputs"] = {"steps": len(steps), "tail": tail, "prompt_len": prompt_len, "model": cfg.model,
                      "world": w.world, "device": device.name}
    return res


def table(res: dict, tol: float) -> str:
    """The check as a markdown table: measured, predicted, error, within tolerance."""
    i = res["_inputs"]
    lines = [f"{i['steps']} RL steps, model {i['model']}, {i['world']} ranks, device {i['device']}, "
             f"tail {i['tail']:.3f}, prompt {i['prompt_len']:.2f} tokens", "",
             "| component | measured s/step | predicted s/step | error | within ±%d%% |" % round(100 * tol),
             "|---|---|---|---|---|"]
    for c, (m, p, e) in ((c, v) for c, v in res.items() if not c.startswith("_")):
        lines.append(f"| {c} | {m:.3f} | {p:.3f} | {e:+.1%} | {'yes' if abs(e) <= tol else 'NO'} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    rest = argv[argv.index("--") + 1:] if "--" in argv else []
    ap = parser(__doc__, __file__)
    ap.add_argument("run", help="a run directory (metrics.jsonl) or a metrics.jsonl")
    ap.add_argument("--device", default="cpu", help="a device preset (cpu, h100) or a device JSON file")
    ap.add_argument("--tol", type=float, default=0.15, help="relative error allowed per component")
    ap.add_argument("--tail", type=float, default=0.0, help="E[longest]/E[response] per generate call (0: the task's)")
    ap.add_argument("--prompt_len", type=float, default=0.0, help="mean prompt tokens (0: the task's)")
    ap.add_argument("--world", type=int, default=0, help="processes, for records without rank_rows")
    ap.add_argument("--cpu", action="store_true", help="compare CPU seconds (records with time['cpu']), not wall")
    a = ap.parse_args(argv[: argv.index("--")] if "--" in argv else argv)
    bad = [f"--{k}={getattr(a, k)!r}: expected a finite number >= 0 (0: {why})" for k, why in
           (("tol", "exact"), ("tail", "the task's"), ("prompt_len", "the task's")) if not getattr(a, k) >= 0]
    bad += [f"--tail={a.tail!r}: expected 0 (the task's) or >= 1 (the longest row is never below the mean)"] * (
        0 < a.tail < 1)
    bad += [f"--world={a.world}: expected >= 0 (0: the records' rank_rows)"] * (a.world < 0)
    if bad or not all(math.isfinite(x) for x in (a.tol, a.tail, a.prompt_len)):
        raise ValueError("; ".join(bad) or f"--tol, --tail, --prompt_len: expected finite numbers, got {a.tol}, "
                                           f"{a.tail}, {a.prompt_len}")
    res = check(a.run, Device.load(a.device), rest, a.tail, a.prompt_len, a.world, a.cpu)
    print(table(res, a.tol))
    bad = [c for c in COMPONENTS if not abs(res[c][2]) <= a.tol]
    print(f"{'every component' if not bad else ', '.join(bad) + ': NOT'} within ±{a.tol:.0%}")
    return 1 if bad else 0


if __name__ == "__main__":
    run_main(main, __file__)  # an error: one line naming the flag or file (and line), exit 1
