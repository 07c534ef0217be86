"""Pipeline parallelism over model.py stage slices: AFAB and 1F1B over M microbatches, CP inside every stage, DP across
replicas, and the draft hook on the last stage fed by TapChannel (tapchannel.py).

The n layers are cut into P stages; the batch into M microbatches. Stage s runs a forward F(m) and a backward B(m)
per microbatch, exchanging activations and their gradients with its neighbours on the pipeline group, in the order
AFAB (all forwards, then all backwards: the reference) or 1F1B (at most P-s microbatches' activations alive on stage
s, same bubble). The orders, the layer split and the point-to-point plan are pure functions in
parallel/pp_schedule.py; this file executes them.

Communication (p2p_plan): the send of each action's output and the receive of the next action's input go out together
in one batch_isend_irecv on the pipeline group, on gloo and NCCL alike; the grid (grid.py) has created every
communicator beforehand. `python -m commcheck.nccl_check` proves every layout deadlock-free under NCCL's rules.

After F(m) the last stage calls the user's draft hook with m's taps (the hidden states after the tapped layers: from
other stages through TapChannel, its own in place), its final hidden, logits and microbatch -- all detached. The
hook runs the draft's backward, or returns its loss for the schedule to run it: the draft's graph lives on the last
stage only. What times or counts the hook wraps it (dist_step.StepObserver); the schedule keeps no timers.

Gradients: step() zeroes .grad, fills it with d(sum_m loss_m)/dtheta, then reduces it: tied embeddings summed between
the first and last stage (Megatron's embedding group), summed over CP (each CP rank saw a shard of the tokens), averaged
over DP replicas. Normalise inside loss_fn (e.g. by the step's token count). Data: every stage of a pipeline gets the
same microbatch list (the loader is replicated across PP, as in Megatron): stage 0 reads tokens, middle stages the
boundaries and sizes, the last stage tokens and labels for the loss and the draft. Under CP each rank passes its zigzag
shard (tokens, global positions) with the global CP-padded cu_seqlens (branch_mask.pad_for_cp / zigzag_shard).

    python pipeline.py                                                  # world size 1: plain gradient accumulation
    torchrun --standalone --nproc_per_node=4 pipeline.py --pp=4          # 4 stages, 1F1B, TapChannel, check vs 1 rank
    torchrun --standalone --nproc_per_node=4 pipeline.py --pp=2 --cp=2 --schedule=afab

Letters: P stages, s stage, M microbatches, m microbatch, T tokens of a microbatch on this rank, H hidden, V vocab.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch
import torch.distributed as dist

from branch_mask import cu_seqlens_from_lengths
from parallel.grid import Grid
from parallel.waits import backend_of, wait_all
from parallel.pp_schedule import SCHEDULES, p2p_plan, schedule_actions, split_layers
from model import EMBED_TAP, ModelConfig, Transformer, check_tap_layers
from tapchannel import TapChannel


# ------------------------------------------------------------------------------------------------------ stages
def build_stage(cfg: ModelConfig, layers, state_dict=None, dtype=None, activation_checkpointing=False) -> Transformer:
    """The stage slice holding `layers` = (a, b), loaded from a full model's state dict if given (so that every stage,
    and the tied embedding copy on the last stage, starts from the same weights)."""
    stage = Transformer(cfg, layers=layers, activation_checkpointing=activation_checkpointing)
    if state_dict is not None:
        stage.load_slice(state_dict)
    return stage.to(dtype) if dtype is not None else stage


# ------------------------------------------------------------------------------------------------------ the schedule
@dataclass
class Microbatch:
    tokens: torch.Tensor  # (T,) int: this rank's tokens (its zigzag shard under CP)
    cu_seqlens: torch.Tensor  # int32 (S+1,): packed boundaries (global and CP-padded under CP)
    position_ids: Optional[torch.Tensor] = None  # (T,) global positions; required under CP
    extra: dict = field(default_factory=dict)  # labels, masks, advantages... for loss_fn and the draft hook


def shard_for_cp(mb: Microbatch, cp: int, rank: int, fill=None) -> Microbatch:
    """CP rank `rank`'s zigzag shard of a whole microbatch (branch_mask.py's layout): every sequence padded to a
    multiple of 2*cp, then tokens, global positions and every (T, ...) tensor in `extra` sharded alike.
    fill = {extra key: pad value} (default 0; e.g. {"labels": -100})."""
    if cp == 1:
        return mb
    from branch_mask import pad_for_cp, position_ids, zigzag_shard
    pad = pad_for_cp(mb.cu_seqlens, cp)
    T, cu, fill = mb.tokens.shape[0], pad.cu_seqlens, fill or {}

    def shard(x, value=0):  # (T_real, ...) -> (T_pad / cp, ...)
        return zigzag_shard(pad.pad(x, fill=value), cu, cp, rank)

    extra = {k: shard(v, fill.get(k, 0)) if isinstance(v, torch.Tensor) and v.dim() and v.shape[0] == T else v
             for k, v in mb.extra.items()}
    return Microbatch(shard(mb.tokens), cu, zigzag_shard(position_ids(cu), cu, cp, rank), extra)


@dataclass
class DraftInputs:  # what the draft hook receives on the last stage after F(m); everything detached
    m: int
    taps: dict  # {layer id: (T, H)} in layer order; remote ones live in a landing slot until the hook returns
    hidden: torch.Tensor  # (T, H) final-normed hidden
    logits: Optional[torch.Tensor]  # (T, V); None under PipelineSchedule(logits=False)
    mb: Microbatch


@dataclass
class StepResult:  # identical on every rank: summed over microbatches and CP shards, averaged over DP
    loss: float
    draft_loss: float
    p2p_bytes: int  # bytes this rank sent on the pipeline group this step
    tap_bytes: int  # bytes this rank sent on TapChannel this step


_NAMES = {"act": "activations", "grad": "gradients"}  # p2p_plan's payloads, as the wait's error names them


class _Batch:
    """One issued plan entry: wait() waits for all of it (as NCCL does: one group, one kernel), within --dist_timeout
    (parallel/waits.py; labels name each transfer in its error), and returns the received buffer, if any. The sent
    tensors stay referenced until then."""

    def __init__(self, works, ops, buf, labels=(), backend=None):
        self.works, self.ops, self.buf, self.labels, self.backend = works, ops, buf, labels, backend

    def wait(self):  # NCCL: the stream waits, the host runs on; gloo: the host waits, within --dist_timeout
        wait_all(self.works, self.labels, self.backend)
        self.works = self.ops = ()
        return self.buf


REDUCE_BUCKET_MIB = 64.0  # gradients reduced over CP / DP this many MiB at a time (the copy the reduction holds)


def grad_buckets(grads: list, mib: float) -> list:
    """Consecutive gradients grouped into buckets of at most `mib` MiB (a larger gradient alone: reduced in place,
    no copy); same dtype and device within a bucket. The reduction is elementwise, so the buckets change no value."""
    out, cur, size = [], [], 0
    for t in grads:
        nb = t.numel() * t.element_size()
        if cur and (size + nb > mib * 2**20 or t.dtype != cur[0].dtype or t.device != cur[0].device):
            out.append(cur)
            cur, size = [], 0
        cur.append(t)
        size += nb
    return out + ([cur] if cur else [])


class PipelineSchedule:
    """Runs one training step of the pipeline on this rank.

        sched = PipelineSchedule(stage, grid, split, schedule="1f1b", tap_layers=(-1, 1, 2), draft_params=draft)
        res = sched.step(microbatches, loss_fn, draft_hook)    # loss_fn(logits (T, V), mb) -> scalar
        optimizer.step()                                        # .grad is reduced and ready

    logits=False: the last stage never forms its (T, V) logits; loss_fn receives the final normed hidden (T, H)
    instead (with the graph to the stage's weights: take the head from stage.head_weight, e.g. through
    fused_logprob.token_logp) and the draft hook gets DraftInputs.logits = None.
    """

    def __init__(self, stage: Transformer, grid: Grid, split, *, schedule: str = "1f1b", tap_layers=None,
                 attn_fn: Optional[Callable] = None, draft_params=(), logits: bool = True,
                 stage_reducer: Optional[Callable] = None):
        if schedule not in SCHEDULES:
            raise ValueError(f"schedule={schedule!r}: expected one of {SCHEDULES}")
        if len(split) != grid.pp or tuple(stage.layer_range) != tuple(split[grid.pp_rank]):
            raise ValueError(f"stage holds layers {stage.layer_range}, but split {split} gives stage {grid.pp_rank} "
                             f"of {grid.pp} the layers {split[grid.pp_rank] if grid.pp_rank < len(split) else None}")
        self.stage, self.grid, self.split, self.schedule = stage, grid, [tuple(r) for r in split], schedule
        self.logits = bool(logits)
        self.first, self.last = stage.is_first, stage.is_last
        n = stage.cfg.num_hidden_layers
        self.tap_layers = () if tap_layers is None else tuple(sorted(check_tap_layers(tap_layers, n)))
        a, b = stage.layer_range
        self.local_taps = tuple(l for l in self.tap_layers if a <= l < b or (l == EMBED_TAP and self.first))
        if attn_fn is None and grid.cp > 1:
            from attention_cp import ring_branch_attention
            attn_fn = functools.partial(ring_branch_attention, group=grid.cp_group)
        self.attn_fn = attn_fn
        self.draft_params = list(draft_params.parameters() if hasattr(draft_params, "parameters") else draft_params)
        self.stage_reducer = stage_reducer  # the stage's gradients over CP x DP, itself (ZeRO-1's reduce_scatter)
        if self.draft_params and not self.last:
            raise ValueError("draft_params: the draft lives on the last stage only")
        if grid.pp > 1 and stage.cfg.tie_word_embeddings and (self.first or self.last) and grid.embed_group is None:
            raise ValueError("grid: a tied LM head under pp > 1 needs the embedding group (Grid.build(tied=True))")
        self.channel = (TapChannel(grid.tap_group, grid.pp_ranks, grid.pp_rank, self.split, self.tap_layers)
                        if self.tap_layers and grid.pp > 1 else None)
        p = next(stage.parameters())
        self.dtype, self.device, self.H = p.dtype, p.device, stage.cfg.hidden_size
        s = grid.pp_rank
        self.prev = grid.pp_ranks[s - 1] if s > 0 else None
        self.next = grid.pp_ranks[s + 1] if s + 1 < grid.pp else None

    # ------------------------------------------------------------------------------------------------- one step
    def step(self, microbatches, loss_fn: Callable, draft_hook: Optional[Callable] = None) -> StepResult:
        """F / B of every micro-batch in the schedule's order; draft_hook None: no taps are formed or sent this step
        (every rank of the step must agree), the update of plain GRPO."""
        mbs = list(microbatches)
        M = len(mbs)
        if M < 1:
            raise ValueError(f"microbatches: got M={M}; a step needs M >= 1")
        self._mbs, self._loss_fn, self._draft_hook = mbs, loss_fn, draft_hook
        self._saved, self._p2p_bytes = {}, 0
        self._chan = self.channel if draft_hook is not None else None  # this step's tap path (None: no taps)
        zero = torch.zeros((), dtype=torch.float64, device=self.device)
        self._loss, self._draft = zero, zero.clone()  # accumulated as tensors: no host sync per microbatch
        tap_bytes0 = self.channel.bytes_sent if self.channel else 0  # (the channel's lifetime count)
        for prm in self._params():
            prm.grad = None
            if hasattr(prm, "main_grad"):  # mixed_precision.py: the fp32 accumulator the bf16 grads land in
                prm.main_grad.zero_()
        if self._chan is not None and self.last:
            self.channel.begin([mb.tokens.shape[0] for mb in mbs], self.H, self.dtype, self.device)
        acts = schedule_actions(self.schedule, self.grid.pp, self.grid.pp_rank, M)
        plan = p2p_plan(acts, self.grid.pp_rank, self.grid.pp)
        pending = self._exchange(plan[0], None)
        for i, (kind, m) in enumerate(acts):
            got = pending.wait()  # sync point: this action's input is here (and the previous send has left)
            out = self._forward(m, got) if kind == "F" else self._backward(m, got)
            pending = self._exchange(plan[i + 1], self._payload(m, out) if kind == "F" and out is not None else out)
            if kind == "F" and out is not None:
                self._send_taps(m, out)  # after the activation: async, off the critical path
        pending.wait()
        if self._chan is not None:
            self.channel.finish()
        self._reduce_grads()
        tap_bytes = (self.channel.bytes_sent if self.channel else 0) - tap_bytes0
        loss, draft = self._reduce_scalars()
        self._saved = self._mbs = None
        return StepResult(loss, draft, self._p2p_bytes, tap_bytes)

    @torch.no_grad()
    def forward(self, microbatches, out_fn: Callable) -> list:
        """The forwards alone, no gradient, no taps, no draft: F(0) .. F(M-1) in order, AFAB's first half and its
        point-to-point plan. The last stage returns [out_fn(logits (T, V) or final hidden (T, H), mb)] per microbatch,
        every other stage []. What an update reads before it moves the weights (pi_old) comes from here: the same
        stages, attention and LM head as step()'s forward."""
        mbs = list(microbatches)
        if not mbs:
            raise ValueError("microbatches: got M=0; a forward needs M >= 1")
        self._mbs, self._saved, self._p2p_bytes = mbs, {}, 0
        acts = [("F", m) for m in range(len(mbs))]
        plan = p2p_plan(acts, self.grid.pp_rank, self.grid.pp)
        pending, outs = self._exchange(plan[0], None), []
        for i, (_, m) in enumerate(acts):
            got = pending.wait()  # sync point: this microbatch's activations are here
            mb = self._mbs[m]
            x = mb.tokens if self.first else got
            out = self.stage(x, mb.cu_seqlens, mb.position_ids, attn_fn=self.attn_fn, logits=self.logits)
            if self.last:
                outs.append(out_fn(out.logits if self.logits else out.hidden, mb))
            pending = self._exchange(plan[i + 1], None if self.last else out.hidden)
        pending.wait()
        self._mbs = self._saved = None
        return outs

    def _forward(self, m: int, got):
        """F(m); returns the stage output to send on (None on the last stage)."""
        mb = self._mbs[m]
        if self.last:
            self._post_taps(m)  # no source waits on this stage to send m's taps: a device sync here completes
        x = mb.tokens if self.first else self._input(m, got)
        out = self.stage(x, mb.cu_seqlens, mb.position_ids, attn_fn=self.attn_fn,
                         tap_layers=self.local_taps if self._draft_hook is not None else (), logits=self.logits)
        if not self.last:
            self._saved[m] = (x, out.hidden)
            return out
        loss = self._loss_fn(out.logits if self.logits else out.hidden, mb)
        if self._draft_hook is not None:
            taps = self._gather_taps(m, out)
            logits = out.logits.detach() if self.logits else None
            d = self._draft_hook(DraftInputs(m, taps, out.hidden.detach(), logits, mb))
            if d is not None:
                d.backward()  # the draft's backward, now: its inputs are detached, so it never leaves this stage
                self._draft = self._draft + d.detach().double()
            self._release_taps(m)
        self._saved[m] = (x, loss)
        self._loss = self._loss + loss.detach().double()
        return None

    def _backward(self, m: int, grad):
        """B(m); returns dL/d(input) to send back (None on stage 0)."""
        x, y = self._saved.pop(m)
        if self.last:
            y.backward()  # y = loss_m
        else:
            torch.autograd.backward(y, grad_tensors=grad)
        return None if self.first else x.grad

    # -- transports: what a microbatch's activation and taps travel as. The activation goes in the schedule's batches
    # -- on the pipeline group, the taps on TapChannel: the methods below are the only places that say so ------------
    def _exchange(self, ops, payload) -> "_Batch":
        """Issue one plan entry as one batch_isend_irecv: `payload` for its send, a fresh buffer for its receive."""
        p2p, buf = [], None
        labels = [f"pipeline {op} of {_NAMES[what]} for microbatch {m} {'to' if op == 'send' else 'from'} stage {peer}"
                  for op, what, m, peer in ops]
        for op, what, m, peer in ops:
            if op == "send":
                t = payload.detach().contiguous()
                p2p.append(dist.P2POp(dist.isend, t, self.grid.pp_ranks[peer], self.grid.pp_group))
                self._p2p_bytes += t.numel() * t.element_size()
            else:
                shape = self._recv_shape(m) if what == "act" else self._saved[m][1].shape
                buf = torch.empty(shape, dtype=self.dtype, device=self.device)
                p2p.append(dist.P2POp(dist.irecv, buf, self.grid.pp_ranks[peer], self.grid.pp_group))
        backend = backend_of(self.grid.pp_group, p2p[0].tensor) if p2p else None
        return _Batch(dist.batch_isend_irecv(p2p) if p2p else [], p2p, buf, labels, backend)

    def _recv_shape(self, m: int):
        return self._mbs[m].tokens.shape[0], self.H

    def _input(self, m: int, buf: torch.Tensor) -> torch.Tensor:
        return buf.requires_grad_()

    def _payload(self, m: int, out) -> torch.Tensor:
        return out.hidden

    def _send_taps(self, m: int, out):
        if self._chan is not None:
            self.channel.send(m, out.taps)

    def _post_taps(self, m: int):
        if self._chan is not None:
            self.channel.post(m)

    def _gather_taps(self, m: int, out) -> dict:
        if self._chan is None:
            return {layer: t.detach() for layer, t in sorted(out.taps.items())}
        return self.channel.recv(m, out.taps)  # waits only for m's taps

    def _release_taps(self, m: int):
        if self._chan is not None:
            self.channel.release(m)

    # -- reductions ------------------------------------------------------------------------------------------------
    def _params(self):
        return list(self.stage.parameters()) + self.draft_params

    def _reduce_grads(self):
        """Reduces each parameter's gradient: its fp32 .main_grad under mixed precision (mixed_precision.py), else
        its .grad; with a stage_reducer, the stage's through it (ZeRO-1: reduce-scattered) and the drafts' here."""
        g, params = self.grid, self._params()
        for prm in params:
            if prm.grad is None and not hasattr(prm, "main_grad"):  # e.g. a draft not called this step: zeros
                prm.grad = torch.zeros_like(prm)
        grad = lambda prm: getattr(prm, "main_grad", prm.grad)  # noqa: E731
        if g.pp > 1 and self.stage.cfg.tie_word_embeddings and (self.first or self.last):
            dist.all_reduce(grad(self.stage.embed.weight), group=g.embed_group)  # E is used on stage 0 and as W_out
        if self.stage_reducer is not None and (g.cp > 1 or g.dp > 1):
            self.stage_reducer(g.dp)  # each rank gets only its slice of the stage's summed gradient
            params = self.draft_params
        if g.cp > 1 or g.dp > 1:  # in buckets of REDUCE_BUCKET_MIB: a few collectives, never a copy of every grad
            for bucket in grad_buckets([grad(prm) for prm in params], REDUCE_BUCKET_MIB):
                flat = torch.cat([t.reshape(-1) for t in bucket]) if len(bucket) > 1 else bucket[0].view(-1)
                if g.cp > 1:
                    dist.all_reduce(flat, group=g.cp_group)  # sum: each CP rank holds d(its shard's loss)
                if g.dp > 1:
                    dist.all_reduce(flat, group=g.dp_group)
                    flat /= g.dp  # mean over replicas
                if len(bucket) > 1:  # a lone gradient was reduced in place
                    i = 0
                    for t in bucket:
                        t.copy_(flat[i:i + t.numel()].view_as(t))
                        i += t.numel()

    def _reduce_scalars(self):
        g = self.grid
        t = torch.stack([self._loss, self._draft])  # meaningful on the last stage, zeros elsewhere
        if g.cp > 1:
            dist.all_reduce(t, group=g.cp_group)
        if g.dp > 1:
            dist.all_reduce(t, group=g.dp_group)
            t /= g.dp
        if g.pp > 1:
            dist.broadcast(t, src=g.pp_ranks[-1], group=g.pp_group)
        return float(t[0]), float(t[1])


# ------------------------------------------------------------------------------------------------------------- demo
def _demo():
    import os

    from model import default_tap_layers
    from parallel.cli import parser
    ap = parser(__doc__, __file__)
    ap.add_argument("--pp", type=int, default=1, help="pipeline stages (default: %(default)s)")
    ap.add_argument("--cp", type=int, default=1, help="CP ranks per stage; dp = world / (pp * cp) "
                                                          "(default: %(default)s)")
    ap.add_argument("--schedule", choices=SCHEDULES, default="1f1b", help="(default: %(default)s)")
    ap.add_argument("--microbatches", type=int, default=4, help="M per step (default: %(default)s)")
    args = ap.parse_args()
    if "WORLD_SIZE" in os.environ:
        dist.init_process_group("gloo")
    world = dist.get_world_size() if dist.is_initialized() else 1
    grid = Grid.build(pp=args.pp, cp=args.cp, dp=world // (args.pp * args.cp))
    torch.manual_seed(0)
    cfg = ModelConfig.preset("tiny", num_hidden_layers=8, tie_word_embeddings=True)
    full = Transformer(cfg).double()
    split = split_layers(cfg.num_hidden_layers, grid.pp)
    stage = build_stage(cfg, split[grid.pp_rank], full.state_dict(), torch.float64)
    taps = default_tap_layers(cfg.num_hidden_layers) + (EMBED_TAP,)
    mbs_full = [_random_microbatch(cfg, g) for g in range(args.microbatches)]  # same seed on every rank
    mbs = [shard_for_cp(mb, grid.cp, grid.cp_rank, {"labels": -100}) for mb in mbs_full]
    n_tok = sum(mb.extra["n"] for mb in mbs_full)

    def loss_fn(logits, mb):  # next-token cross-entropy, normalised by the step's token count
        return torch.nn.functional.cross_entropy(logits, mb.extra["labels"], ignore_index=-100,
                                                 reduction="sum") / n_tok

    def draft_hook(d: DraftInputs):  # stand-in for the EAGLE-3 TTT loss: just checks what arrived
        assert sorted(d.taps) == sorted(taps) and all(t.shape == d.hidden.shape for t in d.taps.values())
        return None

    sched = PipelineSchedule(stage, grid, split, schedule=args.schedule, tap_layers=taps)
    res = sched.step(mbs, loss_fn, draft_hook)
    ref = sum(loss_fn(full(mb.tokens, mb.cu_seqlens).logits, mb) for mb in mbs_full)  # the 1-process model
    ref.backward()
    want = dict(full.named_parameters())
    err = torch.tensor([max(float((p.grad - want[k].grad).abs().max()) for k, p in stage.named_parameters())])
    if dist.is_initialized():
        dist.all_reduce(err, op=dist.ReduceOp.MAX)
    if (dist.get_rank() if dist.is_initialized() else 0) == 0:
        print(f"pp={grid.pp} cp={grid.cp} dp={grid.dp} {args.schedule} M={len(mbs)}: loss {res.loss:.12f} "
              f"(1 process: {float(ref.detach()):.12f}), max |grad - 1-process grad| {float(err):.1e}; "
              f"bytes sent by rank 0: pipeline {res.p2p_bytes}, taps {res.tap_bytes}")
    if dist.is_initialized():
        dist.destroy_process_group()


def _random_microbatch(cfg, seed: int) -> Microbatch:
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(3, 12, (3,), generator=g)
    cu = cu_seqlens_from_lengths(lens)
    tokens = torch.randint(cfg.vocab_size, (int(cu[-1]),), generator=g)
    labels = torch.roll(tokens, -1).clone()
    labels[cu[1:].long() - 1] = -100  # no target past a sequence's end
    return Microbatch(tokens, cu, None, {"labels": labels, "n": int((labels >= 0).sum())})


if __name__ == "__main__":
    _demo()
