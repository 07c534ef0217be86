"""What a reduced draft vocabulary (--draft_vocab N) does to acceptance and to the draft's step time.

Part 1, the built-in task: one SFT'd policy (a train.py preset, cached), then for each N a draft warmed up the same way
(warmup.warm_draft, the N most frequent response tokens of its samples) and, side by side on the same held-out prompts
and seeds, the speculative rollout's acceptance length (k draft tokens, temperature 1), the warm-up's predicted
tau_hat, and the draft's step time (Eagle3Draft.step at batch B, median of interleaved repeats). The built-in task's
vocabulary is tiny (18 tokens), so its step times say little about the head.
Part 2, an HF-sized head: a random draft matched to a Qwen2.5-0.5B-shaped target (H 896, V 151,936) timed at each
N -- the head is H x N, so this is where N pays. Acceptance in HF mode needs a real checkpoint and its samples: not
measured here (no weights are downloaded on this machine).

    python bench/bench_draft_vocab.py               # ~5 min on 2 cores; bench/results/draft_vocab.{json,md}
    python bench/bench_draft_vocab.py --quick       # seconds: test-sized, bench/results/scratch/
"""
from __future__ import annotations

import dataclasses
import json
import os
import platform
import random
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import speculative  # noqa: E402
from harness import warmup  # noqa: E402
from harness.cache_keys import PolicySpec  # noqa: E402
from harness.experiment import build_task, draft_spec  # noqa: E402
from harness.config import parse_args  # noqa: E402
from draft import DraftConfig, Eagle3Draft  # noqa: E402
from model import ModelConfig  # noqa: E402
from parallel.cli import parser  # noqa: E402

OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")


def step_time(draft, B: int, repeats: int, seed: int = 0) -> float:
    """Median seconds of one Eagle3Draft.step at batch B on a cache holding 32 trunk entries per row."""
    g = torch.Generator().manual_seed(seed)
    H = draft.cfg.hidden_size
    cache = draft.new_cache(B, 64)
    with torch.inference_mode():
        draft.extend(cache, torch.randint(draft.cfg.vocab_size, (B, 32), generator=g),
                     {l: torch.randn(B, 32, H, generator=g) for l in draft.tap_layers}, torch.full((B,), 31))
        L0, ts = cache.lengths.clone(), []
        tok, h = torch.randint(draft.cfg.vocab_size, (B,), generator=g), torch.randn(B, H, generator=g)
        for _ in range(repeats + 1):
            t0 = time.perf_counter()
            draft.step(cache, tok, h)
            ts.append(time.perf_counter() - t0)
            cache.rollback(L0)
    return statistics.median(ts[1:])


def builtin(cfg, Ns, B, repeats):
    tsk = build_task(cfg)  # the task train.py builds: the same cache entries
    mcfg = ModelConfig.preset(cfg.model, vocab_size=tsk.tok.vocab_size)
    policy, key, _ = warmup.warm_policy(PolicySpec.from_config(cfg, tsk), cache_dir=cfg.cache_dir)
    policy.eval()
    prompts = [tsk.encode_prompt(p) for p in tsk.eval_set(cfg.eval_prompts)]
    drafts = {}
    for n in Ns:
        t0 = time.perf_counter()
        spec = dataclasses.replace(draft_spec(cfg, tsk, key), draft_vocab=0 if n == mcfg.vocab_size else n)
        drafts[n], _ = warmup.warm_draft(policy, spec, cache_dir=cfg.cache_dir)  # N = V: train.py's cache entry
        print(f"  draft N={n}: warm-up {time.perf_counter() - t0:.0f}s", flush=True)
    rows = {n: {"N": n, "accept": [], "step_s": []} for n in Ns}
    for seed in range(2):  # interleaved: every N sees the same prompts, seeds and machine load
        for n in Ns:
            g = torch.Generator().manual_seed(seed)
            r = speculative.generate(policy, drafts[n], prompts, max_new_tokens=tsk.max_new_tokens,
                                     num_draft_tokens=cfg.num_draft_tokens, temperature=cfg.temperature,
                                     eos_id=tsk.tok.eos_ids, generator=g)
            rows[n]["accept"].append(r.stats.acceptance_length)
            rows[n]["step_s"].append(step_time(drafts[n], B, repeats, seed))
    out = []
    for n in Ns:
        d = drafts[n]
        ids = d.draft_to_target
        out.append({"N": n, "V": mcfg.vocab_size, "acceptance_length": statistics.mean(rows[n]["accept"]),
                    "acceptance_runs": rows[n]["accept"], "draft_step_ms": 1e3 * statistics.median(rows[n]["step_s"]),
                    "ids": ids.tolist()})
    return out


def hf_head(Ns, B, repeats):
    """Draft step time for a Qwen2.5-0.5B-shaped target (random weights, fp32, CPU)."""
    H, V = 896, 151936
    embed = torch.randn(V, H) * 0.02
    out = []
    for n in Ns:
        cfg = DraftConfig(vocab_size=V, hidden_size=H, intermediate_size=4864, num_attention_heads=14,
                          num_key_value_heads=2, head_dim=64, tap_layers=(1, 11, 20), target_num_layers=24,
                          draft_vocab_size=n)
        torch.manual_seed(0)
        draft = Eagle3Draft(cfg, embed).eval()
        if n < V:
            with torch.no_grad():
                ids = torch.randperm(V)[:n].sort().values
                draft.d2t.copy_(ids - torch.arange(n))
        out.append({"N": n, "V": V, "draft_step_ms": 1e3 * step_time(draft, B, repeats),
                    "head_params_M": n * H / 1e6})
        print(f"  HF-sized head N={n}: {out[-1]['draft_step_ms']:.1f} ms", flush=True)
        del draft
    return out


def main(argv=None):
    ap = parser(__doc__, __file__)
    ap.add_argument("--quick", action="store_true", help="test-sized, seconds; written under bench/results/scratch/")
    quick = ap.parse_args(argv).quick
    torch.set_num_threads(1)  # 2 threads spin-wait on a busy shared machine
    if quick:
        cfg = parse_args(["--preset", "test", "--cache_dir", os.path.join(OUT, "scratch", "cache")])
        Ns, hf_Ns, B, repeats = (18, 12), (151936, 8192), 4, 3
    else:
        cfg = parse_args(["--preset", "smoke", "--draft_warmup_steps=200", "--draft_warmup_batch=32",
                          "--draft_warmup_lr=3e-3", "--eval_prompts=64"])
        Ns, hf_Ns, B, repeats = (18, 14, 10, 6), (151936, 65536, 32768, 16384, 8192), 32, 20
    t0 = time.perf_counter()
    res = {"machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, torch "
                      f"{torch.__version__}, 1 thread", "preset": cfg.name, "k": cfg.num_draft_tokens, "B": B,
           "builtin": builtin(cfg, Ns, B, repeats), "hf_head": hf_head(hf_Ns, B, repeats)}
    res["seconds"] = time.perf_counter() - t0
    folder = os.path.join(OUT, "scratch") if quick else OUT
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, "draft_vocab.json"), "w") as f:
        json.dump(res, f, indent=1)
    full = res["builtin"][0]
    lines = [f"Built-in task ({cfg.name} preset policy, V = {full['V']}), k = {res['k']}, temperature 1, "
             f"{cfg.eval_prompts} held-out prompts x 2 seeds; draft step at B = {B}:", "",
             "| N (draft vocab) | acceptance length | draft step (ms) |", "|---|---|---|"]
    lines += [f"| {r['N']}{' (full)' if r['N'] == r['V'] else ''} | {r['acceptance_length']:.2f} | "
              f"{r['draft_step_ms']:.2f} |" for r in res["builtin"]]
    hf_full = res["hf_head"][0]["draft_step_ms"]
    lines += ["", f"HF-sized head (Qwen2.5-0.5B shape: H 896, V 151,936; random weights), draft step at B = {B}:", "",
              "| N (draft vocab) | head (M params) | draft step (ms) | vs full |", "|---|---|---|---|"]
    lines += [f"| {r['N']:,}{' (full)' if r['N'] == r['V'] else ''} | {r['head_params_M']:.1f} | "
              f"{r['draft_step_ms']:.1f} | {hf_full / r['draft_step_ms']:.2f}x |" for r in res["hf_head"]]
    lines += ["", f"`python bench/bench_draft_vocab.py{' --quick' if quick else ''}`, {res['machine']}, "
              f"{res['seconds']:.0f} s."]
    with open(os.path.join(folder, "draft_vocab.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    from parallel.cli import run_main  # an error: one line, exit 1 (COSPEC_TRACEBACK=1: the traceback)
    run_main(main, __file__)
