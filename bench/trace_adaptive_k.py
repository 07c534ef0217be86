"""Trace the adaptive-k controller on bench/bench_rollout.py's policy / draft pair: per call, the steps it ran at each k
and the first decision for k* = 0 (the rates relative to k = 0, the costs in ms, the alphas, kappa, rho, the pace), and
at the end the steps timed at each k by batch size. The pair is bench_rollout's (trained on first use, cached).

    python bench/trace_adaptive_k.py              # batch 8, tau 1.5, 20 calls each of AR, k = 3 and auto: ~1 min
    python bench/trace_adaptive_k.py --batch 64 --tau 1 --calls 10

Each call runs autoregressive decoding, a fixed k (--k) and the adaptive controller in turn on the same prompts and
seed, and prints their speedups over autoregressive (CPU clock, one thread); the last line, their medians.
"""
from __future__ import annotations

import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(1, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402

import bench_rollout as br  # noqa: E402
from decoding.adaptive_k import AdaptiveK  # noqa: E402
from parallel.cli import parser  # noqa: E402
from speculative import generate  # noqa: E402


class Traced(AdaptiveK):
    """AdaptiveK that keeps each decision's view: k*, left, open rows, rates / rate(0), costs, alphas, kappa, rho."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.log = []

    def best(self, rows, ctx=None, left=None, open_rows=None):
        k = super().best(rows, ctx, left, open_rows)
        costs = self.costs_at(rows, ctx if left is None or ctx is None else ctx + left / 2)
        rates = self._rates(self.alphas(), costs, left, open_rows or rows, self.rho(), self.kappa())
        self.log.append(dict(k=k, rows=rows, left=left, open=open_rows, rate=[round(x / rates[0], 3) for x in rates],
                             ms=[round(c * 1e3, 2) for c in costs], alpha=[round(a, 2) for a in self.alphas()],
                             kappa=round(self.kappa(), 2), rho=round(self.rho(), 3), pace=round(self.pace, 3)))
        return k


def main(argv=None) -> int:
    ap = parser(__doc__, __file__)
    ap.add_argument("--batch", type=int, default=8, help="rows per generate call")
    ap.add_argument("--tau", type=float, default=1.5, help="sampling temperature")
    ap.add_argument("--calls", type=int, default=20, help="calls of each decoder")
    ap.add_argument("--k", type=int, default=3, help="the fixed k beside auto")
    ap.add_argument("--max_k", type=int, default=6, help="auto's ceiling K")
    a = ap.parse_args(argv)
    for name in ("batch", "calls", "k", "max_k"):
        if getattr(a, name) < 1:
            raise SystemExit(f"--{name}={getattr(a, name)}: expected >= 1")
    cfg = br.parse_args([])
    torch.set_num_threads(1)
    lang = br.PhraseLanguage(64, cfg.phrases, cfg.seed)
    policy, draft, _, _ = br.cached(cfg, lang)
    prompts = list(lang.sample(max(64, a.batch), cfg.prompt_len, torch.Generator().manual_seed(cfg.seed + 3)))
    clock, ctl, speed = time.process_time, Traced(a.max_k, clock=time.process_time), {}
    for r in range(a.calls):
        for label, k in (("AR", 0), (f"k={a.k}", a.k), ("auto", a.max_k)):
            t0, n0, before = clock(), len(ctl.log), list(ctl.chosen)
            st = generate(policy, draft, [prompts[(r * a.batch + i) % len(prompts)] for i in range(a.batch)],
                          max_new_tokens=cfg.max_new_tokens, num_draft_tokens=k, temperature=a.tau,
                          generator=torch.Generator().manual_seed(r), adapt=ctl if label == "auto" else None).stats
            speed.setdefault(label, []).append(st.new_tokens / (clock() - t0))
        zeros = [d for d in ctl.log[n0:] if d["k"] == 0]
        print(f"call {r}: steps at k = 0..{a.max_k} {[x - y for x, y in zip(ctl.chosen, before)]}; speedup "
              f"{ {lb: round(v[-1] / speed['AR'][-1], 2) for lb, v in speed.items() if lb != 'AR'} }; "
              f"k* = 0 decided {len(zeros)}x" + (f", first: {zeros[0]}" if zeros else ""))
    print("steps timed at each k, by batch size:")
    by_k = {}
    for (rows, _), cells in ctl.timed.items():
        for k, e in cells.items():
            by_k.setdefault(k, {}).setdefault(rows, 0)
            by_k[k][rows] += int(e[2])
    for k in sorted(by_k):
        print(f"  k = {k}: {dict(sorted(by_k[k].items()))}")
    ar = statistics.median(speed["AR"])
    print("median speedup over autoregressive:", {lb: round(statistics.median(v) / ar, 3) for lb, v in speed.items()
                                                  if lb != "AR"})
    return 0


if __name__ == "__main__":
    from parallel.cli import run_main  # an error: one line, exit 1 (COSPEC_TRACEBACK=1: the traceback)
    run_main(main, __file__)
