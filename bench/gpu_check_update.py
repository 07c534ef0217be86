"""One world-size-1 update per draft family at Qwen3-8B's width: the memory of one DistCotrainer step against the memory
plan, and the first update's ratio pi / pi_old.

The policy has Qwen3-8B's shape (docs/examples/qwen3_8b/config.json: hidden 4096, 32 heads / 8 kv heads, head_dim
128, intermediate 12288, V = 151936, q/k norms, untied head) cut to --layers, random, bf16 with fp32 masters; each
family's draft is untrained, built as harness/drafters.py builds it (EAGLE-3: one layer and its own LM head; DFlash and
DSpark: train.py's default --draft_layers, blocks of k + 1 = 5 slots, the policy's head shared). One RL update runs on
--prompts_per_step x --group_size random sequences of --seq tokens (--prompt of them the prompt) in --micro_batches,
through harness/update.update (DistCotrainer.step, then the refit), the cotrainer built as harness/experiment.build
builds it.

    measured   CUDA: torch.cuda.max_memory_allocated over the update (reset before) and memory_allocated after it;
               any device: the storage tracker's transient peak over the update and the bytes the step holds after it
               (harness/memory_track.StorageTracker and held, as tests/test_memory_plan.py measures them)
    plan       harness/memory_model.rank_plan for the same Config and shape: persistent (less the CUDA context and
               NCCL's buffers, which the allocator does not see) and update_peak; the CUDA peak's plan is their sum
    ratio      the first update's mean pi / pi_old over the trained tokens: exactly 1, pi_old being that forward's own
               log-probs, detached (harness/update.py, step 3); anything else fails the check, as does an
               out-of-memory error or a loss that is not finite

    python bench/gpu_check_update.py              # CUDA: 4 layers at Qwen3-8B's width, each family (<= 65 GiB planned)
    python bench/gpu_check_update.py --tiny       # any device: hidden 64, V = 2000, 16 tokens a sequence (the dry run)

Prints plan / measured per family; writes JSON to --out (bench/gpu_check.sh: next to its report).
"""
from __future__ import annotations

import dataclasses
import gc
import json
import math
import os
import sys
from types import SimpleNamespace

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from backends.attention_padded import auto_causal_attention  # noqa: E402
from backends.fused_logprob import budget_rows  # noqa: E402
from dist_step import DistCotrainer  # noqa: E402
from harness import drafters, memory_model as mm, memory_track as mt  # noqa: E402
from harness.config import parse_args  # noqa: E402
from harness.experiment import draft_arms  # noqa: E402
from harness.update import update  # noqa: E402
from model import ModelConfig, Transformer  # noqa: E402
from parallel.cli import parser, run_main  # noqa: E402
from parallel.grid import Grid  # noqa: E402
from rl_loop import GRPOConfig, RolloutBatch  # noqa: E402
from serving.hf_io import config_from_hf, read_json  # noqa: E402

QWEN3_8B = os.path.join(ROOT, "docs", "examples", "qwen3_8b", "config.json")
TINY = dict(vocab_size=2000, hidden_size=64, intermediate_size=192, num_attention_heads=4, num_key_value_heads=1,
            head_dim=16)  # GQA 4 as Qwen3-8B's
SIZES = {False: dict(layers=4, prompts_per_step=4, group_size=4, micro_batches=2, seq=512, prompt=64, anchors=16,
                     chunk_mib=256.0),
         True: dict(layers=4, prompts_per_step=2, group_size=2, micro_batches=2, seq=16, prompt=4, anchors=4,
                    chunk_mib=1.0)}


def policy_config(layers: int, tiny: bool) -> ModelConfig:
    m = config_from_hf(read_json(QWEN3_8B), QWEN3_8B)
    return dataclasses.replace(m, num_hidden_layers=layers, **(TINY if tiny else {}))


def run_config(family: str, size: dict, device: str):
    """train.py's Config of this update: bf16, one update, no control arms, no reference, ZeRO-1 off (one rank)."""
    block = [] if family == "eagle3" else ["--mask_token_id=1", f"--anchors={size['anchors']}"]  # the blocks' own
    return parse_args([f"--drafter={family}", f"--device={device}", "--dtype=bf16", "--zero1=false",
                       "--frozen_arm=false", "--cold_arm=false", "--offline_arm=false",
                       "--log_kl=false", "--updates=1", f"--prompts_per_step={size['prompts_per_step']}",
                       f"--group_size={size['group_size']}", f"--micro_batches={size['micro_batches']}",
                       f"--chunk_mib={size['chunk_mib']}", *block])


def setup(cfg, m: ModelConfig, dev: torch.device, seq: int, prompt: int) -> SimpleNamespace:
    """The pieces harness/update.update reads, built on `dev` as harness/experiment.build builds them."""
    with torch.device(dev):  # parameters created on the device: no host copy of a 2B-parameter model
        torch.manual_seed(cfg.seed)
        policy = Transformer(m).to(torch.bfloat16)
        warm = drafters.build_draft(cfg.drafter, policy, drafters.options(cfg, None))
        drafts = draft_arms(cfg, None, policy, warm)  # {"cotrained": trainer}: fp32 masters, AdamW
    ct = DistCotrainer(policy, list(drafts.values()), Grid(),
                       lambda ps: torch.optim.AdamW(ps, lr=cfg.lr, weight_decay=0.0, betas=(0.9, 0.99)),
                       grad_clip=cfg.grad_clip, schedule=cfg.schedule, attn_fn=auto_causal_attention,
                       attn_backend=cfg.attn_backend_on(dev), logprob_chunk=budget_rows(m.vocab_size, cfg.chunk_mib),
                       activation_checkpointing=cfg.activation_checkpointing, zero1=False)
    grpo = GRPOConfig.of(cfg, max_len=seq - prompt, temperature=cfg.temperature)
    return SimpleNamespace(cfg=cfg, policy=policy, ref=None, frozen=None, offline=None, drafts=drafts, cotrainer=ct,
                           grpo=grpo, perm_gen=torch.Generator().manual_seed(cfg.run_seed + 31))


def batch_of(cfg, m: ModelConfig, seq: int, prompt: int) -> RolloutBatch:
    """prompts_per_step x group_size random sequences, all of `seq` tokens; advantages N(0, 1), every group valid."""
    g = torch.Generator().manual_seed(cfg.seed)
    S = cfg.prompts_per_step * cfg.group_size
    tok = lambda n: torch.randint(2, m.vocab_size, (n,), generator=g)  # noqa: E731 (ids 0, 1: pad, MASK)
    resp = [tok(seq - prompt) for _ in range(S)]
    return RolloutBatch.from_rollouts([tok(prompt) for _ in range(S)], resp, [-torch.rand(len(r)) for r in resp],
                                      torch.randn(S, generator=g), torch.ones(S, dtype=torch.bool))


def measure(s, batch: RolloutBatch, dev: torch.device) -> dict:
    """One update under the trackers: its ratio and loss, the bytes held after it, its transient peak; on CUDA the
    allocator's peak over it and what it holds after, and the device memory outside the allocator (the context)."""
    cuda = dev.type == "cuda"
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    with mt.StorageTracker() as tr:
        up = update(s, batch, {})
    out = dict(ratio=up["ratio"], loss_policy=up["loss_policy"], tracker_transient=tr.peak(),
               held=sum(mt.held(s).values()))
    if cuda:
        torch.cuda.synchronize()
        free, total = torch.cuda.mem_get_info()
        out.update(cuda_peak=torch.cuda.max_memory_allocated(), cuda_after=torch.cuda.memory_allocated(),
                   outside_allocator=total - free - torch.cuda.memory_reserved())
    return out


def one_family(family: str, size: dict, m: ModelConfig, dev: torch.device) -> dict:
    """The family's update measured beside its plan: {"plan": {...}, "measured": {...}}, or {"error": ...}."""
    cfg, seq, prompt = run_config(family, size, dev.type), size["seq"], size["prompt"]
    s = None
    try:
        s = setup(cfg, m, dev, seq, prompt)
        got = measure(s, batch_of(cfg, m, seq, prompt), dev)
    except torch.cuda.OutOfMemoryError as e:
        return dict(error=f"out of memory: {str(e).splitlines()[0][:200]}")
    finally:
        del s
        gc.collect()
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    run = mm.Run(m, seq=seq, prompt=prompt, rollout_seq=seq, dtype="bf16", gpu=dev.type == "cuda")
    p = mm.rank_plan(cfg, run, 0, rank0=True, max_new_tokens=seq - prompt, longest_new=seq - prompt)
    persistent = p["persistent"] - p.get("cuda_context", 0) - p.get("nccl_buffers", 0)
    plan = dict(persistent=persistent, update_peak=p["update_peak"], cuda_peak=persistent + p["update_peak"],
                cuda_context=p.get("cuda_context", 0))
    return dict(plan=plan, measured=got)


def show(n: float) -> str:
    return f"{n / 2**30:7.2f} GiB" if n >= 2**30 else f"{n / 2**20:7.1f} MiB"


def table(res: dict) -> str:
    rows = [f"one update, world size 1, bf16: {res['layers']} layers at H = {res['model']['hidden_size']}, V = "
            f"{res['model']['vocab_size']}; {res['sequences']} sequences of {res['seq']} tokens in "
            f"{res['micro_batches']} micro-batches; each cell plan / measured (their ratio)"]
    for fam, r in res["families"].items():
        if "error" in r:
            rows.append(f"  {fam:7s} {r['error']}")
            continue
        p, g = r["plan"], r["measured"]
        pairs = [("held", "persistent", "held"), ("transient", "update_peak", "tracker_transient")]
        if "cuda_peak" in g:
            pairs += [("CUDA peak", "cuda_peak", "cuda_peak"), ("CUDA after", "persistent", "cuda_after")]
        cells = [f"{name} {show(p[a])} / {show(g[b])} ({p[a] / max(g[b], 1):.3f})" for name, a, b in pairs]
        rows.append(f"  {fam:7s} ratio {g['ratio']!r:5}  " + "  ".join(cells))
        if "outside_allocator" in g:
            rows.append(f"  {'':7s} outside the allocator (CUDA context, workspaces): {show(g['outside_allocator'])}; "
                        f"the plan states {show(p['cuda_context'])}")
    return "\n".join(rows)


def problems(res: dict) -> list:
    bad = []
    for fam, r in res["families"].items():
        if "error" in r:
            bad.append(f"{fam}: {r['error']}")
        elif r["measured"]["ratio"] != 1.0 or not math.isfinite(r["measured"]["loss_policy"]):
            bad.append(f"{fam}: ratio {r['measured']['ratio']!r}, loss {r['measured']['loss_policy']!r}; expected "
                       "exactly 1 on-policy and a finite loss")
    return bad


def main(argv):
    ap = parser(__doc__, __file__)
    ap.add_argument("--tiny", action="store_true", help="the dry run's size (hidden 64, V = 2000) on any device")
    ap.add_argument("--device", default=None, help="cuda when available, else cpu")
    ap.add_argument("--drafters", default="eagle3,dflash,dspark", help="comma-separated families")
    ap.add_argument("--out", default="", help="JSON path ('': none)")
    a = ap.parse_args(argv)
    dev = torch.device(a.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    try:
        names = drafters.family_list(a.drafters)
    except ValueError as e:
        raise SystemExit(str(e))
    size = SIZES[a.tiny]
    m = policy_config(size["layers"], a.tiny)
    res = dict(device=torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu", torch=torch.__version__,
               model=dataclasses.asdict(m), sequences=size["prompts_per_step"] * size["group_size"], **size,
               families={})
    for name in names:
        res["families"][name] = one_family(name, size, m, dev)
        print(table(dict(res, families={name: res["families"][name]})).splitlines()[-1], flush=True)
    res["problems"] = problems(res)
    print("\n" + table(res))
    if a.out:
        with open(a.out, "w") as f:
            json.dump(res, f, indent=1)
    if res["problems"]:
        raise SystemExit("; ".join(res["problems"]))
    return 0


if __name__ == "__main__":
    run_main(main, __file__, sys.argv[1:])
