"""A run's checkpoints: what each rank saves so that `--resume` continues exactly where the run stopped.

    save_run(s, mesh, folder, step, records)    every rank writes its part (checkpoint.py: atomic, per-rank files)
    step, records = load_run(s, mesh, folder)   the latest valid checkpoint (corrupt ones skipped), or (0, [])

A rank saves its pipeline stage and the stage's optimizer (the full rollout copy is re-assembled by refit), the drafts
and their optimizers (the last stage trains them; every rank holds them after refit), the samplers' states (prompt
sampler, rollout stream, minibatch shuffle) and the metric records so far; rank 0's manifest records the content
fingerprints of the input files (inputs.py), which a resume must find unchanged. One process saves the same things: its
"stage" is the whole policy.
"""
from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

from checkpoints.checkpoint import capture_rng, load_checkpoint, restore_rng, save_checkpoint
from checkpoints.inputs import input_fingerprints

if TYPE_CHECKING:
    from harness.experiment import Setup
    from harness.mesh import Mesh


def run_parts(s: Setup) -> tuple[dict, dict]:
    """(this rank's objects with a state dict, by name; its named generators)."""
    states = {"policy": s.cotrainer.stage, "policy_opt": s.cotrainer.opt}
    for name, tr in s.drafts.items():
        states[f"draft_{name}"] = tr.draft
        if tr.opt is not None:  # only the stage that trains the drafts holds their optimizers
            states[f"draft_opt_{name}"] = tr.opt
    if s.offline is not None:  # the offline-extended control: its draft, optimizer and sample streams
        states["offline"] = s.offline
    return states, {"rollout": s.gen, "perm": s.perm_gen}


def save_run(s: Setup, mesh: Mesh, folder: str, step: int, records: list):
    objs, gens = run_parts(s)
    states = {k: o.state_dict() for k, o in objs.items()}
    states["loop"] = {"source_rng": s.rng.getstate()}  # the prompt sampler (a python Random of its own)
    g, config = mesh.grid, dataclasses.asdict(s.cfg)
    save_checkpoint(folder, step, states=states, rng=capture_rng(gens), metrics=records, config=config,
                    mesh=(g.pp, g.cp, g.dp), rank=mesh.rank, world=mesh.world,
                    barrier=mesh.barrier if mesh.world > 1 else None,
                    inputs=input_fingerprints(config) if mesh.main else None)  # the bytes --model / --data held


def load_run(s: Setup, mesh: Mesh, path) -> tuple[int, list]:
    """-> (steps done, metric records) from the checkpoint at `path` -- the one resume_policy.start_run chose and
    checked (same mesh, same config but for run length and housekeeping), the same on every rank."""
    c = load_checkpoint(path, mesh.rank)
    objs, gens = run_parts(s)
    for k, o in objs.items():
        o.load_state_dict(c["states"][k])
    s.rng.setstate(c["states"]["loop"]["source_rng"])
    restore_rng(c["rng"], gens)
    s.cotrainer.refit(s.policy)
    return c["step"], c["metrics"]
