"""Metrics where users look: metrics.jsonl always, TensorBoard and Weights & Biases (offline) when asked for.

One record per call, the same dict train.py writes to metrics.jsonl ({"kind": "train" | "eval", "step": n, ...}).
The jsonl line is the record as is; TensorBoard and wandb get its numbers flattened under the record's kind:

    {"kind": "train", "step": 3, "reward": 0.4, "time": {"rollout": 1.2}, "alpha": [0.8, 0.6]}
      -> train/reward = 0.4, train/time/rollout = 1.2, train/alpha/0 = 0.8, train/alpha/1 = 0.6   at step 3

Strings and None are left to the jsonl. tensorboard and wandb are optional extras (`pip install -e ".[tensorboard]"`,
`".[wandb]"`): asking for one that is not installed is an error naming the package, never a silent no-op. wandb runs
in offline mode (files under <out>/wandb; `wandb sync` uploads them later) so a run never needs the network.

    python -m harness.logger OUT_DIR [tensorboard] [wandb]    # logs a few fake steps
    tensorboard --logdir OUT_DIR/tb                             # then look at them
"""
from __future__ import annotations

import json
import math
import os
import sys

BACKENDS = ("jsonl", "tensorboard", "wandb")


def parse_backends(spec: str) -> tuple:
    """'jsonl,tensorboard' -> ('jsonl', 'tensorboard'); jsonl is always included; unknown names are an error."""
    names = [s.strip() for s in spec.split(",") if s.strip()]
    bad = [n for n in names if n not in BACKENDS]
    if bad:
        raise ValueError(f"log={spec!r}: unknown backend(s) {bad}; expected a comma list of {list(BACKENDS)}")
    return tuple(dict.fromkeys(["jsonl", *names]))


def flatten(record: dict, prefix: str = "") -> dict:
    """Nested dicts and lists of numbers -> {"a/b": float}; bools count as 0/1; non-finite and non-numbers dropped."""
    out = {}
    items = record.items() if isinstance(record, dict) else enumerate(record)
    for k, v in items:
        key = f"{prefix}{k}"
        if isinstance(v, (dict, list, tuple)):
            out.update(flatten(v, key + "/"))
        elif isinstance(v, (bool, int, float)) and math.isfinite(float(v)):
            out[key] = float(v)
    return out


class MetricsLogger:
    """log(record) -> <out>/metrics.jsonl (+ <out>/tb event files, + <out>/wandb offline run); close() at the end.
    enabled=False (every rank but 0) makes every call a no-op. mode="a" appends to an existing metrics.jsonl."""

    def __init__(self, out_dir: str, backends=("jsonl",), *, enabled: bool = True, config: dict | None = None,
                 mode: str = "w"):
        backends = parse_backends(",".join(backends)) if not isinstance(backends, str) else parse_backends(backends)
        self.enabled, self.backends, self._tb, self._wandb = enabled, backends, None, None
        if not enabled:
            return
        os.makedirs(out_dir, exist_ok=True)
        self._tb = _tensorboard(out_dir) if "tensorboard" in backends else None
        self._wandb = _wandb(out_dir, config) if "wandb" in backends else None
        self._f = open(os.path.join(out_dir, "metrics.jsonl"), mode)

    def log(self, record: dict):
        if not self.enabled:
            return
        self._f.write(json.dumps(record) + "\n")
        self._f.flush()  # a crashed run keeps every step it finished
        if self._tb is None and self._wandb is None:
            return
        step = int(record.get("step", 0))
        fields = {k: v for k, v in record.items() if k not in ("kind", "step")}
        flat = flatten(fields, f"{record.get('kind', 'metrics')}/")
        if self._tb is not None:
            for k, v in flat.items():
                self._tb.add_scalar(k, v, global_step=step)
            self._tb.flush()
        if self._wandb is not None:
            self._wandb.log(flat, step=step)

    def close(self):
        if not self.enabled:
            return
        self._f.close()
        if self._tb is not None:
            self._tb.close()
        if self._wandb is not None:
            self._wandb.finish()


def _tensorboard(out_dir):
    try:
        from torch.utils.tensorboard import SummaryWriter  # needs the `tensorboard` package
    except ImportError:
        raise ImportError("log=tensorboard needs the `tensorboard` package: "
                          "pip install -e \".[tensorboard]\"") from None
    return SummaryWriter(os.path.join(out_dir, "tb"))


def _wandb(out_dir, config):
    try:
        import wandb
    except ImportError:
        raise ImportError("log=wandb needs the `wandb` package: pip install -e \".[wandb]\"") from None
    return wandb.init(mode="offline", dir=out_dir, project="cospec", config=config or {})


if __name__ == "__main__":
    from parallel.cli import answer_help
    answer_help(__doc__, __file__)  # -h / --help: usage and summary from the docstring, exit 0
    if len(sys.argv) < 2:
        sys.exit("usage: python -m harness.logger OUT_DIR [tensorboard] [wandb]")
    lg = MetricsLogger(sys.argv[1], ("jsonl", *sys.argv[2:]))
    for s in range(1, 6):
        lg.log({"kind": "train", "step": s, "reward": s / 10, "time": {"rollout": 1.0 + s}, "alpha": [0.9, 0.7]})
    lg.close()
    print(f"wrote {sys.argv[1]}/metrics.jsonl" + (f" and {sys.argv[2:]}" if sys.argv[2:] else ""))
