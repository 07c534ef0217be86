"""The co-training step: one GRPO update of the policy and one update of every draft from ONE policy forward.

    DistCotrainer.step, per micro-batch m, through the pipeline (pipeline.py):
      forward    the policy's stages, CP inside each (attention_cp.py); taps leave on TapChannel (tapchannel.py)
      GRPO       log p_tau(x_{t+1} | x_<=t) from the last stage's logits -> the clipped surrogate + k3 (rl_loop.py)
      draft      every draft's loss on the detached taps, the policy's untempered softmax(z) as teacher (drafter.py),
                 and its backward, on the last stage
      backward   the policy's, through the stages
    then both updates: the policy's (global-norm clip, its optimizer), the drafts' (each its clip and optimizer);
    refit        after an RL step's last update: every rank's full policy and drafts, for the next rollouts.

This is the step train.py runs at every world size (one process: the 1 x 1 x 1 grid, no process group). The mesh
enters only through the pieces it changes: the pipeline schedule, the attention function and TapChannel.
tests/reference_step.py writes the same step as a plain loop in one process; they agree to fp64 round-off. Whatever
watches the step -- the experiment's control arms, its timers -- attaches as a StepObserver (harness/watch.py,
harness/step_timer.py); the step's sums travel as one named record (parallel/step_totals.py).

Why the split of the work does not change the step (rl_loop's module docstring has the math):
  1. Policy. Every normalisation of rl_loop.aggregate is LINEAR in the per-token losses l_t, so the minibatch loss is
         L_policy = sum_t w_t l_t,     w_t = dL/dl_t  (computed once, by autograd through aggregate itself)
     with w_t fixed by the single-process micro-batching (token-mean's per-micro-batch means included). Any partition of
     the tokens over DP replicas, micro-batches and CP shards sums to the same L -- and to the same gradient.
  2. Next-token log-probs under CP. log p(x_t | x_<t) reads the logits at t-1, which may sit on another CP rank. So
     the labels move instead: they are taken per prediction (rl_loop.py: indexing), row p carrying target x_{p+1}
     and token p+1's w, old/ref log-probs (0 past a sequence's end); each rank then needs only its own logits rows.
  3. Draft. The draft's loss (any family: EAGLE-3, DFlash, DSpark) is a mean per micro-batch (its own counts: per TTT
     pass, or over a block drafter's (anchor, slot) pairs), averaged over the M micro-batches, as in one process. DP
     rank r therefore takes WHOLE single-process micro-batches r, r+dp, ...; under CP draft.loss(group=) returns this
     rank's share and PipelineSchedule sums draft grads over CP.
  4. DP. PipelineSchedule averages grads over replicas; every loss returned to it is scaled by dp, so the average is the
     sum over replicas = the single-process gradient. Gradient clipping uses the global norm (sum of squares over the
     PP stages, the tied embedding counted once); then each stage steps its own optimizer, the last stage the drafts.
  5. pi_old. An RL step's first update reads it from its own forward (detached); a later update from old_logp, one
     no-grad forward of the same path taken before the first update. The rollout's log-probs are only compared.

After the update `refit` re-assembles the full policy and drafts on every rank for the next rollouts. This rank's
stage is not a copy: its parameters are the full policy's own tensors (stage_of), so refit copies the other stages'.

    python -m pytest -q tests/test_dist_step.py   # 5 (dp, pp, cp) layouts + 7 variants vs one process, 4 gloo ranks
    torchrun --standalone --nproc_per_node=4 train.py --preset smoke        # the loop that calls it (pp=2, cp=2)

Letters: T packed tokens (this rank's shard under CP), S sequences, M micro-batches, V vocab, H hidden.
"""
from __future__ import annotations

import functools

import torch
import torch.distributed as dist
from torch import nn

from branch_mask import pad_ring_of_one, position_ids
from parallel.host_copy import cu_to
from parallel.consistency import check_same_cu_seqlens, check_same_weights
from backends.fused_logprob import token_logp as fused_token_logp
from parallel.grid import Grid
from parallel.step_totals import StepTotals, gathered
from model import EMBED_TAP, Transformer
from modeling.mixed_precision import clip_grads_, clip_stage_grads_, master_optimizer
from parallel.pp_schedule import split_layers
from pipeline import Microbatch, PipelineSchedule, shard_for_cp
from draft_ttt import merge_metrics
from rl_loop import (GRPOConfig, RolloutBatch, aggregate, draft_mask, micro_chunks, per_prediction,
                     seq_ids, token_logp, token_losses)


# ------------------------------------------------------------------------------------------------ the batch, sharded
def grpo_weights(batch: RolloutBatch, cfg: GRPOConfig, micro_batches: int) -> torch.Tensor:
    """(T,) fp64 w with L_policy = sum_t w_t l_t, exactly the one-process step's normalisation (step 1 above)."""
    mask = batch.trained_mask()
    n_seqs, n_tokens = int(batch.valid.sum()), int(mask.sum())
    cu = batch.cu_seqlens.long()
    w = torch.zeros(batch.tokens.shape[0], dtype=torch.float64)
    for chunk in micro_chunks(batch.num_seqs, micro_batches):
        mb = batch.select(chunk)
        l = torch.zeros(mb.tokens.shape[0], dtype=torch.float64, requires_grad=True)
        aggregate(l, mb.trained_mask(), mb.cu_seqlens, cfg.loss_norm, n_seqs=n_seqs, n_tokens=n_tokens,
                  max_len=cfg.max_len, n_micro=micro_batches).backward()
        idx = torch.cat([torch.arange(int(cu[i]), int(cu[i + 1])) for i in chunk.tolist()])
        w[idx] = l.grad.double()
    return w


def microbatches(batch: RolloutBatch, w: torch.Tensor, micro_batches: int, grid: Grid, *,
                 pad_even: bool = False) -> list:
    """This DP rank's micro-batches (whole single-process micro-batches r, r+dp, ...; step 3), CP-sharded.
    pad_even: at cp = 1 too, pad odd sequences to an even length (ring_branch_attention as a ring of one).

    extra: tgt / w / old / ref / resp per prediction (step 2), adv per row, dmask (the draft's loss mask, per
    prediction) and chunk (the single-process micro-batch index)."""
    cu = batch.cu_seqlens.long()
    chunks = micro_chunks(batch.num_seqs, micro_batches)
    mine = list(range(len(chunks)))[grid.dp_rank::grid.dp]
    if not mine:
        raise ValueError(f"micro_batches={micro_batches} over {batch.num_seqs} sequences gives {len(chunks)} "
                         f"micro-batches, fewer than dp={grid.dp}: every DP replica needs >= 1")
    out = []
    for j in mine:
        mb = batch.select(chunks[j])
        idx = torch.cat([torch.arange(int(cu[i]), int(cu[i + 1])) for i in chunks[j].tolist()])
        c = mb.cu_seqlens
        ref = mb.ref_logp if mb.ref_logp is not None else torch.zeros_like(mb.old_logp)
        extra = {"tgt": per_prediction(mb.tokens, c), "w": per_prediction(w[idx], c),
                 "old": per_prediction(mb.old_logp, c), "ref": per_prediction(ref, c),
                 "resp": per_prediction(mb.trained_mask(), c), "adv": mb.adv[seq_ids(c)],
                 "dmask": draft_mask(mb), "chunk": j}
        mb = shard_for_cp(Microbatch(mb.tokens, c, None, extra), grid.cp, grid.cp_rank)
        out.append(_pad_even(mb) if pad_even and grid.cp == 1 else mb)
    return out


def _pad_even(mb: Microbatch) -> Microbatch:
    """The zigzag layout at cp = 1 (branch_mask.pad_ring_of_one says why): odd sequences padded at their ends to even
    lengths, as shard_for_cp pads for cp >= 2. Padding rows carry no loss (their w, resp and dmask are 0)."""
    pad = pad_ring_of_one(mb.cu_seqlens)
    if pad is None:
        return mb
    T = mb.tokens.shape[0]
    extra = {k: pad.pad(v) if isinstance(v, torch.Tensor) and v.dim() and v.shape[0] == T else v
             for k, v in mb.extra.items()}
    return Microbatch(pad.pad(mb.tokens), pad.cu_seqlens, position_ids(pad.cu_seqlens), extra)


# ------------------------------------------------------------------------------------------------------ the update
class StepObserver:
    """What watches DistCotrainer.step without changing it: the experiment's control arms and timers (harness/). Each
    method is a no-op here; an observer overrides what it needs.

        drafts                  drafts read forward only on the step's taps (their taps are formed too)
        around(hook) -> hook    wraps the draft hook: the last stage's draft losses and their backward, per micro-batch
        on_taps(chunk, read)    in the draft hook, once per micro-batch: read(draft, trainer) -> (loss, metrics) is the
                                hook's own draft loss on micro-batch `chunk`'s taps
        collect(last, share)    after the step: ({(chunk, j): metrics of drafts[j]}, {name: this rank's sum}); the
                                sums are reduced over the world with the step's own and returned under their names
                                (a mean over the last stage: add value / share there, 0 elsewhere)
    """
    drafts: tuple = ()

    def around(self, hook):
        return hook

    def on_taps(self, chunk: int, read):
        pass

    def collect(self, last: bool, share: int) -> tuple:
        return {}, {}


class DistCotrainer:
    """This rank's share of the policy update: its stage of the policy with its optimizer, and (used on the last stage)
    the drafts' trainers. Every rank also keeps the FULL policy and drafts for rollouts; `refit` refreshes them.
    The stage's own layers ARE the policy's parameters (stage_of): `step` updates them in the policy in place, and
    refit copies only the other stages' layers -- so the policy given here is the one being trained (pass a copy to
    keep an untouched one).

        ct = DistCotrainer(policy, drafts, grid, lambda ps: torch.optim.AdamW(ps, lr=...), grad_clip=1.0)
        stats = ct.step(batch, grpo_cfg, micro_batches)       # the losses, the GRPO statistics, the drafts' metrics
        ct.refit(policy)                                      # before the next rollouts
    """

    def __init__(self, policy, drafts: list, grid: Grid, make_opt, *, grad_clip: float = 1.0, schedule: str = "1f1b",
                 attn_fn=None, attn_backend=None, logprob_chunk: int = 0, activation_checkpointing: bool = False,
                 observers=(), zero1: bool = False):
        """attn_backend None: the policy uses attn_fn at cp = 1 (the ring otherwise) and each draft its trainer's
        attn_fn; "torch" / "triton" / "flash": every attention of the step, at any cp (a ring of one at cp = 1), is
        attention_cp.ring_branch_attention with that block kernel. logprob_chunk > 0: no (T, V) logits on the last
        stage: GRPO's log-probs come from the final hidden through fused_logprob.token_logp and the drafts' teacher is
        the final hidden + LM head, streamed (draft_loss.Teacher), their loss in chunks of the same rows (0:
        draft_loss.chunk_rows's default). zero1: the stage's optimizer state sharded over its DP x CP ranks
        (parallel/zero1.py). The drafts read e(x_{i+d}) from the embedding tap (stage 0's, through TapChannel).
        activation_checkpointing: each decoder layer of the stage is recomputed in backward.
        observers: StepObservers (below) that watch every step without changing it."""
        cfg = policy.cfg
        bad = [type(o).__name__ for o in observers if not isinstance(o, StepObserver)]
        if bad:
            raise TypeError(f"observers: got {', '.join(bad)}; expected StepObserver instances (dist_step.py)")
        self.grid, self.drafts, self.grad_clip, self.observers = grid, list(drafts), grad_clip, list(observers)
        self.attn_backend, self.logprob_chunk = attn_backend, int(logprob_chunk)
        if self.logprob_chunk < 0:
            raise ValueError(f"logprob_chunk={logprob_chunk}: expected 0 (unfused) or >= 1 rows")
        if attn_backend is not None:
            from attention_cp import ring_branch_attention
            attn_fn = functools.partial(ring_branch_attention, group=grid.cp_group if grid.cp > 1 else None,
                                        backend=attn_backend)
        self.split = split_layers(cfg.num_hidden_layers, grid.pp)
        self.stage = stage_of(policy, self.split, grid.pp_rank,  # aliases the policy's tensors, see stage_of
                              activation_checkpointing=activation_checkpointing)  # recompute each layer in backward
        self._homes = homes(policy)  # where each policy tensor lives before the optimizer may move it
        # fp32: make_opt (ZeRO-1: sharded over the stage group); bf16: fp32 masters, grads accumulated in fp32
        self.opt = master_optimizer(self.stage.parameters(), make_opt, grid.stage_group if zero1 else None)
        self.policy = policy
        self.reshare()
        self.last = self.stage.is_last
        taps = sorted({l for tr in self.drafts for l in tr.draft.tap_layers}
                      | {l for d in self._observed() for l in d.tap_layers})
        if taps:  # the embedding tap: e(x_{i+d}) for the drafts from stage 0's forward, not from a full policy copy
            taps = [EMBED_TAP] + taps
        dparams = [p for tr in self.drafts for p in tr.draft.parameters()] if self.last else ()
        flat = getattr(self.opt, "grad_flat", None) is not None  # ZeRO-1 over several ranks: reduce-scattered
        self.sched = PipelineSchedule(self.stage, grid, self.split, schedule=schedule, tap_layers=taps,
                                      attn_fn=attn_fn if grid.cp == 1 or attn_backend else None,
                                      draft_params=dparams, logits=not self.logprob_chunk,
                                      stage_reducer=self.opt.reduce_scatter if flat else None)

    def step(self, batch: RolloutBatch, cfg: GRPOConfig, micro_batches=1, train_drafts=True, on_policy=False,
             pi_old: dict | None = None) -> dict:
        """One update. train_drafts False: the policy's alone. pi_old, the denominator of the ratio: on_policy -- this
        forward's own log-probs, detached (an RL step's first update); else `pi_old` from old_logp(batch) taken
        before the step's first update; else batch.old_logp as given. batch.old_logp is compared with pi_old either
        way ("token_mult_prob_error")."""
        g, K = self.grid, len(self.drafts)
        mbs = self._microbatches(batch, cfg, micro_batches)
        if pi_old is not None and self.last and sorted(pi_old) != sorted(mb.extra["chunk"] for mb in mbs):
            raise ValueError(f"pi_old: holds micro-batches {sorted(pi_old)}, this rank trains "
                             f"{sorted(mb.extra['chunk'] for mb in mbs)}: take it with old_logp(batch) on the same "
                             f"batch and micro_batches={micro_batches}")
        dev = next(self.stage.parameters()).device
        tot, metrics = StepTotals.zeros(K, dev), {}  # metrics: (micro-batch, draft) -> its draft loss's metrics

        def grpo_loss(z, mb):  # logits (T, V), or the final hidden (T, H) when fused -> dp * this rank's share of L
            e = mb.extra
            logp = self._token_logp(z, e["tgt"], cfg.temperature)  # (T,) per prediction: log p_tau(x_{p+1} | x_<=p)
            old = logp.detach() if on_policy else e["old"] if pi_old is None else pi_old[e["chunk"]]
            l, clipped, kl = token_losses(logp, old, e["adv"], e["ref"], cfg)
            with torch.no_grad():
                m = e["resp"].double()
                tot.gen_err += (torch.exp((e["old"].double() - old.double()).abs()) * m).sum()
                tot.clipped += (clipped.double() * m).sum()
                tot.ratio += (torch.exp(logp - old).double() * m).sum()
                tot.k3 += (kl.double() * m).sum()
                tot.tokens += m.sum()
            return (l * e["w"]).sum() * g.dp

        def draft_loss(d):  # last stage, after F(m): every draft's loss (drafter.py) on the detached taps, backward
            read, total, chunk = self._draft_loss_on(d), 0.0, d.mb.extra["chunk"]  # teacher: untempered softmax(z)
            for k, tr in enumerate(self.drafts):
                L, metrics[(chunk, k)] = read(tr.draft, tr)
                tot.loss_draft[k] += L.detach().double() / micro_batches
                total = total + tr.lam * L / micro_batches * g.dp
            for obs in self.observers:
                obs.on_taps(chunk, read)  # forward-only reads of the observers' drafts, on the same taps
            if self.drafts:
                total.backward()  # the draft's graph lives on this stage only: its inputs are detached

        self.opt.zero_grad(set_to_none=True)
        hook = draft_loss if (self.drafts or self._observed()) and train_drafts else None
        for obs in self.observers if hook is not None else ():
            hook = obs.around(hook)
        res = self.sched.step(mbs, grpo_loss, hook)
        grad_norm = self._clip_policy_grads()
        self.opt.step()
        if self.last:
            for tr in self.drafts if hook is not None else ():
                clip_grads_(list(tr.draft.parameters()), tr.grad_clip)
                tr.opt.step()
        self._collect(tot, metrics)
        tot = tot.all_reduced()  # world sum: only last-stage ranks hold non-zeros, each its CP / DP share
        metrics = gathered(metrics if (self.last and g.cp_rank == 0) else {})  # every DP replica's micro-batches
        pooled = [merge_metrics([metrics[key] for key in sorted(metrics) if key[1] == k])  # count-weighted, as
                  for k in range(K + len(self._observed()))]  # the one-process step pools every micro-batch's
        draft_losses = tot.loss_draft.tolist()
        return {"loss_policy": res.loss, "loss_draft": draft_losses,
                "draft_metrics": pooled[:K], "observed_metrics": pooled[K:],
                "clip_frac": tot.mean("clipped"), "ratio": tot.mean("ratio"), "k3": tot.mean("k3"),
                "grad_norm": grad_norm,
                "token_mult_prob_error": tot.mean("gen_err") if float(tot.tokens) else None,  # None: no trained token
                "p2p_bytes": res.p2p_bytes, "tap_bytes": res.tap_bytes,
                "loss_total": res.loss + sum(tr.lam * x for tr, x in zip(self.drafts, draft_losses)),
                **{name: float(v) for name, v in tot.extra.items()}}  # the observers' sums

    def old_logp(self, batch: RolloutBatch, cfg: GRPOConfig, micro_batches=1) -> dict:
        """pi_old for an update that is not the RL step's first: {micro-batch: (T,) log p_tau per prediction} of this
        rank's share of `batch` under the weights as they are now, from one no-grad forward through the update's own
        path (the stages, the ring, the LM head as step() forms them). Take it for every later minibatch before the
        first update moves the weights; pass it to step(pi_old=). Empty on every stage but the last."""
        mbs = self._microbatches(batch, cfg, micro_batches)
        out = self.sched.forward(mbs, lambda z, mb: self._token_logp(z, mb.extra["tgt"], cfg.temperature))
        return {mb.extra["chunk"]: lp for mb, lp in zip(mbs, out)}

    def _microbatches(self, batch: RolloutBatch, cfg: GRPOConfig, micro_batches: int) -> list:
        """This rank's micro-batches of `batch` (microbatches above), on the stage's device."""
        g = self.grid
        mbs = microbatches(batch, grpo_weights(batch, cfg, micro_batches), micro_batches, g,
                           pad_even=self.attn_backend is not None)
        check_same_cu_seqlens([mb.cu_seqlens for mb in mbs], g.cp_group)  # once per step: 8 bytes, no per-call sync
        dev = next(self.stage.parameters()).device
        return [Microbatch(mb.tokens.to(dev), cu_to(mb.cu_seqlens, dev),  # with its host copy
                           None if mb.position_ids is None else mb.position_ids.to(dev),
                           {k: v.to(dev) if isinstance(v, torch.Tensor) else v for k, v in mb.extra.items()})
                for mb in mbs]

    def _draft_loss_on(self, d):
        """read(draft, trainer) -> (loss, metrics): `draft`'s loss (drafter.py; EAGLE-3: TTT) on micro-batch d's
        detached taps, with the policy's untempered softmax(z) as teacher at any rollout temperature (draft and policy
        are tempered alike at inference: rl_loop.py, step 4) and `trainer`'s options -- the hook's one draft loss, for
        the trained drafts and the observers' alike. Under CP the loss is this rank's share (group=)."""
        mb = d.mb
        teacher = self._teacher(d)
        backend = dict(backend=self.attn_backend or "torch", group=self.grid.cp_group,
                       chunk=self.logprob_chunk or None)  # the draft loss's chunk: the log-probs' rows

        def read(draft, tr):
            return draft.loss(d.taps, mb.tokens, mb.cu_seqlens, loss_mask=mb.extra["dmask"],
                              position_ids=mb.position_ids, attn_fn=self._draft_attn(tr.attn_fn),
                              **draft.loss_options(tr), **backend, **teacher)
        return read

    def _collect(self, tot: StepTotals, metrics: dict):
        """The observers' part of the step: their drafts' metrics into `metrics` (after the trained drafts', in the
        observers' order) and their sums into tot.extra, this rank's share (the last stage's ranks each 1/(cp dp))."""
        j, share = len(self.drafts), self.grid.cp * self.grid.dp
        for obs in self.observers:
            observed, sums = obs.collect(self.last, share)
            metrics.update({(chunk, j + i): m for (chunk, i), m in observed.items()})
            j += len(obs.drafts)
            dev = tot.tokens.device
            tot.extra.update({k: torch.as_tensor(float(v), dtype=torch.float64, device=dev) for k, v in sums.items()})

    def _token_logp(self, z, targets, tau: float):
        """(T,) log p_tau(targets): from the logits z (T, V), or -- logprob_chunk > 0 -- from the final hidden z (T, H)
        and this stage's LM head, chunk rows at a time (fused_logprob.token_logp; no (T, V) tensor, gradient kept)."""
        if self.logprob_chunk:
            return fused_token_logp(z, self.stage.head_weight, targets, chunk=self.logprob_chunk, temperature=tau)
        return token_logp(z, targets, tau)

    def _teacher(self, d) -> dict:
        """The drafts' teacher softmax(z), untempered: the policy's logits, or (fused) its hidden + LM head."""
        if self.logprob_chunk:
            return dict(teacher_hidden=d.hidden, teacher_head=self.stage.head_weight)
        return dict(teacher_logits=d.logits)

    def _observed(self) -> list:  # the observers' drafts, read forward only
        return [d for obs in self.observers for d in obs.drafts]

    def _draft_attn(self, attn_fn):  # a draft's own single-process kernel, used only at cp = 1 without a backend
        return attn_fn if self.grid.cp == 1 and self.attn_backend is None else None

    def _clip_policy_grads(self) -> float:
        """torch.nn.utils.clip_grad_norm_ over the WHOLE policy: squares summed over the PP stages (the tied embedding,
        a copy on the last stage, counted once). Grads are already equal across CP and DP ranks."""
        g, st = self.grid, self.stage
        skip = {id(st.embed.weight)} if (g.pp > 1 and self.last and st.cfg.tie_word_embeddings) else set()
        return clip_stage_grads_(list(st.parameters()), self.opt, self.grad_clip, skip=skip,
                                 group=g.pp_group if g.pp > 1 else None)

    # --------------------------------------------------------------------------------------------------- refit
    def reshare(self):
        """A draft holds the policy's embedding and (block drafts) LM head as detached buffers aliasing their storage
        (drafter.py: attach). What re-homes a parameter -- the optimizer's flat buffer under ZeRO-1 or bf16 masters
        (parallel/zero1.py rebinds .data), a cast -- would leave such a buffer on the old storage, silently: a draft
        training against a frozen head. So each draft buffer (trained and observed drafts) that held a policy tensor's
        storage is pointed at its storage now: the stage's own parameter where the stage holds one (the tied
        embedding's copy on the last stage is what trains there; the full copy is refitted once a step), else the
        policy's. After the optimizer is built and every refit: pointers compared only."""
        live = {**dict(self.policy.named_parameters()), **dict(self.stage.named_parameters())}
        for d in [tr.draft for tr in self.drafts] + self._observed():
            for name, buf in list(d.named_buffers(recurse=False)):
                home = self._homes.get(buf.data_ptr())
                if home is not None and live[home].data_ptr() != buf.data_ptr():
                    d.register_buffer(name, live[home].detach(), persistent=name not in d._non_persistent_buffers_set)
        self._homes = {**homes(self.policy), **homes(self.stage)}

    @torch.no_grad()
    def refit(self, policy) -> dict:
        """Re-assemble the full policy and drafts on every rank from the updated PP stages, for the next rollouts.
        Returns {"policy" / "draft k": fingerprint} after checking that every rank holds the same ones (consistency.py).

        This rank's own stage needs no copy: its parameters are the policy's (stage_of), already updated in place.
        Stage s broadcasts its weights (one flat bucket) over the pipeline group; every other rank copies them IN PLACE
        into its full copy (drafts sharing its tensors see the new values: reshare); the last stage then broadcasts
        the drafts. CP and DP peers hold identical stages after the step, so the pipeline group suffices. This is an
        RL system's "weight sync": an inference engine as the rollout worker (vLLM / SGLang) loads the same
        per-stage tensors, named as in the HF checkpoint, in place (vLLM's load_weights), then drops its KV cache.
        Here the "engine" is speculative.generate on a full copy in each process (serving/vllm_engine.py: vLLM's)."""
        g = self.grid
        full = policy.state_dict()
        mine = self.stage.state_dict()
        for s, (a, b) in enumerate(self.split):
            keys = [k for k in full if _owner(k, self.split) == s]
            if g.pp_rank == s:
                stale = [k for k in keys if full[k].data_ptr() != mine[k].data_ptr()]  # none when aliased
                for k in stale:
                    full[k].copy_(mine[k])
                if g.pp > 1:
                    dist.broadcast(torch.cat([mine[k].reshape(-1) for k in keys]), src=g.pp_ranks[s],
                                   group=g.pp_group)
                continue
            flat = torch.empty(sum(full[k].numel() for k in keys), dtype=full[keys[0]].dtype,
                               device=full[keys[0]].device)
            dist.broadcast(flat, src=g.pp_ranks[s], group=g.pp_group)
            i = 0
            for k in keys:
                full[k].copy_(flat[i:i + full[k].numel()].view_as(full[k]))
                i += full[k].numel()
        if g.pp > 1:
            for tr in self.drafts:
                flat = torch.cat([p.reshape(-1) for p in tr.draft.parameters()])
                dist.broadcast(flat, src=g.pp_ranks[-1], group=g.pp_group)
                i = 0
                for p in tr.draft.parameters():
                    p.copy_(flat[i:i + p.numel()].view_as(p))
                    i += p.numel()
        self.reshare()
        parts = {"policy": list(policy.parameters()), **{f"draft {k}": [*tr.draft.parameters(), *tr.draft.buffers()]
                                                          for k, tr in enumerate(self.drafts)}}
        return check_same_weights(parts)  # every rank's rollout copies agree, the drafts' shared buffers included


def homes(model) -> dict:
    """{data_ptr: parameter name} of every parameter of `model`: where its storage is now (DistCotrainer.reshare)."""
    return {p.data_ptr(): n for n, p in model.named_parameters()}


def stage_of(policy, split, s: int, activation_checkpointing: bool = False) -> Transformer:
    """Stage s of `split` whose parameters ARE the full policy's for the weights stage s owns (_owner): the same
    nn.Parameter objects, so the rollout copy holds no second copy of this rank's stage (on a 1 x 1 x 1 mesh the
    stage is the whole policy). Only a weight the stage holds but does not own -- the tied embedding's copy on the
    last stage under pp > 1 -- is a copy. Built on the meta device: no transient second stage.

    Being the same objects, the stage and the policy share everything a trainer attaches to a parameter: .grad,
    bf16's .main_grad hook (modeling/mixed_precision.py), and ZeRO-1 / bf16-master flattening (parallel/zero1.py
    rebinds .data to views of its flat buffer: the policy's tensors become those views too, so the optimizer's
    all-gather writes straight into the rollout copy). CP / DP peers each alias their own copy; activation
    checkpointing recomputes through the same tensors; a resume loads the stage in place (load_state_dict), hence
    the policy. Safe in every mode the trainer has (fp32, bf16, ZeRO-1, both): no mode keeps a copy."""
    with torch.device("meta"):
        stage = Transformer(policy.cfg, layers=split[s], activation_checkpointing=activation_checkpointing)
    full = dict(policy.named_parameters())
    for name, _ in list(stage.named_parameters()):
        owner, _, attr = name.rpartition(".")
        src = full[name]
        p = src.requires_grad_(True) if _owner(name, split) == s else nn.Parameter(src.detach().clone())
        setattr(stage.get_submodule(owner), attr, p)
    return stage


def _owner(key: str, split) -> int:
    """The stage whose weights are the reference for a full-model key (the tied embedding: stage 0)."""
    if key.startswith("model.layers."):
        i = int(key.split(".")[2])
        return next(s for s, (a, b) in enumerate(split) if a <= i < b)
    return 0 if key.startswith("model.embed_tokens") else len(split) - 1
