"""train.py under torchrun: the DP x PP x CP mesh, distributed rollouts and update, and checkpoints.

Every DP replica generates its share of the prompts with a full policy + draft copy (one rank per replica), the whole
batch is shared, the update runs through the pipeline with CP inside each stage (dist_step.DistCotrainer), and every
rank refits its full copy afterwards. Checkpoints (checkpoint.py) hold each rank's stage, optimizers, drafts and RNG.

    torchrun --standalone --nproc_per_node=4 train.py --preset smoke     # pp=2 x cp=2 on CPU (gloo)
"""
from __future__ import annotations

import dataclasses
import os
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from experiment import Setup, _update_stats, build, pick_device, rollout
from attention_padded import padded_causal_attention
from rl_loop import RolloutBatch, reference_logp, rollout_kl

if TYPE_CHECKING:
    from config import Config


# ---------------------------------------------------------------------------------------- distributed (torchrun)
@dataclass
class Dist:
    """This process's place in the DP x PP x CP mesh (pipeline.Grid, built once) and its share of the update."""
    grid: object  # pipeline.Grid
    rank: int
    world: int
    cotrainer: object = None  # dist_step.DistCotrainer
    perm_gen: object = None  # the minibatch permutation: same seed on every rank (rollout RNG differs per replica)


def init_distributed(cfg: Config) -> Dist:
    """torchrun's env contract (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR/PORT) -> process group and mesh.

    Backend: gloo for CPU tensors, NCCL for CUDA tensors when a GPU is present; the models live on
    experiment.pick_device(cfg) (this rank's GPU, or the CPU). Every collective waits at most cfg.dist_timeout s, so a
    dead rank makes its peers fail instead of hang."""
    import datetime

    from pipeline import Grid
    world = int(os.environ["WORLD_SIZE"])
    dp = cfg.dp or world // (cfg.pp * cfg.cp)
    if cfg.pp * cfg.cp * dp != world:
        raise ValueError(f"mesh: pp={cfg.pp} x cp={cfg.cp} x dp={dp} = {cfg.pp * cfg.cp * dp} != world size {world} "
                         f"(torchrun processes); set --pp, --cp, --dp so that their product is {world}")
    if cfg.micro_batches < dp or cfg.prompts_per_step < dp:
        raise ValueError(f"dp={dp}: needs micro_batches >= dp and prompts_per_step >= dp (got {cfg.micro_batches}, "
                         f"{cfg.prompts_per_step}): every DP replica takes whole micro-batches and whole prompt groups")
    backend = "cpu:gloo,cuda:nccl" if torch.cuda.is_available() else "gloo"
    dev = pick_device(cfg)
    if dev.type == "cuda":  # NCCL wants the process's current device set before its first collective
        torch.cuda.set_device(dev)
    dist.init_process_group(backend, timeout=datetime.timedelta(seconds=cfg.dist_timeout))
    grid = Grid.build(pp=cfg.pp, cp=cfg.cp, dp=dp)
    return Dist(grid, dist.get_rank(), world, perm_gen=torch.Generator().manual_seed(cfg.seed + 31))


def build_distributed(cfg: Config, d: Dist, log=print) -> Setup:
    """build() on every rank -- rank 0 first, so it alone trains and caches the warm-ups and the others load them --
    then this rank's pipeline stage and optimizer (dist_step.DistCotrainer)."""
    from dist_step import DistCotrainer
    s = build(cfg, log) if d.rank == 0 else None
    dist.barrier()
    s = s or build(cfg, log=lambda *a, **k: None)
    s.gen.manual_seed(cfg.seed + 1000 * d.grid.dp_rank)  # each DP replica samples its own rollouts
    d.cotrainer = DistCotrainer(
        s.policy, list(s.drafts.values()), d.grid,
        lambda ps: torch.optim.AdamW(ps, lr=cfg.lr, weight_decay=0.0, betas=(0.9, 0.99)),
        grad_clip=cfg.grad_clip, schedule=cfg.schedule, attn_fn=padded_causal_attention)
    return s


def concat_batches(parts: list) -> RolloutBatch:
    lens = torch.cat([b.cu_seqlens[1:] - b.cu_seqlens[:-1] for b in parts])
    cu = torch.zeros(lens.numel() + 1, dtype=torch.int32)
    cu[1:] = lens.cumsum(0)
    cat = lambda k: torch.cat([getattr(b, k) for b in parts])  # noqa: E731
    return RolloutBatch(cat("tokens"), cu, cat("resp_mask"), cat("old_logp"), cat("adv"), cat("valid"),
                        cat("ref_logp"))


def rollout_distributed(s: Setup, d: Dist, problems: list) -> tuple[RolloutBatch, dict]:
    """DP replica r generates problems[r::dp] on ONE of its ranks (PP stage 0, CP rank 0) with its full policy + draft
    copy, adds the reference log-probs, and every rank receives the whole batch (GRPO groups stay whole)."""
    g = d.grid
    part = None
    if g.pp_rank == 0 and g.cp_rank == 0:
        batch, info = rollout(s, problems[g.dp_rank::g.dp])
        batch.ref_logp = reference_logp(s.ref, batch, attn_fn=padded_causal_attention)
        part = (g.dp_rank, batch, info)
    parts = [None] * d.world
    dist.all_gather_object(parts, part)  # sync point: tokens and per-token floats only, small next to the weights
    parts = sorted((p for p in parts if p is not None), key=lambda p: p[0])
    info = {k: sum(p[2][k] for p in parts) / len(parts) for k in parts[0][2]}
    info["zero_var_groups"] = sum(p[2]["zero_var_groups"] for p in parts)
    return concat_batches([p[1] for p in parts]), info


def update_distributed(s: Setup, d: Dist, batch: RolloutBatch, timer: dict) -> dict:
    """update() through the pipeline: cfg.updates steps of dist_step.DistCotrainer, each followed by a refit of the
    full policy + drafts (the drafts embed with the policy's embedding; the rollouts need the new weights).
    Policy and draft share one pipeline step, so all of it is timed as policy_train."""
    t0 = time.perf_counter()
    kl = rollout_kl(batch)
    perm = torch.randperm(batch.num_seqs, generator=d.perm_gen)
    stats = []
    for idx in perm.chunk(s.cfg.updates):
        stats.append(d.cotrainer.step(batch.select(idx.sort().values), s.grpo, s.cfg.micro_batches))
        d.cotrainer.refit(s.policy)
    timer["policy_train"] += time.perf_counter() - t0
    return _update_stats(s, stats, kl)


# ---------------------------------------------------------------------------------------------------- checkpoints
def _ckpt_parts(s: Setup, d) -> tuple[dict, dict]:
    """(this rank's state dicts by name, its named generators). Under torchrun a rank saves its pipeline stage and
    the stage's optimizer (the full rollout copy is re-assembled by refit) and the drafts (every rank holds them)."""
    states = {"policy": s.policy, "policy_opt": s.opt} if d is None else {"policy": d.cotrainer.stage,
                                                                      "policy_opt": d.cotrainer.opt}
    for name, tr in s.drafts.items():
        states[f"draft_{name}"], states[f"draft_opt_{name}"] = tr.draft, tr.opt
    gens = {"rollout": s.gen} if d is None else {"rollout": s.gen, "perm": d.perm_gen}
    return states, gens


def save_ckpt(s: Setup, d, folder: str, step: int, records: list):
    from checkpoint import capture_rng, save_checkpoint
    objs, gens = _ckpt_parts(s, d)
    states = {k: o.state_dict() for k, o in objs.items()}
    states["loop"] = {"source_rng": s.rng.getstate()}  # the prompt sampler (a python Random of its own)
    save_checkpoint(folder, step, states=states, rng=capture_rng(gens), metrics=records,
                    extra=dataclasses.asdict(s.cfg), rank=0 if d is None else d.rank, world=1 if d is None else d.world,
                    barrier=None if d is None else dist.barrier)


def load_ckpt(s: Setup, d, folder: str):
    """-> (steps done, metric records) from the latest valid checkpoint in folder (corrupt ones skipped with a
    warning), or (0, []) when there is none."""
    from checkpoint import latest_checkpoint, load_checkpoint, restore_rng
    path = latest_checkpoint(folder)
    if d is not None:  # every rank must resume from the same step (rank 0 decides)
        box = [None if path is None else str(path)]
        dist.broadcast_object_list(box, src=0)
        path = box[0]
    if path is None:
        return 0, []
    c = load_checkpoint(path, 0 if d is None else d.rank)
    objs, gens = _ckpt_parts(s, d)
    for k, o in objs.items():
        o.load_state_dict(c["states"][k])
    s.rng.setstate(c["states"]["loop"]["source_rng"])
    restore_rng(c["rng"], gens)
    if d is not None:
        d.cotrainer.refit(s.policy)
    return c["step"], c["metrics"]
