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
       last stage, at begin():      irecv into a ring of `depth` landing slots per source, microbatches 0..depth-1
       last stage, draft needs m:   recv(m) waits for m's messages   -- the only wait on the channel
       last stage, after the draft: release(m) re-posts the slot for microbatch m + depth
     Taps produced on the last stage itself are used in place. No gradient crosses stages: the draft learns from the
     policy's features, it does not train the policy.

Why it cannot deadlock: a source's isend never blocks, and a source waits on its sends only in finish(), after its
last schedule action. The last stage waits in recv(m) only after its own F(m) has started, i.e. after every stage's
F(m) ran (F(m) on stage s+1 needs stage s's activation of m), so every tap of m has been posted. All receives are
posted by the time the last stage finishes its schedule, so finish() on a source returns. That is gloo's argument;
under NCCL a send may also wait for its receive and communicators are created lazily, so the mesh creates them all up
front (grid.warm_up_links) and nccl_check.py replays the whole step under NCCL's rules for every layout.

Ring depth = microbatches in flight. Under 1F1B stage s runs F(m') only after B(m' - (P-s)), hence at most P - s
taps of a source are outstanding when the last stage is at F(m): depth = min(M, P). Under AFAB every source may
finish all M forwards first: depth = M. (A smaller ring stays correct -- the extra isends just stay pending until
their slot is re-posted, holding their buffers -- it only delays deliveries.) Receives are posted in ascending
microbatch order across all sources, which is what an in-order NCCL stream needs: the recv the draft waits for is
never queued behind a recv of a later microbatch.

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
from parallel.waits import wait_all


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
        self.bytes_sent = 0  # this rank's tap traffic since construction (the benchmark reads it)
        self._sends = []  # [(work, tensor)]: a tensor must stay alive until its isend completes
        self._slots = {}  # source stage -> [depth flat buffers], reused across steps while large enough
        self._posted = {}  # microbatch -> [(layer, work, view into its landing slot)]

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
    def begin(self, sizes, hidden_size: int, dtype, device, depth: int):
        """Last stage, at the start of a step: sizes[m] = tokens of microbatch m on this rank (every stage has the
        batch's metadata). Allocates the ring (depth slots per source) and pre-posts microbatches 0..depth-1."""
        if self._posted:
            raise RuntimeError(f"TapChannel.begin: microbatches {sorted(self._posted)} of the last step never received")
        self._sizes, self._H = [int(t) for t in sizes], int(hidden_size)
        self.depth = max(1, min(int(depth), len(self._sizes)))
        cap = max(self._sizes) * self._H
        for s in self.sources:
            need = len(self.layers_of[s]) * cap
            ring = self._slots.get(s)
            if ring is None or len(ring) < self.depth or ring[0].numel() < need or ring[0].dtype != dtype:
                self._slots[s] = [torch.empty(need, dtype=dtype, device=device) for _ in range(self.depth)]
        for m in range(self.depth):
            self._post(m)

    def _post(self, m: int):
        T, slot, posted = self._sizes[m], m % self.depth, []
        n = T * self._H
        for s in self.sources:
            buf = self._slots[s][slot]
            for i, layer in enumerate(self.layers_of[s]):
                view = buf[i * n:(i + 1) * n].view(T, self._H)  # (T, H), contiguous
                posted.append((layer, dist.irecv(view, src=self.ranks[s], group=self.group,
                                                  tag=self._tag(m, layer)), view))
        self._posted[m] = posted

    def recv(self, m: int, local_taps: dict) -> dict:
        """Last stage, when the draft needs microbatch m: the channel's only wait. Returns {layer: (T, H)} for every
        tap, in layer order: remote taps are views into m's landing slot (valid until release(m); clone to keep),
        local ones (produced on this stage) are used in place, detached."""
        if m not in self._posted or m != min(self._posted):
            raise RuntimeError(f"TapChannel.recv({m}): microbatches must be received in order; posted "
                               f"{sorted(self._posted)}")
        taps = {layer: t.detach() for layer, t in local_taps.items()}
        for layer, work, view in self._posted.pop(m):
            src = next(s for s in self.sources if layer in self.layers_of[s])
            wait_all([work], [f"TapChannel recv of tap {layer} for microbatch {m} from stage {src}"])  # sync point
            taps[layer] = view
        return dict(sorted(taps.items()))

    def release(self, m: int):
        """Last stage, once the draft is done with m: its slot takes microbatch m + depth."""
        if m + self.depth < len(self._sizes):
            self._post(m + self.depth)

    # ------------------------------------------------------------------------------------------------------ both
    def finish(self):
        """End of step: wait for this rank's sends to leave (sources), check every microbatch was received (last)."""
        wait_all([w for w, _ in self._sends], [f"TapChannel send of taps to stage {self.last}"])
        self._sends = []
        if self._posted:
            raise RuntimeError(f"TapChannel.finish: microbatches {sorted(self._posted)} were posted but never received")
