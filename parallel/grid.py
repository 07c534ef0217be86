"""The DP x PP x CP process grid, built once, and the warm-up that creates every communicator in one global order.
(mesh.py decides where this process sits and builds the grid; pipeline.py re-exports Grid.)

    rank = (dp_rank * pp + pp_rank) * cp + cp_rank          (CP neighbours are adjacent ranks: the fastest links)

Groups, in creation order: pp (each pipeline: the schedule's batched P2P), tap (the same members: TapChannel's single
P2P, whose pair communicators alone are made), embed (first + last stage: tied embeddings only), cp, dp, and -- where
dp > 1 and cp > 1 -- shard (the DP x CP ranks of a stage, over which ZeRO-1 shards its optimizer state; otherwise the
cp or dp group is that set). A group of one rank is None and its collectives are skipped.

Why a warm-up (the NCCL rules nccl_check.py simulates): NCCL creates a communicator lazily, on first use, and blocks
until every member has joined -- the group's communicator for collectives and batched P2P, one per (group, pair) for a
single isend/irecv. Left lazy, the last stage of a pipeline first touches TapChannel's pair (its tap irecvs are posted
as its F(m) starts) while stage 0 first touches the pipeline group (its first activation send): each waits for the
other to join. warm_up_links creates them all up front, in one order shared by every rank. gloo connects at new_group,
so on CPU it costs a few tiny messages.

    grid = Grid.build(pp=2, cp=2, dp=1, device=dev)   # under torchrun, after init_process_group; warms up on `dev`

Letters: pp / cp / dp the mesh sizes, s a stage, c a CP rank, d a DP replica.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch
import torch.distributed as dist

from parallel.waits import backend_of, timeout


def mesh_groups(pp: int, cp: int, dp: int, tied: bool = True) -> list:
    """Every process group of the DP x PP x CP mesh, [(name, ranks)], in the one order that every rank creates them
    (new_group is collective over the world) and the warm-up touches them. Groups of one rank are left out, and the
    embedding group where the policy's LM head is not tied to its embedding (tied False: nothing to sum)."""
    at = lambda d_, p_, c_: (d_ * pp + p_) * cp + c_  # noqa: E731
    pipes = [[at(d_, s, c_) for s in range(pp)] for d_ in range(dp) for c_ in range(cp)]
    lists = [("pp", pipes), ("tap", pipes), ("embed", [[r[0], r[-1]] for r in pipes] if pp > 1 and tied else []),
             ("cp", [[at(d_, p_, c_) for c_ in range(cp)] for d_ in range(dp) for p_ in range(pp)]),
             ("dp", [[at(d_, p_, c_) for d_ in range(dp)] for p_ in range(pp) for c_ in range(cp)]),
             # the DP x CP ranks of one stage (ZeRO-1's shards); only when neither the cp nor the dp group is it
             ("shard", [[at(d_, p_, c_) for d_ in range(dp) for c_ in range(cp)] for p_ in range(pp)]
              if dp > 1 and cp > 1 else [])]
    return [(name, list(ranks)) for name, rank_lists in lists for ranks in rank_lists if len(ranks) > 1]


def warm_up_plan(pp: int, cp: int, dp: int, tied: bool = True) -> list:
    """What warm_up_links touches, in order: ("coll", name, ranks) for the world and every group but TapChannel's (one
    all_reduce: the group's communicator), then ("link", "tap", (a, b)) for every TapChannel link, source stage a ->
    last stage b (one send/recv: the pair's own communicator, which NCCL creates for single, unbatched P2P).
    TapChannel's group only ever carries single sends and receives, so its collective communicator is never made:
    it would hold NCCL's buffers for nothing."""
    world = pp * cp * dp
    groups = mesh_groups(pp, cp, dp, tied)
    plan = [("coll", "world", list(range(world)))] if world > 1 else []
    plan += [("coll", name, ranks) for name, ranks in groups if name != "tap"]
    plan += [("link", "tap", (ranks[s], ranks[-1])) for name, ranks in groups if name == "tap"
             for s in range(len(ranks) - 1)]
    return plan


@dataclass
class Grid:
    """The DP x PP x CP process layout, built once: rank = (dp_rank * pp + pp_rank) * cp + cp_rank (CP neighbours are
    adjacent ranks, the highest-bandwidth links). A group of size 1 is None and its collectives are skipped."""
    pp: int = 1
    cp: int = 1
    dp: int = 1
    pp_rank: int = 0
    cp_rank: int = 0
    dp_rank: int = 0
    pp_ranks: list = field(default_factory=lambda: [0])  # global rank of each stage of my pipeline
    pp_group: Optional[object] = None  # my pipeline: the schedule's P2P (always batched: one communicator)
    tap_group: Optional[object] = None  # same members, a second communicator: TapChannel only
    embed_group: Optional[object] = None  # first + last stage of my pipeline (tied embeddings)
    cp_group: Optional[object] = None
    dp_group: Optional[object] = None
    shard_group: Optional[object] = None  # dp > 1 and cp > 1: the DP x CP ranks of my stage; read `stage_group`
    handles: dict = field(default_factory=dict)  # (name, tuple(ranks)) -> process group, for my groups
    tied: bool = True  # the policy's LM head is its embedding: the embedding group exists (pp > 1)

    @property
    def stage_group(self):
        """Every rank holding my pipeline stage (dp x cp of them, ordered dp_rank * cp + cp_rank): ZeRO-1 shards the
        stage's optimizer state over it. It is the cp group when dp = 1, the dp group when cp = 1."""
        return self.shard_group if self.dp > 1 and self.cp > 1 else (self.cp_group if self.dp == 1 else self.dp_group)

    @classmethod
    def build(cls, pp: int = 1, cp: int = 1, dp: int = 1, warm_up: bool = True, device=None,
              tied: bool = True) -> "Grid":
        """warm_up: create every communicator now, in one global order (warm_up_links), for tensors on `device` (the
        models' device: with a "cpu:gloo,cuda:nccl" process group that picks the backend). Needed on NCCL, cheap on
        gloo. Turn it off only to study what happens without it. tied: the policy's LM head is its embedding (False:
        no embedding group)."""
        if min(pp, cp, dp) < 1:
            raise ValueError(f"pp={pp}, cp={cp}, dp={dp}: expected each >= 1")
        world = dist.get_world_size() if dist.is_initialized() else 1
        if pp * cp * dp != world:
            raise ValueError(f"pp={pp} x cp={cp} x dp={dp} = {pp * cp * dp} != world size {world}")
        rank = dist.get_rank() if dist.is_initialized() else 0
        d, rest = divmod(rank, pp * cp)
        p, c = divmod(rest, cp)
        g = cls(pp, cp, dp, p, c, d, [(d * pp + s) * cp + c for s in range(pp)], tied=tied)
        for name, ranks in mesh_groups(pp, cp, dp, tied):  # collective: every rank creates every group, in order
            pg = dist.new_group(ranks, timeout=timeout())  # not init_process_group's: new_group defaults to 30 min
            if rank in ranks:
                g.handles[(name, tuple(ranks))] = pg
                setattr(g, f"{name}_group", pg)
        if warm_up and world > 1:
            warm_up_links(g, device)
        return g


def warm_up_links(grid: Grid, device=None) -> None:
    """Touch every communicator this rank will use, in warm_up_plan's global order, so that none is created lazily
    mid-step. Why: NCCL creates a communicator on its first use and blocks until every member joins (the group's for
    collectives and batched P2P, one per (group, pair) for a single isend/irecv); two ranks that first touch two
    communicators in opposite orders wait for each other forever. In one global order the earliest unfinished entry
    always has all its members waiting on it, so every entry completes. gloo connects at new_group: a no-op there
    in effect (a few tiny messages). device: where the step's tensors live, which picks the backend of a mixed
    process group (default: the current GPU where the default group runs CUDA tensors on NCCL -- a "nccl" or a
    "cpu:gloo,cuda:nccl" group -- else the CPU)."""
    if device is None:
        on_nccl = torch.cuda.is_available() and backend_of(None, "cuda") == "nccl"
        device = torch.device("cuda", torch.cuda.current_device()) if on_nccl else "cpu"
    rank, x = dist.get_rank(), torch.zeros(1, device=device)
    for kind, name, ranks in warm_up_plan(grid.pp, grid.cp, grid.dp, grid.tied):
        if kind == "coll" and rank in ranks:
            dist.all_reduce(x, group=None if name == "world" else grid.handles[(name, tuple(ranks))])
        elif kind == "link" and rank in ranks:
            a, b = ranks  # my pipeline's tap group: a single send/recv creates the pair's communicator
            (dist.send if rank == a else dist.recv)(x, b if rank == a else a, group=getattr(grid, f"{name}_group"))
