"""The draft hook's time, as an observer of the co-training step (dist_step.StepObserver).

The hook runs on the last stage once per micro-batch: every draft's loss on the taps, its backward, and the watched
arms' reads (harness/watch.py). Wrapped here, it is timed in wall and CPU seconds; the step reduces the last stage's
mean over its CP x DP ranks and returns it as "hook_seconds" / "hook_cpu_seconds". harness/update.py bills the hook,
less the watched arms' own time, to draft training.

    timer = HookTimer()
    ct = DistCotrainer(policy, drafts, grid, make_opt, observers=[timer, watch])
    st = ct.step(batch, grpo_cfg)          # st["hook_seconds"]; timer.own_cpu: this process's CPU seconds
"""
from __future__ import annotations

import time

from dist_step import StepObserver


class HookTimer(StepObserver):
    def __init__(self):
        self._seconds, self._cpu_seconds, self.own_cpu = 0.0, 0.0, 0.0

    def around(self, hook):
        def timed(d):
            t0, c0 = time.perf_counter(), time.process_time()
            out = hook(d)
            self._seconds += time.perf_counter() - t0
            self._cpu_seconds += time.process_time() - c0
            return out
        return timed

    def collect(self, last: bool, share: int) -> tuple:
        out = {}, {"hook_seconds": self._seconds / share if last else 0.0,
                   "hook_cpu_seconds": self._cpu_seconds / share if last else 0.0}
        self.own_cpu = self._cpu_seconds
        self._seconds, self._cpu_seconds = 0.0, 0.0
        return out
