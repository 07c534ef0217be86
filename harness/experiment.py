"""Everything a run is made of, built once: the task, the warm policy and its frozen reference, the draft arms, and
this rank's share of the update (its pipeline stage and optimizer).

    s = build(cfg, mesh)     the task; the policy (SFT'd and cached, or an HF checkpoint as is); the frozen reference
                             pi_0; the draft arms (co-trained, a frozen copy of the warm-up draft, a cold start); and
                             dist_step.DistCotrainer on the mesh (one process: the 1 x 1 x 1 mesh, the same code)

Copies are held only when used (Config.arm, Config.needs_ref). Each control arm has its flag (--frozen_arm,
--cold_arm, --offline_arm), on in the built-in experiment and off in HF mode by default. The reference pi_0 exists for
the k3 penalty (--beta > 0), the offline arm (it samples pi_0) and the KL log (--log_kl); without it a step logs no KL
(kl: null) and the update's KL term is zeros, as it is at beta = 0. --no_spec holds no draft at all: plain GRPO.

Every rank keeps a FULL policy and drafts for its rollouts (the stand-in for an inference engine); the update trains
this rank's pipeline stage, whose parameters ARE the policy's for its layers (dist_step.stage_of), and `refit` copies
the other stages' layers in. Under torchrun on GPUs every rank builds at once: the warm-ups split over the ranks
(harness/warmup_split.py; rank 0 caches them), an HF checkpoint loaded one process per node at a time (~1 host copy
per node). On the CPU rank 0 builds first, so it alone trains and caches the warm-ups with every core, and the others
then load them; pre-build them with `python -m harness.warmup <the run's flags>` so that nobody waits past
--dist_timeout.

Letters: G group size, T packed tokens.
"""
from __future__ import annotations

import copy
import random
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from tasks.protocol import Demonstrations, task_from_config
from harness import warmup
from harness.warmup import draft_spec  # what the draft warm-up reads (also the cache keys' tests)
from harness.cache_keys import PolicySpec, hf_policy_key, run_dtype
from backends.attention_padded import auto_causal_attention
from backends.fused_logprob import budget_rows
from dist_step import DistCotrainer
from harness import drafters
from harness.draft_formats import load_draft
from serving.hf_io import from_pretrained
from harness.mesh import Mesh, model_dtype
from harness.memory_model import resolve_zero1
from model import Transformer
from modeling.mixed_precision import master_optimizer
from harness.offline_arm import OfflineArm
from harness.step_timer import HookTimer
from harness.watch import DraftWatch
from rl_loop import GRPOConfig

if TYPE_CHECKING:
    from harness.config import Config


@dataclass
class Setup:
    cfg: Config
    task: object  # tasks/protocol.Task (--task's, or hf_task.HFTask): tok, sample, eval_set, encode_prompt, score, ...
    policy: torch.nn.Module  # the full policy this rank generates with (refitted after every update)
    ref: torch.nn.Module | None  # frozen pi_0 (the warm policy): KL log, k3 penalty, offline arm; None: not used
    drafts: dict  # arm name -> DraftTrainer ("cotrained" drives the rollouts; "cold" is evaluated only); {}: no_spec
    frozen: object  # the warm-up draft (drafter.py), never updated (--frozen_arm); None without the arm
    cotrainer: DistCotrainer  # this rank's pipeline stage + optimizer: the one update path at every world size
    eval_problems: list
    rng: random.Random  # the prompt sampler: the same stream on every rank
    gen: torch.Generator  # the rollouts' step seeds (each row then draws from its own stream): the same on every rank
    perm_gen: torch.Generator  # the minibatch shuffle: the same stream on every rank
    grpo: GRPOConfig
    warm_info: dict = field(default_factory=dict)
    offline: OfflineArm = None  # the offline-extended control (cfg.offline_arm): trained on fresh pi_0 samples
    adapt: object = None  # --num_draft_tokens=auto: the rollouts' k controller (decoding/adaptive_k.AdaptiveK)
    engine: object = None  # --rollout_engine vllm: the VllmEngine the rollouts come from (harness/engine_rollout.py)


def build_task(cfg: Config):
    """The task --task names, or in HF mode the prompts file with the checkpoint's tokenizer (tasks.protocol)."""
    return task_from_config(cfg)


def build_policy(cfg: Config, tsk, log=print, device=None, mesh: Mesh | None = None) -> tuple[Transformer, str, bool]:
    """-> (policy on `device` in the run's dtype, cache key, loaded): the policy SFT'd on the task's demonstrations
    (cached; a task without any: the seeded random initialisation; under torchrun trained on every rank together),
    or the HF checkpoint as is (loaded by one process per node at a time on GPUs: in_turns)."""
    dt = getattr(torch, run_dtype(cfg, device))
    if cfg.hf_mode:
        policy = in_turns(mesh, lambda: from_pretrained(cfg.model, dtype=dt, device=device),
                          "build: loading the HF checkpoint")
        key = hf_policy_key(cfg.model)
        n = sum(p.numel() for p in policy.parameters())
        log(f"policy: HF checkpoint {cfg.model} ({policy.cfg.architecture}, {n:,} parameters); "
            f"{sum(map(len, tsk.splits.values()))} prompts from {cfg.data} ({len(tsk.splits['eval'])} held out, "
            f"{tsk.dropped} dropped as longer than {cfg.max_prompt_tokens} tokens)")
        return policy, key, True
    t0 = time.perf_counter()
    policy, key, loaded = warmup.warm_policy(PolicySpec.from_config(cfg, tsk, device), cache_dir=cfg.cache_dir,
                                             log_every=max(cfg.sft_steps // 6, 1), device=device,
                                             chunk_mib=cfg.chunk_mib, group=group_of(mesh))
    done = ("loaded from cache" if loaded else "trained" if isinstance(tsk, Demonstrations)
            else "none (the task has no demonstrations)")
    log(f"policy SFT warm-up: {done} ({key}, {time.perf_counter() - t0:.0f}s)")
    return policy, key, loaded


def split_warmups(mesh: Mesh) -> bool:
    """Whether the ranks build together, splitting the warm-ups: every rank has its own GPU (else one process does
    them, or a single rank while the others wait: build)."""
    return mesh.world == 1 or mesh.device.type == "cuda"


def group_of(mesh: Mesh | None):
    """The process group the warm-ups split over: every rank of the run (None: one process)."""
    return dist.group.WORLD if mesh is not None and mesh.world > 1 else None


def in_turns(mesh: Mesh | None, load, what: str):
    """load() on every rank, one process per node at a time (mesh.turns(): on GPUs each process builds the checkpoint
    on the host before moving it to its device, so a node holds ~1 host copy, not one per rank), with a barrier
    between the turns. No mesh: load()."""
    turns, out = (mesh.turns() if mesh is not None else 1), None
    for turn in range(turns):
        if mesh is None or mesh.local_rank % turns == turn:
            out = load()
        if turns > 1:
            mesh.barrier(f"{what}, local rank {turn}'s turn (one process per node at a time)")
    return out


def policy_key(cfg: Config, tsk, device=None) -> str:
    """The warm policy's cache key, without training: the SFT spec's (a --task task) or the HF checkpoint's."""
    return hf_policy_key(cfg.model) if cfg.hf_mode else PolicySpec.from_config(cfg, tsk, device).key()


def build(cfg: Config, mesh: Mesh, log=print) -> Setup:
    """build_models on every rank, then the samplers and this rank's share of the update. Where each rank has its own
    GPU they build together: the warm-ups split over the ranks (harness/warmup_split.py) and cached by rank 0, an HF
    checkpoint loaded one process per node at a time. On the CPU the ranks share the host's cores, and one process
    with every core (--warmup_threads) trains a small model's warm-ups faster than the ranks splitting them (docs/gpu.md
    has the measurement): rank 0 builds first and caches them, then the others load them. A rank that waits past
    --dist_timeout ends in one line naming the phase (mesh.PhaseTimeout)."""
    quiet = lambda *a, **k: None  # noqa: E731
    last = mesh.grid.pp_rank == mesh.grid.pp - 1  # the stage that trains the drafts: their optimizers live there
    if split_warmups(mesh):
        with mesh.phase("build: every rank loads the models and trains the uncached warm-ups"):
            s = build_models(cfg, mesh.device, log if mesh.main else quiet, mesh=mesh, train_drafts=last)
    else:
        s = build_models(cfg, mesh.device, log, train_drafts=last) if mesh.main else None
        mesh.barrier("build: the other ranks wait while rank 0 builds the models and trains the uncached warm-ups")
        s = s or build_models(cfg, mesh.device, quiet, train_drafts=last)
    s.cotrainer = DistCotrainer(
        s.policy, list(s.drafts.values()), mesh.grid,
        lambda ps: torch.optim.AdamW(ps, lr=cfg.lr, weight_decay=0.0, betas=(0.9, 0.99)),
        grad_clip=cfg.grad_clip, schedule=cfg.schedule, attn_fn=auto_causal_attention,
        attn_backend=cfg.attn_backend_on(mesh.device),
        logprob_chunk=budget_rows(s.policy.cfg.vocab_size, cfg.chunk_mib),
        activation_checkpointing=cfg.activation_checkpointing,
        zero1=resolve_zero1(cfg, s.policy.cfg, mesh.grid, mesh.device, s.task.max_new_tokens,  # auto: the plan
                            device_bytes=cfg.device_gib * 2**30 if cfg.device_gib else None),
        observers=step_observers(s))
    return s


def step_observers(s: Setup) -> list:
    """What watches the update: the draft hook's timer (step_timer.py) and the watched arms (frozen /
    offline-extended: their teacher-forced acceptance on the rollouts, forward only, read with the co-trained draft's
    options; none when the run holds neither)."""
    arms = [d for _, d in watched(s)]
    return [HookTimer()] + ([DraftWatch(arms, options=next(iter(s.drafts.values()), None))] if arms else [])


def watched(s: Setup) -> list:
    """(arm name, draft) of the arms measured on the rollouts' taps but not trained on them (those the run holds)."""
    return ([("frozen", s.frozen)] if s.frozen is not None else []) + (
        [("offline", s.offline.draft)] if s.offline is not None else [])


def build_offline(cfg: Config, s: Setup, warm) -> Setup:
    """The offline-extended arm (offline_arm.py) on a copy of the warm-up draft, reading the live embedding like the
    frozen copy; it samples pi_0 from the reference."""
    warm.attach(s.policy)
    s.offline = OfflineArm(cfg, s.task, s.ref, warm, seed=cfg.run_seed)
    return s


def build_models(cfg: Config, dev: torch.device, log=print, mesh: Mesh | None = None,
                 train_drafts: bool = True) -> Setup:
    """Task, warm policy (SFT'd or the HF checkpoint), and the copies the run uses on `dev`, in the run's dtype: the
    reference when cfg.needs_ref, the draft arms cfg.arm names (none with --no_spec); no update yet. mesh: every rank
    calls this together (the warm-ups split over them); None: one process. train_drafts False (a pipeline stage
    before the last): the drafts get no optimizer, no fp32 masters, no gradient accumulators."""
    torch.manual_seed(cfg.seed)
    tsk = build_task(cfg)
    threads = torch.get_num_threads()
    if mesh is None or mesh.world == 1:  # one process: the warm-ups' own threads (ranks keep --threads each)
        torch.set_num_threads(cfg.warmup_threads)
    try:
        t0 = time.perf_counter()
        policy, pkey, loaded = build_policy(cfg, tsk, log, dev, mesh)
        t1 = time.perf_counter()
        warm, dloaded = warm_draft(cfg, tsk, policy, pkey, mesh)
        t2 = time.perf_counter()
    finally:
        torch.set_num_threads(threads)
    done = ("none: plain GRPO (--no_spec)" if cfg.no_spec
            else f"skipped: --draft {cfg.draft} is used as is" if cfg.draft
            else "none (an untrained draft)" if cfg.draft_warmup_steps == 0 else "loaded from cache" if dloaded
            else "trained")
    log(f"draft warm-up: {done} ({t2 - t1:.0f}s)")
    dt = model_dtype(cfg, dev)  # the warm-ups ran in --dtype already; a loaded draft is cast to it here
    if warm is not None and any(p.dtype != dt for p in warm.parameters()):
        warm.to(dt).attach(policy)  # the draft shares the policy's embedding again
    ref = copy.deepcopy(policy).requires_grad_(False) if cfg.needs_ref else None  # held only when used
    drafts, frozen, warm_copy = {}, None, None
    if warm is not None:
        warm_copy = copy.deepcopy(warm) if cfg.arm("offline") else None  # the offline arm's start
        if cfg.arm("frozen"):
            frozen = copy.deepcopy(warm).requires_grad_(False)
            frozen.attach(policy)  # like the co-trained draft it reads the live policy's embedding; its weights stay
        drafts = draft_arms(cfg, tsk, policy, warm, train_drafts)
    grpo = GRPOConfig.of(cfg, max_len=tsk.max_new_tokens, temperature=cfg.temperature)
    r = cfg.run_seed  # the RL phase's streams; the warm-ups and the held-out prompts follow cfg.seed (shared)
    s = Setup(cfg, tsk, policy, ref, drafts, frozen, None, tsk.eval_set(cfg.eval_prompts, cfg.seed + 1234),
              random.Random(r), torch.Generator(device=dev).manual_seed(r), torch.Generator().manual_seed(r + 31), grpo,
              {"sft_s": t1 - t0, "draft_warmup_s": t2 - t1, "policy_cached": loaded, "draft_cached": dloaded})
    if warm_copy is not None:
        build_offline(cfg, s, warm_copy)
    return s


def warm_draft(cfg: Config, tsk, policy, pkey: str, mesh: Mesh | None = None) -> tuple:
    """-> (the warm-up draft, loaded from cache): the cached offline fit (under torchrun trained on every rank
    together), a draft from --draft in any format harness/draft_formats.py reads (no warm-up; loaded None), or (None,
    None) with --no_spec."""
    if cfg.no_spec:
        return None, None
    if cfg.draft:  # no warm-up (warmup_cached.draft = None in the summary); the control arms start from it too
        return load_draft(cfg.draft, policy, cfg.drafter, drafters.options(cfg, tsk)), None
    dev = next(policy.parameters()).device
    return warmup.warm_draft(policy, draft_spec(cfg, tsk, pkey, dev), cache_dir=cfg.cache_dir,
                             log_every=max(cfg.draft_warmup_steps // 4, 1), chunk_mib=cfg.chunk_mib,
                             group=group_of(mesh))


def draft_arms(cfg: Config, tsk, policy, warm, train: bool = True) -> dict:
    """arm name -> DraftTrainer of the drafts trained on the rollouts' taps: "cotrained" (the warm-up draft itself,
    or with --cold_start an untrained one of the same shape, warm.fresh: the same taps, vocabulary, block) and,
    with --cold_arm, "cold" (untrained, evaluated only). train False: no optimizer (opt None): this rank only rolls
    out with the drafts, which refit gives it."""
    def trainer(d):
        opt = master_optimizer(d.parameters(), lambda ps: torch.optim.AdamW(ps, lr=cfg.draft_lr, weight_decay=0.0)) \
            if train else None
        return drafters.config_trainer(cfg, tsk, d, opt)

    torch.manual_seed(cfg.run_seed + 7)
    drafts = {"cotrained": trainer(warm.fresh(policy) if cfg.cold_start else warm)}
    if cfg.arm("cold"):
        drafts["cold"] = trainer(warm.fresh(policy))
    return drafts
