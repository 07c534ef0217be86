"""TapChannel: carry the policy's feature taps from the pipeline stages that produce them to the draft on the last
stage, over a path of their own, without touching the pipeline schedule.

EAGLE-3 reads the hidden states after a low, a middle and a high layer plus the input embeddings ("taps"). Under
pipeline parallelism those layers live on different stages and the draft lives whole on the last one. Three ways to
get tap h_l(m) of microbatch m from stage s to the last stage:

  1. blocking send inside F(m), on the pipeline's own communicator. Its messages interleave with the schedule's, so
     the order of the two streams must agree on every rank or the pipeline deadlocks (e.g. a tap send placed before
     the activation send: stage 0 waits for the last stage's recv, which waits for the activation stage 0 has not sent
     yet). Placed after the activation send it runs, but stage s stalls in every F(m) until the last stage reaches
     F(m), and the 1F1B warm-up no longer fills the pipe.
  2. piggyback: concatenate the taps onto the activation sent stage to stage. Every hop after s carries h_l(m), on the
     critical path of the schedule: hop s -> s+1 moves (1 + taps produced on stages <= s) * T*H numbers.
  3. TapChannel (this file): a process group of its own (gloo: its own connections; NCCL: its own communicator and
     stream), so no tap message is ever matched against, or queued behind, a schedule message. Each tap crosses once,
     straight from the stage that made it to the last stage:
       source, right after F(m):   isend(h_l(m).detach())     for each tap l it owns; never waits on it until finish()
       last stage, F(m) starts:    post(m): irecv into one landing slot per source  -- no source waits here to send m
       last stage, draft needs m:  recv(m) waits for m's messages   -- the only wait on the channel
       last stage, after the draft: release(m) frees the slot for m + 1
     Taps produced on the last stage itself are used in place. No gradient crosses stages: the draft learns from the
     policy's features, it does not train the policy.

Why it cannot deadlock: a source's isend never blocks, and a source waits on its sends only in finish(), after its
last schedule action. The last stage posts m's receives when its own F(m) starts; a source issues m's sends right
after its own F(m), with nothing between the two that waits on the last stage. On NCCL every wait is a stream wait
(parallel/waits.py: the host runs on, later calls queue behind it on the device), so the last stage's host may post
m's receives before a source's host has issued m's sends; what matters is that every posted receive's send gets
issued without this rank moving on. That is the point of posting late rather than ahead: a device-wide
synchronisation on the last stage (cudaDeviceSynchronize, or the caching allocator's retry after an out-of-memory, in
the memory-tight regime of a real run) blocks its host until every receive it has posted completes. A source's host
reaches m's sends unless it blocks first at a host or device sync of its own, and before its F(m) those wait only for
calls of microbatches the last stage has finished with before its F(m) (1F1B and AFAB alike). A receive posted for
m + depth ahead of time has its send only after the source's B(m + depth - (P - s)), which needs this stage's
gradient: a sync in between would hang until the watchdog fires. Under NCCL a send may also wait for its receive and
communicators are created lazily, so the mesh creates them all up front (grid.warm_up_links) and nccl_check.py replays
the whole step under NCCL's rules, stream-ordered waits and device syncs in every action included, for every layout.

Sources may run ahead of the last stage by up to pp_schedule.tap_depth microbatches (1F1B: min(M, P); AFAB: M); their
pending isends hold their tensors until the last stage posts the matching receive. At most one microbatch is posted
on the last stage at a time, so one landing slot per source is enough (on NCCL the receive of m + 1 into a slot
queues behind the draft's reads of m: its stream waits for the compute stream as it is issued). Receives are posted in
ascending microbatch order across all sources, which is what an in-order NCCL stream needs.

Under context parallelism the channel's group joins the same CP rank of every stage (the members of the pipeline
group, in a second communicator), so each CP rank delivers its own zigzag shard to the same CP rank of the last stage,
which holds the matching shard of the tokens.

Used by pipeline.PipelineSchedule; run `python pipeline.py` / `torchrun --nproc_per_node=4 pipeline.py --pp=4` for a
demo, `python bench/bench_tapchannel.py` to compare it with piggybacking and blocking sends.

Letters: P stages, s stage, M microbatches, m microbatch, T tokens of m on this (CP) rank, H hidden size.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from model import EMBED_TAP, check_tap_layers
from parallel.waits import backend_of, wait_all


def tap_owners(split, tap_layers) -> dict:
    """{tap layer id: stage that produces it}; split = [(a_s, b_s)] layer ranges per stage; tap -1 lives on stage 0."""
    n = split[-1][1]
    owners = {}
    for layer in check_tap_layers(tap_layers, n):
        owners[layer] = 0 if layer == EMBED_TAP else next(s for s, (a, b) in enumerate(split) if a <= layer < b)
    return owners


class TapChannel:
    """One end of the tap side channel; every stage of a pipeline builds one with the same arguments.

    group: a process group with the same members as the pipeline group (a separate communicator); stage_ranks: the
    global rank of each stage in it, stage order; stage: this rank's stage; split: [(a_s, b_s)] per stage.
    """

    def __init__(self, group, stage_ranks, stage: int, split, tap_layers):
        if len(stage_ranks) != len(split):
            raise ValueError(f"stage_ranks: {len(stage_ranks)} ranks for {len(split)} stages")
        self.group, self.ranks, self.stage = group, list(stage_ranks), int(stage)
        self.last = len(split) - 1
        owners = tap_owners(split, tap_layers)
        self.layers_of = [tuple(l for l in sorted(owners) if owners[l] == s) for s in range(len(split))]
        self.sources = [s for s in range(self.last) if self.layers_of[s]]  # stages that send (never the last)
        self._n_layers = split[-1][1]
        self.bytes_sent = 0  # this rank's tap traffic since construction
        self._sends = []  # [(work, tensor)]: a tensor must stay alive until its isend completes
        self._slots = {}  # source stage -> one flat landing buffer, reused across steps while large enough
        self._posted = {}  # microbatch -> [(layer, work, view into its landing slot)]; at most one at a time
        self._held = None  # the microbatch received and not yet released (its taps are views into the slots)

    def _tag(self, m: int, layer: int) -> int:  # gloo matches (peer, tag); NCCL ignores tags and relies on issue order
        return m * (self._n_layers + 1) + layer + 1

    # ---------------------------------------------------------------------------------------------------- source
    def send(self, m: int, taps: dict):
        """Source stage, right after F(m): post an async send of each tap this stage owns. Never waits."""
        dst = self.ranks[self.last]
        for layer in self.layers_of[self.stage]:
            t = taps[layer].detach().contiguous()  # (T, H); detached: no gradient crosses stages
            self._sends.append((dist.isend(t, dst=dst, group=self.group, tag=self._tag(m, layer)), t))
            self.bytes_sent += t.numel() * t.element_size()
        self._sends = [(w, t) for w, t in self._sends if not w.is_completed()]  # free what has left

    # ------------------------------------------------------------------------------------------------ last stage
    def begin(self, sizes, hidden_size: int, dtype, device):
        """Last stage, at the start of a step: sizes[m] = tokens of microbatch m on this rank (every stage has the
        batch's metadata). Allocates one landing slot per source (reused across steps while large enough); posts
        nothing: post(m) does, when F(m) starts."""
        if self._posted or self._held is not None:
            raise RuntimeError(f"TapChannel.begin: microbatch {sorted(self._posted) or self._held} of the last step "
                               f"never received or released")
        self._sizes, self._H, self._next = [int(t) for t in sizes], int(hidden_size), 0
        cap = max(self._sizes) * self._H
        for s in self.sources:
            need = len(self.layers_of[s]) * cap
            slot = self._slots.get(s)
            if slot is None or slot.numel() < need or slot.dtype != dtype:
                self._slots[s] = torch.empty(need, dtype=dtype, device=device)

    def post(self, m: int):
        """Last stage, as F(m) starts (no source waits on this stage to send m): post m's receives, in source and
        layer order. Microbatches are posted in order, each once the previous one is released."""
        if m != self._next or self._held is not None or self._posted:
            raise RuntimeError(f"TapChannel.post({m}): expected microbatch {self._next}, posted once the previous one "
                               f"is released (posted {sorted(self._posted)}, held {self._held})")
        T, posted = self._sizes[m], []
        n = T * self._H
        for s in self.sources:
            for i, layer in enumerate(self.layers_of[s]):
                view = self._slots[s][i * n:(i + 1) * n].view(T, self._H)  # (T, H), contiguous
                posted.append((layer, dist.irecv(view, src=self.ranks[s], group=self.group,
                                                  tag=self._tag(m, layer)), view))
        self._posted[m], self._next = posted, m + 1

    def recv(self, m: int, local_taps: dict) -> dict:
        """Last stage, when the draft needs microbatch m (after post(m)): the channel's only wait. Returns
        {layer: (T, H)} for every tap, in layer order: remote taps are views into the landing slots (valid until
        release(m); clone to keep), local ones (produced on this stage) are used in place, detached."""
        if m not in self._posted:
            raise RuntimeError(f"TapChannel.recv({m}): microbatches must be posted, then received, in order; posted "
                               f"{sorted(self._posted)}")
        taps = {layer: t.detach() for layer, t in local_taps.items()}
        for layer, work, view in self._posted.pop(m):
            src = next(s for s in self.sources if layer in self.layers_of[s])
            wait_all([work], [f"TapChannel recv of tap {layer} for microbatch {m} from stage {src}"],
                     backend_of(self.group, view))  # NCCL: the draft's stream waits; gloo: the host
            taps[layer] = view
        self._held = m
        return dict(sorted(taps.items()))

    def release(self, m: int):
        """Last stage, once the draft is done with m: the slots may take microbatch m + 1."""
        if self._held != m:
            raise RuntimeError(f"TapChannel.release({m}): the slots hold microbatch {self._held}")
        self._held = None

    # ------------------------------------------------------------------------------------------------------ both
    def finish(self):
        """End of step: wait for this rank's sends to leave (sources), check every microbatch was received (last)."""
        wait_all([w for w, _ in self._sends], [f"TapChannel send of taps to stage {self.last}"],
                 backend_of(self.group, self._sends[0][1]) if self._sends else None)
        self._sends = []
        if self._posted or self._held is not None:
            raise RuntimeError(f"TapChannel.finish: microbatch {sorted(self._posted) or self._held} was posted but "
                               f"never received or released")
