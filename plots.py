"""The run's figure: reward, acceptance of the co-trained vs frozen (vs cold-start) draft, and the staleness curve.

    python plots.py runs/default          # re-draw runs/default/train.png from its metrics.jsonl

Panels: (1) reward and accuracy per RL step; (2) acceptance length at each eval step on the same held-out prompts for
the co-trained draft, the frozen warm-up draft and the cold-start draft; (3) acceptance vs KL(pi_t || pi_0) -- the
frozen draft decays as the policy drifts, the co-trained one keeps up; (4) where the wall-clock time went.
"""
from __future__ import annotations

import json
import os
import sys

ARMS = (("cotrained", "co-trained draft", "tab:blue"), ("frozen", "frozen warm-up draft", "tab:red"),
        ("cold", "cold-start draft (co-trained)", "tab:green"))


def read_metrics(path: str) -> tuple[list, list]:
    """metrics.jsonl -> (train rows, eval rows): every line has "kind": "train" or "eval"."""
    rows = [json.loads(line) for line in open(path) if line.strip()]
    return [r for r in rows if r["kind"] == "train"], [r for r in rows if r["kind"] == "eval"]


def plot_run(train_rows: list, eval_rows: list, path: str, title: str = "") -> str:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(1, 4, figsize=(17, 3.6))
    steps = [r["step"] for r in train_rows]
    ax[0].plot(steps, [r["reward"] for r in train_rows], color="tab:purple", alpha=0.35, label="reward (rollouts)")
    ax[0].plot(steps, _smooth([r["reward"] for r in train_rows]), color="tab:purple", label="reward (smoothed)")
    ax[0].plot(steps, _smooth([r["correct"] for r in train_rows]), color="tab:gray", ls="--", label="accuracy")
    if eval_rows:
        ax[0].plot([r["step"] for r in eval_rows], [r["reward"] for r in eval_rows], "o", color="k", ms=4,
                   label="reward (held-out)")
    ax[0].set(xlabel="RL step", title="reward", ylim=(0, None))
    ax[0].legend(fontsize=7)

    for key, label, color in ARMS:
        pts = [(r["step"], r[f"accept_{key}"]) for r in eval_rows if r.get(f"accept_{key}") is not None]
        if pts:
            ax[1].plot(*zip(*pts), "o-", color=color, label=label)
            kl = [_window_kl(train_rows, eval_rows, r) for r in eval_rows if r.get(f"accept_{key}") is not None]
            ax[2].plot(kl, [a for _, a in pts], "o-", color=color, label=label)
    ax[1].axhline(1.0, color="k", lw=0.5)
    ax[1].set(xlabel="RL step", ylabel="tokens / policy forward", title="acceptance length (held-out prompts)")
    ax[1].legend(fontsize=7)
    ax[2].set(xlabel="KL(pi_t || pi_0) on rollouts (mean since the previous eval)", ylabel="acceptance length",
              title="staleness: acceptance vs drift")
    ax[2].legend(fontsize=7)

    parts = [("rollout", "tab:orange"), ("policy_train", "tab:purple"), ("draft_train", "tab:blue"), ("eval", "tab:gray")]
    bottom = [0.0] * len(train_rows)
    for key, color in parts:
        vals = [r["time"].get(key, 0.0) for r in train_rows]
        ax[3].bar(steps, vals, bottom=bottom, color=color, width=1.0, label=key)
        bottom = [b + v for b, v in zip(bottom, vals)]
    ax[3].set(xlabel="RL step", ylabel="seconds", title="time per step")
    ax[3].legend(fontsize=7)
    if title:
        fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)
    return path


def _window_kl(train_rows: list, eval_rows: list, ev: dict) -> float:
    """Mean rollout KL over the train steps since the previous eval (one step's estimate is noisy); 0 at step 0."""
    prev = max([e["step"] for e in eval_rows if e["step"] < ev["step"]], default=0)
    kls = [r["kl"] for r in train_rows if prev < r["step"] <= ev["step"]]
    return sum(kls) / len(kls) if kls else 0.0


def _smooth(xs: list, w: int = 5) -> list:
    return [sum(xs[max(0, i - w + 1): i + 1]) / len(xs[max(0, i - w + 1): i + 1]) for i in range(len(xs))]


if __name__ == "__main__":
    run = sys.argv[1] if len(sys.argv) > 1 else "runs/default"
    tr, ev = read_metrics(os.path.join(run, "metrics.jsonl"))
    print(plot_run(tr, ev, os.path.join(run, "train.png"), title=run))
