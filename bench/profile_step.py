"""Where an RL step's CPU seconds go, in one process: the default experiment's setup (warm-ups from --cache_dir), then
--steps RL steps (rollout + update, no eval), with the named functions wrapped in CPU-second counters (inclusive:
a wrapped callee's time is also its caller's). Means per step over the steps after the first; what the cost model
counts (harness/cost_model.py) can be read against each line.

    python bench/profile_step.py --steps 4 -- --draft_every 2        # ~1 min with the warm-ups cached
    python bench/profile_step.py --steps 4 -- --no_spec

Phases: R the rollout (harness/rollout.py), U the update (harness/update.py), O the offline arm's control (its own
timer in a run). Also prints, per phase, the generate calls' mean verify / decode forwards, longest and mean row.
"""
from __future__ import annotations

import collections
import functools
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

import dist_step  # noqa: E402
import harness.rollout as hr  # noqa: E402
import harness.update as hu  # noqa: E402
import rl_loop  # noqa: E402
import speculative  # noqa: E402
from harness.config import parse_args  # noqa: E402
from harness.experiment import build  # noqa: E402
from harness.mesh import make_mesh  # noqa: E402
from parallel.cli import parser  # noqa: E402

ACC, CNT, PHASE, GEN = collections.defaultdict(float), collections.Counter(), ["-"], collections.defaultdict(list)


def wrap(owner, name: str, label: str):
    """owner.name -> the same callable, counting its CPU seconds and calls under PHASE:label."""
    f = getattr(owner, name)

    @functools.wraps(f)
    def g(*a, **k):
        t = time.process_time()
        try:
            r = f(*a, **k)
            if label == "speculative.generate":
                lens = [x.numel() for x in r.tokens]
                GEN[PHASE[0]].append((r.stats.policy_forwards, max(lens), sum(lens) / len(lens)))
            return r
        finally:
            ACC[PHASE[0] + ":" + label] += time.process_time() - t
            CNT[PHASE[0] + ":" + label] += 1
    setattr(owner, name, g)


def instrument(s):
    for n in ("generate", "prefill", "propose", "verify_step", "commit"):
        wrap(speculative, n, "speculative." + n)
    for n in ("rollout_block", "reference_logp", "gather_all", "concat_batches", "group_advantages"):
        wrap(hr, n, "rollout." + n)
    wrap(type(s.task), "score", "task.score")
    for n in ("from_rollouts", "select"):
        wrap(rl_loop.RolloutBatch, n, "RolloutBatch." + n)
    for n in ("step", "refit", "_clip_policy_grads"):
        wrap(type(s.cotrainer), n, "DistCotrainer." + n)
    for n in ("microbatches", "grpo_weights", "clip_grads_"):
        wrap(dist_step, n, "dist_step." + n)
    for n in ("_forward", "_backward"):
        wrap(type(s.cotrainer.sched), n, "pipeline." + n)
    wrap(s.cotrainer.opt, "step", "policy optimizer.step")
    wrap(s.cotrainer.opt, "zero_grad", "policy optimizer.zero_grad")
    for name, tr in s.drafts.items():
        wrap(tr.opt, "step", f"{name} draft optimizer.step")
        wrap(tr.draft, "ttt_loss", f"{name} draft ttt_loss (forward)")
    wrap(hu, "rollout_kl", "update.rollout_kl")
    if s.offline is not None:
        off = s.offline.step

        def step(*a, **k):
            PHASE[0] = "O"
            try:
                return off(*a, **k)
            finally:
                PHASE[0] = "U"
        s.offline.step = step


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    rest = argv[argv.index("--") + 1:] if "--" in argv else []
    ap = parser(__doc__, __file__)
    ap.add_argument("--steps", type=int, default=4, help="RL steps (the first is not counted)")
    ap.add_argument("--cache_dir", default="cache", help="where the warm-ups are cached (train.py's --cache_dir)")
    a = ap.parse_args(argv[: argv.index("--")] if "--" in argv else argv)
    if a.steps < 2:
        raise SystemExit(f"--steps={a.steps}: expected >= 2 (the first step is not counted)")
    cfg = parse_args(["--cache_dir", a.cache_dir, "--out", "/tmp/profile_step"] + rest)
    torch.set_num_threads(cfg.threads)
    mesh = make_mesh(cfg)
    s = build(cfg, mesh, log=print)
    instrument(s)
    timers = collections.defaultdict(float)
    for step in range(1, a.steps + 1):
        if step == 2:
            ACC.clear(), CNT.clear(), GEN.clear(), timers.clear()
        timer, c0 = {}, time.process_time()
        PHASE[0] = "R"
        batch, info = hr.rollout(s, mesh, s.task.sample(cfg.prompts_per_step, s.rng), timer)
        timer["cpu"] = {"rollout": time.process_time() - c0}
        PHASE[0] = "U"
        hu.update(s, batch, timer, step)
        for k, v in timer["cpu"].items():
            timers[k] += v
    n = a.steps - 1
    print(f"CPU s per step, mean of steps 2..{a.steps}; load average {os.getloadavg()[0]:.2f}")
    for k, v in sorted(timers.items()):
        print(f"  {'time[cpu][' + k + ']':<44}{v / n:9.4f}")
    for k, v in sorted(ACC.items(), key=lambda kv: -kv[1]):
        print(f"  {k:<44}{v / n:9.4f}   calls/step {CNT[k] / n:7.1f}")
    for ph, g in GEN.items():
        m = len(g)
        print(f"  {ph}: {m / n:.0f} generate calls/step: forwards {sum(x[0] for x in g) / m:.2f}, longest row "
              f"{sum(x[1] for x in g) / m:.1f}, mean row {sum(x[2] for x in g) / m:.1f} tokens")


if __name__ == "__main__":
    from parallel.cli import run_main  # an error: one line, exit 1 (COSPEC_TRACEBACK=1: the traceback)
    run_main(main, __file__)
