"""The run's figure: reward, acceptance of the co-trained vs frozen (vs cold-start) draft, and the staleness curve.

    python -m harness.plots runs/default          # re-draw runs/default/train.png from its metrics.jsonl

Panels: (1) reward and accuracy per RL step (rollouts, held-out); (2) acceptance length at each eval on the same
held-out prompts for every arm (co-trained, frozen warm-up, offline-extended, cold start); (3) the teacher-forced
tau_hat of every arm on each step's rollouts (from the update's own taps); (4) the staleness curve: tau_hat vs
KL(pi_t || pi_0) -- a draft that cannot follow the drift falls as KL grows; (5) per-position acceptance alpha_j at the
end; (6) where the wall-clock time went.
"""
from __future__ import annotations

import json
import os
import sys

ARMS = (("cotrained", "co-trained draft", "tab:blue"), ("frozen", "frozen warm-up draft", "tab:red"),
        ("offline", "offline-extended (fresh pi_0 samples)", "tab:orange"),
        ("cold", "cold-start draft (co-trained)", "tab:green"))


def read_metrics(path: str) -> tuple[list, list]:
    """metrics.jsonl -> (train rows, eval rows): every line has "kind": "train" or "eval"."""
    rows = [json.loads(line) for line in open(path) if line.strip()]
    return [r for r in rows if r["kind"] == "train"], [r for r in rows if r["kind"] == "eval"]


def plot_run(train_rows: list, eval_rows: list, path: str, title: str = "") -> str:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(2, 3, figsize=(16, 8))
    ax = ax.ravel()
    steps = [r["step"] for r in train_rows]
    ax[0].plot(steps, [r["reward"] for r in train_rows], color="tab:purple", alpha=0.35, label="reward (rollouts)")
    ax[0].plot(steps, _smooth([r["reward"] for r in train_rows]), color="tab:purple", label="reward (smoothed)")
    ax[0].plot(steps, _smooth([r["correct"] for r in train_rows]), color="tab:gray", ls="--", label="accuracy")
    if eval_rows:
        ax[0].plot([r["step"] for r in eval_rows], [r["reward"] for r in eval_rows], "o", color="k", ms=4,
                   label="reward (held-out)")
        ax[0].plot([r["step"] for r in eval_rows], [r["correct"] for r in eval_rows], "s", color="tab:gray", ms=4,
                   label="accuracy (held-out)")
    ax[0].set(xlabel="RL step", title="reward and accuracy", ylim=(0, None))
    ax[0].legend(fontsize=7)

    for key, label, color in ARMS:
        pts = [(r["step"], r[f"accept_{key}"]) for r in eval_rows if r.get(f"accept_{key}") is not None]
        if pts:
            ax[1].plot(*zip(*pts), "o-", color=color, label=label)
        pts = [(r["step"], r.get(f"tau_hat_{key}"), r["kl"]) for r in train_rows
               if r.get(f"tau_hat_{key}") is not None]  # steps whose updates trained the drafts (--draft_every)
        if pts:
            at, tau, kl = zip(*pts)
            ax[2].plot(at, tau, color=color, alpha=0.3)
            ax[2].plot(at, _smooth(list(tau)), color=color, label=label)
            if all(k is not None for k in kl):  # no KL without a reference (--log_kl)
                ax[3].scatter(kl, tau, color=color, s=8, alpha=0.6, label=label)
        alpha = [r[f"alpha_{key}"] for r in train_rows if r.get(f"alpha_{key}") is not None]
        alpha = alpha[-max(len(alpha) // 10, 1):]
        if alpha:
            mean = [sum(a[j] for a in alpha) / len(alpha) for j in range(len(alpha[0]))]
            ax[4].plot(range(1, len(mean) + 1), mean, "o-", color=color, label=label)
    ax[1].axhline(1.0, color="k", lw=0.5)
    ax[1].set(xlabel="RL step", ylabel="tokens kept / verification forward",
              title="acceptance length, held-out prompts (speculative)")
    ax[2].set(xlabel="RL step", ylabel="tau_hat", title="teacher-forced tau_hat on each step's rollouts")
    ax[3].set(xlabel="KL(pi_t || pi_0) on the step's rollouts", ylabel="tau_hat (teacher-forced)",
              title="staleness: acceptance vs drift")
    ax[4].set(xlabel="draft position j", ylabel="alpha_j", title="per-position acceptance, last 10% of steps")
    for a in ax[1:5]:
        if a.get_legend_handles_labels()[0]:  # --no_spec: no arm to plot
            a.legend(fontsize=7)

    parts = [("rollout", "tab:orange"), ("policy_train", "tab:purple"), ("draft_train", "tab:blue"),
             ("eval", "tab:gray"), ("watch", "tab:pink"), ("offline_sample", "tab:olive"),
             ("offline_train", "tab:cyan")]
    bottom = [0.0] * len(train_rows)
    for key, color in parts:
        vals = [r["time"].get(key, 0.0) for r in train_rows]
        ax[5].bar(steps, vals, bottom=bottom, color=color, width=1.0, label=key)
        bottom = [b + v for b, v in zip(bottom, vals)]
    ax[5].set(xlabel="RL step", ylabel="seconds", title="time per step (watch, offline_*: the controls' cost)")
    ax[5].legend(fontsize=7)
    if title:
        fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)
    return path


def _smooth(xs: list, w: int = 5) -> list:
    return [sum(xs[max(0, i - w + 1): i + 1]) / len(xs[max(0, i - w + 1): i + 1]) for i in range(len(xs))]


if __name__ == "__main__":
    from parallel.cli import answer_help
    answer_help(__doc__, __file__)  # -h / --help: usage and summary from the docstring, exit 0
    run = sys.argv[1] if len(sys.argv) > 1 else "runs/default"
    tr, ev = read_metrics(os.path.join(run, "metrics.jsonl"))
    print(plot_run(tr, ev, os.path.join(run, "train.png"), title=run))
