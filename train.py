"""GRPO on speculative rollouts with an online co-trained draft (any family: EAGLE-3, DFlash, DSpark) -- the
experiment, in one process or many.

Each RL step: sample G responses for each of n prompts with speculative decoding (policy + co-trained draft; lossless,
so they are exact policy samples), score them (tasks/), compute group advantages, then `updates` optimisation steps,
each a dist_step.DistCotrainer.step (harness/update.py): ONE policy forward per micro-batch whose log-probs feed
GRPO and whose taps feed every draft's loss -- on the 1 x 1 x 1 mesh in one process, the same code as on a larger
mesh (tests/reference_step.py is the one-process oracle it equals, tests/test_dist_step.py). Every `eval_every`
steps, on the same held-out prompts, measure the acceptance length of (a) the co-trained draft, (b) a frozen copy of
the warm-up draft, (c) the warm-up draft trained as much offline on fresh pi_0 samples (--offline_arm) and (d) a
draft co-trained from a cold start (--cold_arm), and the rollout tokens/s with and without speculation
(harness/eval_arms.py). Before RL: SFT warm-up of the policy and offline warm-up of the draft (harness/warmup.py,
cached in cache/ for reruns).

    python train.py                # the default experiment: 30 steps
    python train.py --preset smoke           # every code path at a small size
    python train.py --cold_start             # the rollout draft starts untrained and is only co-trained online
    python train.py --no_spec --out runs/plain               # plain GRPO: autoregressive rollouts, no draft; then
    python -m harness.report runs/default --baseline runs/plain   # the e2e step measured against it (harness/e2e.py)
    python train.py --draft_every=4          # the draft-training budget: the drafts train on every 4th update
    python train.py --steps=40 --lr=2e-4 --out runs/mine      # any Config field as --key=value or --key value
    python train.py --model PATH --data prompts.jsonl         # HF mode: an HF checkpoint (Llama / Qwen2 / Qwen3 with
                                                              # its tokenizer.json), {"prompt", "answer"} lines,
                                                              # math reward

Writes to --out (default runs/<name>): metrics.jsonl (one line per step, "kind": "train" | "eval"), summary.json,
train.png (harness/plots.py); with --ckpt_every=N also <out>/ckpt/step_* (checkpoints/checkpoint.py), and --resume
continues the latest.

One loop for every world size. One process is a 1 x 1 x 1 mesh; under torchrun (WORLD_SIZE > 1) the same loop runs on a
DP x PP x CP mesh (--pp, --cp, --dp; default pp=2, cp=2), and the mode shows only where the mesh is made
(harness/mesh.py). Each step: rollout (every rank generates its blocks of rows with a full policy + draft copy;
harness/rollout.py) -> gather (every rank gets the whole batch) -> update (GRPO + co-training through the pipeline with
CP inside each stage and the draft's loss on the last stage; harness/update.py, dist_step.py) -> refit (the full
copies) -> eval (every rank its blocks; harness/eval_arms.py) / log (rank 0; harness/report.py) -> checkpoint
(checkpoints/resume.py). Models
live on each rank's own GPU when CUDA is present (--device=auto; mesh.pick_device), else on the CPU. Before any work,
each rank plans its memory on its device (harness/fit_check.py): a run that does not fit stops in one line naming the
flags that make it fit.

    torchrun --standalone --nproc_per_node=4 train.py                         # the default run on pp=2 x cp=2
    torchrun --standalone --nproc_per_node=4 train.py --draft runs/default/draft   # start from a served EAGLE-3 draft

Rollouts, evals and the offline arm's sampling run on every rank (blocks of --rollout_batch rows each), and so do the
warm-ups on GPUs (harness/warmup_split.py). What one rank runs while the others wait in a collective, bounded by
--dist_timeout (s; a dead rank fails the job instead of hanging it), is: at startup on the CPU rank 0's warm-ups when
they are not cached (policy SFT, then the draft warm-up -- none with --draft PATH, which starts from an exported
EAGLE-3 draft; a rerun loads both from cache/), and per step the offline arm's
training and rank 0's checkpoint / servable writes. Size --dist_timeout above the longest of these: the warm-ups'
time (their cost scales with --sft_steps x --sft_batch and --draft_warmup_steps x --draft_warmup_batch forwards of
the policy) with a margin; or run the warm-ups once alone (`python -m harness.warmup` with the same flags) so the
distributed job finds them cached.
    torchrun --standalone --nproc_per_node=4 train.py --preset smoke          # every code path, pp=2 x cp=2
    torchrun --standalone --nproc_per_node=4 train.py --pp=1 --cp=2 --dp=2 --micro_batches=2
"""
from __future__ import annotations

import dataclasses
import json
import os
import sys
import time
import warnings

import torch

from harness.config import Config, parse_args
from harness.engine_rollout import ENGINE_GAP_TOL, start_engine
from harness.eval_arms import evaluate
from harness.experiment import build
from harness.fit_check import fit
from serving.engine_check import acceptance_gap
from serving.export import write_servables
from harness.mesh import make_mesh
from harness.report import HEADER, Report
from checkpoints.resume import load_run, save_run
from checkpoints.resume_policy import prepare_run, start_run
from harness.rollout import rollout, rollout_draft
from harness.update import check_finite, update
from checkpoints.checkpoint import latest_checkpoint, remove_temporaries
from parallel.cli import describe, run_main


def train(cfg: Config) -> dict:
    """The experiment: setup and mesh, build, then every step rollout -> gather -> update -> refit -> eval / log ->
    checkpoint, then the summary. Returns the summary (rank 0; {} elsewhere)."""
    # ---- setup: threads, the mesh (one process: 1 x 1 x 1), what rank 0 shows and writes
    t_start = time.perf_counter()
    torch.set_num_threads(cfg.threads)
    cfg = fit(cfg)  # the memory plan on this device before any work: one line naming the flags if it does not fit
    mesh = make_mesh(cfg)
    out_dir = cfg.out or os.path.join("runs", cfg.name)
    g, say = mesh.grid, (print if mesh.main else (lambda *a, **k: None))
    # a resume continues only this run, on this mesh and inputs; a fresh run overwrites nothing (resume_policy.py).
    # Checked first, read-only: nothing in <out> changes before the build has loaded the data, model and caches
    resume_from, notes = start_run(out_dir, dataclasses.asdict(cfg), (g.pp, g.cp, g.dp), rank=mesh.rank, prepare=False)
    # ---- build: task, warm policy + reference, draft arms (warm-ups cached), this rank's pipeline stage + optimizer
    s = build(cfg, mesh, log=lambda *a, **k: say(*a, **{"flush": True, **k}))
    notes += prepare_run(out_dir, dataclasses.asdict(cfg), resume_from, rank=mesh.rank)  # now <out> may change
    rep = Report(cfg, out_dir, main=mesh.main)
    for note in notes:
        rep.print(note)
    rep.print(mesh.describe() + f", {cfg.schedule} over layers {s.cotrainer.split}" * (mesh.world > 1))
    ckpt_dir, start = os.path.join(out_dir, "ckpt"), 0
    if resume_from is not None:
        start, records = load_run(s, mesh, resume_from)
        rep.restore(records)
        rep.print(f"resume: from step {start} ({resume_from})")
    if cfg.rollout_engine == "vllm":  # rollouts from vLLM, refit every step (harness/engine_rollout.py)
        if mesh.world != 1:
            raise ValueError(f"--rollout_engine vllm: one process only (world size 1), got {mesh.world}")
        s.engine = start_engine(s, out_dir, rep.print)

    def do_eval(step: int, kl: float) -> tuple:  # every rank evaluates its blocks; rank 0 pools them
        t0 = time.perf_counter()
        ev = evaluate(s, mesh)
        ev = {"kind": "eval", "step": step, "kl": kl, **ev} if mesh.main else None
        return ev, time.perf_counter() - t0

    rep.print(f"config: {json.dumps(dataclasses.asdict(cfg))}")
    ev, t_eval = do_eval(0, 0.0) if start == 0 else (None, 0.0)
    rep.eval(ev)
    rep.print(HEADER)
    for step in range(start + 1, cfg.steps + 1):
        timer = {"eval": t_eval}  # eval 0's time counts in step 1, eval k's in step k
        t0, cpu0 = time.perf_counter(), time.process_time()
        problems = s.task.sample(cfg.prompts_per_step, s.rng)  # the same prompts on every rank
        batch, info = rollout(s, mesh, problems, timer)  # every rank generates its blocks -> gather to every rank
        timer["rollout"], timer["cpu"] = time.perf_counter() - t0, {"rollout": time.process_time() - cpu0}
        up = update(s, batch, timer, step)  # `updates` GRPO + co-training steps through the pipeline, each refitted
        check_finite(step, up, s)
        if s.engine is not None and up.get("tau_hat_cotrained") is not None:  # the engine vs the trainer's tau-hat
            info["engine_gap"] = acceptance_gap(info["engine_accept"], up["tau_hat_cotrained"], ENGINE_GAP_TOL)
            if info["engine_gap"]:
                rep.print(f"step {step}: {info['engine_gap']}")
        ev, t_eval = do_eval(step, up["kl"]) if step % cfg.eval_every == 0 or step == cfg.steps else (None, 0.0)
        timer["eval"] += t_eval
        t_eval = 0.0
        rep.train({"kind": "train", "step": step, **info, **up, "time": timer})
        rep.eval(ev)
        if cfg.ckpt_every and step % cfg.ckpt_every == 0:
            save_run(s, mesh, ckpt_dir, step, rep.records())
            serve(s, mesh, out_dir, rep, step)
    serve(s, mesh, out_dir, rep, cfg.steps)
    summary = rep.finish(s.warm_info, time.perf_counter() - t_start, eval_prompts=len(s.eval_problems))
    mesh.close()
    return summary


def serve(s, mesh, out_dir: str, rep: Report, step: int):
    """<out>/policy (an HF checkpoint, with the tokenizer in HF mode) and <out>/draft (the EAGLE-3 export vLLM and
    SGLang load) from rank 0's full copies after `step`: what an inference engine would serve next, as one pair
    (export.py)."""
    if mesh.main:
        c = s.cfg
        w = write_servables(out_dir, s.policy, rollout_draft(s), c.model if c.hf_mode else None,
                            require_draft=False, step=step)
        rep.print(f"servable: {w['policy']}" + (f", {w['draft']}" if w["draft"] else f" (no draft: {w['skipped']})"))


def interrupted(cfg: Config) -> str:
    """What Ctrl-C leaves and how to go on: the last complete checkpoint and --resume, or that there is none. (Every
    artefact lands atomically -- checkpoints, policy/, draft/, cache entries -- so none is half-written.)"""
    ckpt = os.path.join(cfg.out or os.path.join("runs", cfg.name), "ckpt")
    if os.environ.get("RANK", "0") == "0":  # a save cut short leaves only its temporary directory: gone
        remove_temporaries(ckpt)
    with warnings.catch_warnings():  # a damaged checkpoint is skipped (said at --resume); the message stays one line
        warnings.simplefilter("ignore")
        last = latest_checkpoint(ckpt)
    if last is None:
        return f"interrupted; no checkpoint in {ckpt} (--ckpt_every={cfg.ckpt_every}): a rerun starts over"
    return f"interrupted; the last checkpoint is {last}: to continue, run the same command with --resume"


def main(argv=None):
    """The command line: the config (-h / --help: the flags, then exit 0), then the run; Ctrl-C says where to resume."""
    config = parse_args(sys.argv[1:] if argv is None else argv, usage=describe(__doc__, __file__))
    try:
        train(config)
    except KeyboardInterrupt:
        raise KeyboardInterrupt(interrupted(config)) from None


if __name__ == "__main__":
    # one line for every failure, exit 1 (a refused --out / --resume, bad input, a full or read-only disk, a NaN loss,
    # a stopped or dead peer: "rank r: <the wait> timed out after N s"); Ctrl-C: exit 130; COSPEC_TRACEBACK=1: more
    run_main(main, __file__)
