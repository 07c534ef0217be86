"""The watched arms: drafts measured on the co-trained run's rollouts but never trained on them -- the frozen warm-up
draft (--frozen_arm) and the offline-extended one (--offline_arm, trained elsewhere on pi_0's samples).

Their teacher-forced acceptance on pi_t's rollouts is what the co-trained draft is compared against, so each is read
in the update's own draft hook, as an observer of the step (dist_step.StepObserver), from the same taps and the same
teacher as the trained drafts (the policy's untempered softmax(z) at any rollout temperature, as every arm was
trained: rl_loop.py, step 4), forward only: no extra policy forward, no gradient. The hook hands over its draft loss
as `read`; this class adds what an experiment needs around it -- the arms' metrics per micro-batch and their wall /
CPU seconds, timed apart so that the control's cost is not billed to the co-trained run.

    watch = DraftWatch([frozen, offline], options=cotrained_trainer)
    ct = DistCotrainer(policy, drafts, grid, make_opt, observers=[watch])
    st = ct.step(batch, grpo_cfg)          # st["observed_metrics"][j]: arm j's metrics pooled over the micro-batches
                                           # st["watch_seconds"], st["watch_cpu_seconds"]: their time
"""
from __future__ import annotations

import time

import torch

from dist_step import StepObserver
from rl_loop import DraftTrainer


class DraftWatch(StepObserver):
    """drafts: the watched drafts (drafter.py), in the order of the step's "observed_metrics". options: the
    DraftTrainer whose loss options (passes, pass weights, attention) every arm is read with -- the co-trained
    draft's, so that all arms are measured alike; None: a default DraftTrainer's. own_cpu: this process's CPU
    seconds in the reads of the last step."""

    def __init__(self, drafts, options: DraftTrainer | None = None):
        self.drafts, self.options = list(drafts), options
        self._metrics, self._seconds, self._cpu_seconds, self.own_cpu = {}, 0.0, 0.0, 0.0

    def on_taps(self, chunk: int, read):
        """Micro-batch `chunk`'s reads: read(draft, trainer) -> (loss, metrics) is the hook's draft loss on its taps."""
        t0, c0 = time.perf_counter(), time.process_time()
        with torch.no_grad():
            for j, draft in enumerate(self.drafts):
                tr = self.options if self.options is not None else DraftTrainer(draft, None)
                self._metrics[(chunk, j)] = read(draft, tr)[1]
        self._seconds += time.perf_counter() - t0
        self._cpu_seconds += time.process_time() - c0

    def collect(self, last: bool, share: int) -> tuple:
        """-> ({(chunk, j): metrics}, the last stage's mean wall / CPU seconds), then starts afresh."""
        out = self._metrics, {"watch_seconds": self._seconds / share if last else 0.0,
                              "watch_cpu_seconds": self._cpu_seconds / share if last else 0.0}
        self.own_cpu = self._cpu_seconds
        self._metrics, self._seconds, self._cpu_seconds = {}, 0.0, 0.0
        return out
