"""The offline-extended control arm: the warm-up draft given the co-trained draft's extra training, without the drift.

Each RL step the co-trained draft takes `updates` TTT steps (fewer under a budget, --draft_every), each on a minibatch
of that step's fresh rollouts of pi_t (n prompts x G samples / updates sequences). The offline-extended draft takes the
SAME number of steps with the
same optimizer (AdamW), lr (draft_lr), gradient clipping, passes and minibatch size -- on FRESH samples of the initial
policy pi_0 (the frozen reference) at the rollout temperature, n x G new ones every step, never a reused pool, with
pi_0's taps and pi_0's untempered softmax(z) as the teacher, like the co-trained draft's (rl_loop.py, step 4: draft
and policy are tempered alike at inference). So it sees as much new data as the co-trained draft; only the
distribution differs:

    co-trained - frozen               = more training + tracking the drift
    co-trained - offline-extended     = tracking the drift (the staleness effect)
    the same with policy lr 0          = 0 up to noise (the no-drift control: pi_t = pi_0)

    arm = OfflineArm(cfg, tsk, ref, draft)       (experiment.build: a copy of the warm-up draft)
    t = arm.step()                               one RL step's worth: {"offline_sample": s, "offline_train": s}

Sampling is plain autoregressive sampling of pi_0 through speculative.generate (draft=None): any lossless sampler would
do, and its cost is the control's, timed apart from the co-trained run. Under torchrun every rank samples its blocks of
rows like the rollouts (mesh.row_blocks; row r draws from the stream keyed by (seed, the arm's step, r // G, r % G))
and every rank gathers them; rank 0 alone trains the draft (`updates` TTT steps on the whole batch: the same cost as
the co-trained draft's share of an update) and `broadcast` copies it to every rank, whose last pipeline stage
measures its teacher-forced acceptance on the rollouts (an observer of the step: harness/watch.py).

Letters: B rows, T packed tokens.
"""
from __future__ import annotations

import random
import time

import torch
import torch.distributed as dist

import speculative
from backends.attention_padded import auto_causal_attention
from backends.fused_logprob import budget_rows
from modeling.mixed_precision import clip_grads_, master_optimizer
from decoding.row_streams import RowStreams, row_keys
from harness.mesh import gather_all, rank_world, row_blocks
from harness import drafters
from rl_loop import RolloutBatch, draft_loss


class OfflineArm:
    def __init__(self, cfg, tsk, ref, draft, *, seed: int):
        self.cfg, self.task, self.ref = cfg, tsk, ref
        adamw = lambda ps: torch.optim.AdamW(ps, lr=cfg.draft_lr, weight_decay=0.0)  # noqa: E731
        opt = master_optimizer(draft.parameters(), adamw) if rank_world()[0] == 0 else None  # rank 0 trains it; the
        # others take its weights (broadcast)
        self.tr = drafters.config_trainer(cfg, tsk, draft, opt)  # the co-trained draft's family options
        dev = next(ref.parameters()).device
        self.rng = random.Random(seed + 555)  # its own prompt stream: fresh prompts, not the rollouts'
        self.seed, self.dev = seed + 556, dev  # the sample streams: row_keys(seed + 556, steps_done, prompt, sample)
        self.perm = torch.Generator().manual_seed(seed + 557)
        self.steps_done = 0

    @property
    def draft(self):
        return self.tr.draft

    def sample(self) -> RolloutBatch:
        """n x G fresh samples of pi_0 at the rollout temperature, packed (no advantages: the draft needs none); this
        rank's blocks of rows, gathered from every rank."""
        c = self.cfg
        prompts = [self.task.encode_prompt(p) for p in self.task.sample(c.prompts_per_step, self.rng)
                   for _ in range(c.group_size)]
        r = torch.arange(len(prompts))
        keys = row_keys(self.seed, self.steps_done, r // c.group_size, r % c.group_size)
        mine = []
        for j, rows in row_blocks(len(prompts), c.rollout_batch, *rank_world()):
            mine.append((j, [t.cpu() for t in speculative.generate(
                self.ref, None, prompts[rows.start: rows.stop], max_new_tokens=self.task.max_new_tokens,
                temperature=c.temperature, eos_id=self.task.tok.eos_ids,
                generator=RowStreams(keys[rows.start: rows.stop].to(self.dev))).tokens]))
        toks = [t for _, b in sorted((b for part in gather_all(mine) for b in part), key=lambda b: b[0]) for t in b]
        zeros = torch.zeros(len(prompts))
        return RolloutBatch.from_rollouts(prompts, toks, [torch.zeros(t.numel()) for t in toks], zeros, zeros.bool())

    def step(self, n_steps: int | None = None) -> dict:
        """One RL step's worth of training: n_steps (default `updates`: the co-trained draft's TTT steps this RL step)
        TTT steps on minibatches of fresh pi_0 samples, the first n_steps of the `updates` minibatches -- the
        co-trained draft's minibatch size. Call on every rank (each samples its blocks); rank 0 trains, then
        `broadcast`."""
        n_steps = self.cfg.updates if n_steps is None else n_steps
        t0 = time.perf_counter()
        batch = self.sample()
        t1 = time.perf_counter()
        if rank_world()[0] != 0:
            self.steps_done += 1
            return {"offline_sample": t1 - t0}
        dev = next(self.ref.parameters()).device
        chunk = budget_rows(self.ref.cfg.vocab_size, self.cfg.chunk_mib)  # rows of the teacher's logits per chunk
        for idx in torch.randperm(batch.num_seqs, generator=self.perm).chunk(self.cfg.updates)[:n_steps]:
            mb = batch.select(idx.sort().values).to(dev)
            with torch.no_grad():  # pi_0's taps and teacher: the policy the warm-up draft was fitted to
                out = self.ref(mb.tokens, mb.cu_seqlens, attn_fn=auto_causal_attention,
                               tap_layers=self.draft.tap_layers, logits=chunk == 0)  # hidden (T, H): no (T, V)
            loss, _ = draft_loss(self.tr, out.taps, out.logits, mb, hidden=out.hidden, head=self.ref.head_weight,
                                 chunk=chunk)  # the update's streamed loss, teacher softmax(z) at any tau
            self.tr.opt.zero_grad(set_to_none=True)
            (self.tr.lam * loss).backward()
            clip_grads_(list(self.draft.parameters()), self.tr.grad_clip)
            self.tr.opt.step()
        self.steps_done += 1
        return {"offline_sample": t1 - t0, "offline_train": time.perf_counter() - t1}

    def state_dict(self) -> dict:  # for --resume (resume.py): weights, optimizer, the prompt and shuffle streams and
        # the step count (the sample streams' key)
        return {"draft": self.draft.state_dict(), "opt": self.tr.opt.state_dict() if self.tr.opt else None,
                "rng": self.rng.getstate(), "perm": self.perm.get_state(), "steps_done": self.steps_done}

    def load_state_dict(self, st: dict):
        self.draft.load_state_dict(st["draft"])
        if self.tr.opt is not None:
            self.tr.opt.load_state_dict(st["opt"])
        self.rng.setstate(st["rng"])
        self.perm.set_state(st["perm"])
        self.steps_done = st["steps_done"]

    @torch.no_grad()
    def broadcast(self, src: int = 0):
        """Every rank's copy <- rank src's (one flat bucket over the world group); a no-op in one process."""
        if not (dist.is_initialized() and dist.get_world_size() > 1):
            return
        ps = [p for p in self.draft.parameters() if p.requires_grad]
        flat = torch.cat([p.reshape(-1) for p in ps])
        dist.broadcast(flat, src=src)
        i = 0
        for p in ps:
            p.copy_(flat[i: i + p.numel()].view_as(p))
            i += p.numel()
