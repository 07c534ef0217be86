"""DSpark's confidence cut in the rollout table's regime: what it changes in acceptance, in the tokens a verification
forward checks and in the drafts proposed, against the same draft uncut, on the same prompts and sampling seeds.

bench/bench_rollout_families.py's policy (the phrase language) and DSpark draft (trained the same way; both caches
shared with it), then for every sampling seed s, threshold t (0: the cut off), k and batch B: `prompts` held-out
prompts of seed s, B rows per generate call, sampled at tau with seed s (draft_dspark.propose: a row's block ends
before its first slot with c_k < t). The cut is lossless, so each threshold samples the policy's own distribution;
what differs is how the tokens are verified. Per row, mean and sd over the seeds, and each measure's change from the
cut off on the same seed (vs_off: mean and sd of the paired differences):

    acceptance length      tokens kept per verification forward (speculative.py's; bonus included)
    drafted / forward      draft tokens a forward verifies (k with the cut off)
    width                  1 + the widest row's proposal: the tokens per row the policy's forward computes
    accept rate            accepted / drafted
    drafts cut             1 - drafted / (k row_steps): proposed slots the cut saved
    forwards / 100 tok     verification forwards per 100 generated tokens (each one draft block forward too)

No clock: counts only (every slot's Markov step still runs; the cut shortens verification, not the draft's work).

    python bench/bench_dspark_cut.py        # ~2 min of CPU from empty caches: bench/results/dspark_cut.{json,md}
    python bench/bench_dspark_cut.py --thresholds=0,0.5,0.8 --ks=8 --batches=1 --seeds=0,1,2

Flags: --thresholds, --ks, --batches, --seeds, --prompts (rows per seed, B to a generate call), --tau,
--block_size, --anchors, then any of bench_rollout.py's --key=value flags (the policy's and the draft's training).
"""
from __future__ import annotations

import json
import os
import statistics
import sys
import time
from dataclasses import asdict

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(1, os.path.dirname(os.path.abspath(__file__)))
import bench_rollout as br  # noqa: E402
import bench_rollout_families as bf  # noqa: E402
from draft_dspark import DSparkDraft  # noqa: E402
from speculative import generate  # noqa: E402

OWN = dict(thresholds="0,0.5,0.7,0.9", ks="6,8", batches="1,8", seeds="0,1,2,3,4", prompts="24", tau="1.0",
           block_size="8", anchors="8")


def parse(argv):
    """(bench_rollout.BenchConfig, own flags parsed); bad values: SystemExit."""
    own, rest = bf.own_flags(argv, OWN, __doc__, __file__)
    try:
        o = dict(thresholds=[float(x) for x in own["thresholds"].split(",")],
                 ks=[int(x) for x in own["ks"].split(",")], batches=[int(x) for x in own["batches"].split(",")],
                 seeds=[int(x) for x in own["seeds"].split(",")], prompts=int(own["prompts"]), tau=float(own["tau"]),
                 W=int(own["block_size"]), anchors=int(own["anchors"]))
    except ValueError:
        raise SystemExit(f"{' '.join(f'--{k}={v}' for k, v in own.items())}: expected numbers (lists comma-separated)")
    if not all(0 <= t <= 1 for t in o["thresholds"]) or 0 not in o["thresholds"]:
        raise SystemExit(f"--thresholds={own['thresholds']}: expected values in [0, 1], 0 (the cut off) among them")
    if o["W"] < 2 or not all(1 <= k <= o["W"] for k in o["ks"]) or min(o["batches"] + [o["prompts"]]) < 1:
        raise SystemExit(f"--ks={own['ks']} --block_size={o['W']}: expected 1 <= k <= block_size, block_size >= 2, "
                         "batches and prompts >= 1")
    return br.parse_args(rest), o


def run(policy, draft, prompts, B: int, k: int, thr: float, tau: float, seed: int, max_new: int) -> dict:
    """One seed's rows at one threshold: the summed SpecStats counts, and each step's widest proposal."""
    widths, propose = [], DSparkDraft.propose

    def counted(*a, **kw):  # the step's width: max(lengths), or k uncut
        out = propose(draft, *a, **kw)
        widths.append(out[0].shape[1])
        return out

    draft.cfg.confidence_threshold, draft.propose = thr, counted
    tot = dict(row_steps=0, kept=0, drafted=0, accepted=0, new_tokens=0, policy_forwards=0)
    try:
        for i in range(0, len(prompts), B):
            st = generate(policy, draft, prompts[i: i + B], max_new_tokens=max_new, num_draft_tokens=k,
                          temperature=tau, generator=torch.Generator().manual_seed(seed * 1000 + i)).stats
            for key in tot:
                tot[key] += getattr(st, key)
    finally:
        del draft.propose
        draft.cfg.confidence_threshold = 0.0
    return dict(tot, width=sum(1 + w for w in widths) / max(len(widths), 1))


def summary(per_seed: list, k: int, off: list = None) -> dict:
    """Each measure's mean and sd over the seeds, its value per seed and, given the cut-off row's counts `off` (the
    same seeds), the paired change from it."""
    rows = {"acceptance_length": lambda t: t["kept"] / t["row_steps"],
            "drafted_per_forward": lambda t: t["drafted"] / t["row_steps"],
            "width": lambda t: t["width"],
            "accept_rate": lambda t: t["accepted"] / max(t["drafted"], 1),
            "drafts_cut": lambda t: 1 - t["drafted"] / (k * t["row_steps"]),
            "forwards_per_100_tokens": lambda t: 100 * t["policy_forwards"] / t["new_tokens"]}
    def stats(v):
        return dict(mean=round(statistics.mean(v), 4), sd=round(statistics.stdev(v), 4) if len(v) > 1 else None)

    out = {}
    for name, f in rows.items():
        v = [f(t) for t in per_seed]
        out[name] = dict(stats(v), per_seed=[round(x, 4) for x in v])
        if off is not None:
            out[name]["vs_off"] = stats([a - f(b) for a, b in zip(v, off)])
    return out


def markdown(res) -> str:
    cols = ["acceptance_length", "drafted_per_forward", "width", "accept_rate", "drafts_cut", "forwards_per_100_tokens"]
    head = ("| B | k | threshold | acceptance length | Δ vs off | drafted / forward | width | accept rate | "
            "drafts cut | forwards / 100 tok | Δ vs off |\n" + "|---:" * 11 + "|")

    def cell(m):
        return f"{m['mean']:.2f} ± {m['sd'] or 0:.2f}"

    def delta(m):
        return f"{m['vs_off']['mean']:+.2f} ± {m['vs_off']['sd'] or 0:.2f}" if "vs_off" in m else "–"
    body = []
    for r in res["rows"]:
        c = [cell(r[x]) for x in cols]
        c.insert(1, delta(r["acceptance_length"]))
        c.append(delta(r["forwards_per_100_tokens"]))
        body.append(f"| {r['batch']} | {r['k']} | {r['threshold']:g} | " + " | ".join(c) + " |")
    return "\n".join([head] + body)


def main(argv):
    cfg, o = parse(argv)
    torch.set_num_threads(cfg.threads)
    t0 = time.process_time()
    lang = br.PhraseLanguage(64, cfg.phrases, cfg.seed)
    policy, key = bf.policy_of(cfg, lang)
    opts = dict(mask_token_id=bf.mask_id(lang, policy.cfg.vocab_size), block_size=o["W"], num_layers=1,
                markov_rank=16, anchors=o["anchors"], gamma=None, seed=cfg.seed)
    draft, metrics, train_s = bf.cached_family(cfg, policy, lang, "dspark", opts, key)
    res = dict(config=asdict(cfg), own=o, argv=argv, draft_train_metrics=metrics, train_seconds=round(train_s, 1),
               rows=[])
    for B in o["batches"]:
        for k in o["ks"]:
            off = None
            for thr in sorted(o["thresholds"]):  # 0 first: the paired baseline
                per_seed = []
                for s in o["seeds"]:
                    prompts = list(lang.sample(o["prompts"], cfg.prompt_len, torch.Generator().manual_seed(1000 + s)))
                    per_seed.append(run(policy, draft, prompts, B, k, thr, o["tau"], s, cfg.max_new_tokens))
                off = per_seed if thr == 0 else off
                row = dict(batch=B, k=k, threshold=thr, tau=o["tau"], **summary(per_seed, k, None if thr == 0 else off),
                           counts=per_seed)
                res["rows"].append(row)
                m = {x: row[x]["mean"] for x in ("acceptance_length", "drafted_per_forward", "width", "drafts_cut",
                                                 "forwards_per_100_tokens")}
                print(f"B={B} k={k} thr={thr:g}: " + ", ".join(f"{x} {v:.2f}" for x, v in m.items()))
    res["cpu_seconds"] = round(time.process_time() - t0, 1)
    table = markdown(res)
    print("\n" + table)
    out = cfg.out if cfg.out != br.BenchConfig.out else "bench/results/dspark_cut.json"
    os.makedirs(os.path.dirname(out) or ".", exist_ok=True)
    with open(out, "w") as f:
        json.dump(res, f, indent=2)
    with open(os.path.splitext(out)[0] + ".md", "w") as f:
        cmd = " ".join(["python bench/bench_dspark_cut.py"] + argv)
        f.write(f"`{cmd}` ({res['cpu_seconds']} s of CPU)\n\n{table}\n")
    print(f"wrote {out}")
    return res


if __name__ == "__main__":
    from parallel.cli import run_main  # an error: one line, exit 1 (COSPEC_TRACEBACK=1: the traceback)
    run_main(main, __file__, sys.argv[1:])
