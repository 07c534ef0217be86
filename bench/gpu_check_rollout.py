"""Speculative rollouts per draft family (EAGLE-3, DFlash, DSpark) on one GPU, at a width where a policy forward is no
longer launch-bound.

    speedup = tokens/s(speculative, k) / tokens/s(autoregressive), same policy, prompts, rows, temperature and seeds

bench/bench_rollout_families.py trains its policy on the CPU at bench_rollout's fixed width (H = 128, V = 64): on a GPU
each of its forwards is microseconds of arithmetic behind a fixed cost of kernel launches per layer, at any batch it
offers, so its speedups count forwards, not work. Here the policy has Qwen3-8B's layer shape (hidden 4096, 32 / 8 heads,
head_dim 128, intermediate 12288; 0.19 B parameters a layer), 4 layers, at the built-in task's vocabulary: at 1024 rows
an autoregressive step is 2 x 1024 x 0.19 B = 0.4 TFLOP a layer (0.4 ms at an H100's dense bf16 peak, more in practice),
a verification k + 1 = 5 times that. It is SFT'd on the task's demonstrations and each family's draft warmed up on its
samples by train.py's own warm-ups (harness/warmup.py, on the GPU, bf16; cached under --cache_dir), then
bench_rollout.measure times each family's chain at k = 4 against autoregressive sampling at 64 and at 1024 rows, runs
interleaved, medians of 3 repeats (each repeat its own prompts and seed, the same for every family), 48 new tokens a row
(no EOS: every row runs the budget, so both decoders do the same work). The autoregressive rows tell whether a forward
is launch-bound: 16x the rows give 16x the tokens/s there.

    python bench/gpu_check_rollout.py            # CUDA: 4 layers, 64 and 1024 rows, k = 4; ~1 min with the warm-ups
    python bench/gpu_check_rollout.py --tiny     # any device: the tiny preset's width, 2 rows, k = 2 (the dry run)

Prints a table per family; writes JSON to --out after each family (a run cut short keeps the families it finished).
"""
from __future__ import annotations

import dataclasses
import json
import os
import random
import sys
import time

import torch

BENCH = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(BENCH))
sys.path.insert(1, BENCH)  # its sibling bench_rollout, however it is run
import bench_rollout as br  # noqa: E402
from harness import warmup  # noqa: E402
from harness.cache_keys import PolicySpec  # noqa: E402
from harness.config import parse_args  # noqa: E402
from harness.drafters import family_list  # noqa: E402
from harness.experiment import build_task  # noqa: E402
from model import ModelConfig  # noqa: E402
from parallel.cli import parser, run_main  # noqa: E402
from serving.hf_io import config_from_hf, read_json  # noqa: E402

QWEN3_8B = os.path.join(os.path.dirname(BENCH), "docs", "examples", "qwen3_8b", "config.json")
SIZES = {False: dict(layers=4, sft_steps=150, sft_lr=3e-4, draft_steps=50, batches=(64, 1024), k=4, repeats=3,
                     max_new_tokens=48),
         True: dict(layers=4, sft_steps=4, sft_lr=1e-2, draft_steps=2, batches=(2,), k=2, repeats=1,
                    max_new_tokens=6)}


def run_config(family: str, size: dict, device: str, cache_dir: str):
    """train.py's Config of the warm-ups: the built-in task, the family, this check's SFT and draft warm-up sizes."""
    return parse_args([f"--drafter={family}", f"--device={device}", f"--cache_dir={cache_dir}",
                       f"--sft_steps={size['sft_steps']}", f"--sft_lr={size['sft_lr']}",
                       f"--draft_warmup_steps={size['draft_steps']}", "--draft_warmup_batch=32",
                       "--draft_warmup_pool=256", "--rollout_batch=256", f"--num_draft_tokens={size['k']}"])


def policy_shape(tiny: bool, layers: int, vocab: int) -> ModelConfig:
    """Qwen3-8B's layers (the tiny preset's with --tiny), `layers` deep, at the task's vocabulary."""
    m = ModelConfig.preset("tiny") if tiny else config_from_hf(read_json(QWEN3_8B), QWEN3_8B)
    return dataclasses.replace(m, num_hidden_layers=layers, vocab_size=vocab)


def bench_config(size: dict, device: str) -> br.BenchConfig:
    """bench_rollout's settings of the timed runs: one chain length, no trees, no adaptive k, wall clock on a GPU."""
    return dataclasses.replace(br.BenchConfig(), batches=tuple(size["batches"]), ks=(size["k"],), trees="", auto=False,
                               hot_temperature=0.0, repeats=size["repeats"], repeat_scale="",
                               max_new_tokens=size["max_new_tokens"], device=device,
                               clock="wall" if device == "cuda" else "cpu")


def family_rows(family: str, size: dict, tiny: bool, device: str, cache_dir: str, prompts: list) -> dict:
    """The family's warm-ups (loaded when cached) and its timed rows at every batch."""
    cfg = run_config(family, size, device, cache_dir)
    tsk, dev = build_task(cfg), torch.device(device)
    spec = dataclasses.replace(PolicySpec.from_config(cfg, tsk, dev),
                               model=policy_shape(tiny, size["layers"], tsk.tok.vocab_size))
    t0 = time.perf_counter()
    policy, key, p_loaded = warmup.warm_policy(spec, cache_dir=cache_dir, log_every=max(size["sft_steps"] // 3, 1),
                                               device=dev, chunk_mib=cfg.chunk_mib)
    t1 = time.perf_counter()
    draft, d_loaded = warmup.warm_draft(policy, warmup.draft_spec(cfg, tsk, key, dev), cache_dir=cache_dir,
                                        log_every=max(size["draft_steps"] // 2, 1), chunk_mib=cfg.chunk_mib)
    t2 = time.perf_counter()
    policy.eval(), draft.eval()
    bcfg = bench_config(size, device)
    rows = [row for B in bcfg.batches for row in br.measure(bcfg, policy, draft, prompts, B, 1.0)]
    return dict(rows=rows, policy_parameters=sum(p.numel() for p in policy.parameters()),
                draft_parameters=sum(p.numel() for p in draft.parameters()),
                warmups={"sft_s": round(t1 - t0, 1), "sft_cached": p_loaded, "draft_s": round(t2 - t1, 1),
                         "draft_cached": d_loaded})


def table(res: dict) -> str:
    lines = [f"{'family':8s} {'rows':>5s} {'k':>2s} {'AR tok/s':>10s} {'spec tok/s':>11s} {'speedup':>14s} "
             f"{'tokens/forward':>14s}"]
    for name, fam in res["families"].items():
        for r in fam["rows"]:
            sd = f" ± {r['speedup_sd']:.2f}" if r["speedup_sd"] is not None else ""
            lines.append(f"{name:8s} {r['batch']:5d} {r['k']:2d} {r['tokens_per_s_ar']:10.0f} "
                         f"{r['tokens_per_s_spec']:11.0f} {r['speedup']:8.2f}x{sd:7s} {r['acceptance_length']:14.2f}")
        ar = [r["tokens_per_s_ar"] for r in fam["rows"]]
        B = [r["batch"] for r in fam["rows"]]
        if len(ar) > 1:
            lines.append(f"{'':8s} autoregressive tokens/s x{ar[-1] / ar[0]:.1f} from {B[0]} to {B[-1]} rows "
                         f"(x{B[-1] / B[0]:g} where a forward is launch-bound)")
    return "\n".join(lines)


def main(argv):
    ap = parser(__doc__, __file__)
    ap.add_argument("--tiny", action="store_true", help="the dry run's sizes on any device")
    ap.add_argument("--device", default=None, help="cuda when available, else cpu")
    ap.add_argument("--drafters", default="eagle3,dflash,dspark", help="comma-separated families")
    ap.add_argument("--cache_dir", default="cache", help="where the warm-ups are cached (train.py's --cache_dir)")
    ap.add_argument("--out", default=os.path.join(BENCH, "results", "gpu_check_rollout.json"), help="JSON path")
    a = ap.parse_args(argv)
    device = a.device or ("cuda" if torch.cuda.is_available() else "cpu")
    try:
        names = family_list(a.drafters)
    except ValueError as e:
        raise SystemExit(str(e))
    size = SIZES[a.tiny]
    tsk = build_task(run_config(names[0], size, device, a.cache_dir))
    rng = random.Random(12345)  # held-out prompts, the same for every family
    prompts = [tsk.encode_prompt(p) for p in tsk.sample(max(size["batches"]) * size["repeats"], rng, "eval")]
    res = dict(device=torch.cuda.get_device_name() if device == "cuda" else "cpu", torch=torch.__version__,
               sizes=size, families={})
    for name in names:
        print(f"{name}: warm-ups (or the cache), then the timed rollouts ...", flush=True)
        res["families"][name] = family_rows(name, size, a.tiny, device, a.cache_dir, prompts)
        with open(a.out, "w") as f:  # after each family: a run cut short keeps what it finished
            json.dump(res, f, indent=1)
    print("\n" + table(res))
    return 0


if __name__ == "__main__":
    run_main(main, __file__, sys.argv[1:])
