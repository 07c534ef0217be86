"""The end-to-end RL step with speculation and co-training against plain GRPO, from two finished train.py runs of the
same experiment: what `python -m harness.report RUN --baseline BASE` prints (harness/e2e.py: the step's seconds per
component, the speedup sum_i plain_i / sum_i spec_i and its 95% paired-bootstrap interval over steps; written into
RUN/summary.json), then one headline line, `==> END-TO-END RL STEP SPEEDUP ...`.

    python bench/gpu_check_e2e.py RUN BASE --out=e2e.json    # RUN: train.py --out; BASE: the same with --no_spec

Writes the headline's numbers (with the rollouts' speedup and acceptance the run measured) as JSON to --out.
"""
from __future__ import annotations

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from harness import report  # noqa: E402
from parallel.cli import parser, run_main  # noqa: E402

KEYS = ("e2e_step_speedup_measured", "e2e_step_speedup_measured_ci", "e2e_steps_compared", "e2e_step_s_spec_measured",
        "e2e_step_s_plain", "e2e_parts", "rollout_speedup", "accept_len_cotrained", "steps")


def headline(s: dict, name: str) -> str:
    lo, hi = s["e2e_step_speedup_measured_ci"]
    return (f"==> END-TO-END RL STEP SPEEDUP, co-trained speculative vs plain GRPO ({name}, world size 1): "
            f"{s['e2e_step_speedup_measured']:.2f}x of wall time [95% CI {lo:.2f}, {hi:.2f}] over "
            f"{s['e2e_steps_compared']} steps; {s['e2e_step_s_spec_measured']:.3f} s vs {s['e2e_step_s_plain']:.3f} s "
            f"a step; rollouts {s['rollout_speedup']:.2f}x at acceptance length {s['accept_len_cotrained']:.2f}")


def main(argv):
    ap = parser(__doc__, __file__)
    ap.add_argument("run", help="the co-trained speculative run's directory (train.py --out)")
    ap.add_argument("base", help="the plain-GRPO run's directory (train.py --no_spec --out)")
    ap.add_argument("--out", default="", help="JSON path ('': none)")
    a = ap.parse_args(argv)
    report.main([a.run, "--baseline", a.base])
    with open(os.path.join(a.run, "summary.json")) as f:
        summary = json.load(f)
    with open(os.path.join(a.run, "config.json")) as f:
        name = json.load(f)["name"]
    out = dict({k: summary.get(k) for k in KEYS}, name=name, run=a.run, baseline=a.base)
    if a.out:
        with open(a.out, "w") as f:
            json.dump(out, f, indent=1)
    print(headline(out, f"--preset {name}"))
    return 0


if __name__ == "__main__":
    run_main(main, __file__, sys.argv[1:])
