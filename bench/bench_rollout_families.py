"""Rollout throughput per draft family: EAGLE-3, DFlash and DSpark drafts of ONE policy, side by side.

    speedup = tokens/s(speculative, k) / tokens/s(autoregressive), same policy, prompts, batch, temperature and seeds

bench/bench_rollout.py's regime, run for every family: the same policy (trained on the phrase language, cached), and
each family's draft trained the way that bench trains EAGLE-3's -- the same rollouts the policy sampled, the same
steps, batch, learning rate and warm-up, soft targets from one policy forward -- with the family's own loss through
the drafter protocol (`draft.loss`: TTT for eagle3, the block loss for dflash / dspark). Then bench_rollout.measure
times each family's chains at batch 1 / 8 / 64, tau 1 and 1.5 (`hot_temperature`), runs interleaved with their own
autoregressive runs; repeat r uses the same prompts and sampling seed for every family. Block drafters propose k
tokens in one forward (k <= block_size - 1 for dflash, block_size for dspark), with no tree and no adaptive k, so the
chains alone are compared (trees and the auto row are off here). At temperature 0 every family's tokens must equal
the autoregressive ones (greedy_exact).

    python bench/bench_rollout_families.py                      # the full table (a quiet machine: ~30 min)
    python bench/bench_rollout_families.py --quick              # minutes: every family end to end (its JSON written)
    python bench/bench_rollout_families.py --drafters=eagle3,dflash --ks=3 --repeats=5 --batches=1,8

Flags: --drafters (comma-separated families), --block_size, --anchors (the block drafters' W and blocks per sequence),
--quick, then any of bench_rollout.py's --key=value flags (its --help lists them; --trees and --auto are ignored).
Writes bench/results/rollout_families.json (rows per family as bench_rollout's, plus draft_train_metrics,
greedy_exact, train_seconds) and .md (--out=...json: elsewhere; --quick: rollout_families_quick.json).
"""
from __future__ import annotations

import json
import os
import platform
import sys
import time
from dataclasses import asdict, replace

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(1, os.path.dirname(os.path.abspath(__file__)))  # its sibling bench_rollout, however it is run
import bench_rollout as br  # noqa: E402
from harness.drafters import FAMILIES, architecture, build_draft, family_list  # noqa: E402
from parallel.cli import describe, wants_help  # noqa: E402
from serving.hf_io import from_pretrained, save_pretrained  # noqa: E402
from speculative import generate  # noqa: E402

OWN = dict(drafters="eagle3,dflash,dspark", block_size="8", anchors="8")  # this script's flags and their defaults
QUICK = ["--policy_steps=30", "--draft_steps=30", "--draft_rollouts=16", "--batches=1,8", "--hot_batches=1,8",
         "--ks=2,4", "--repeats=1", "--repeat_scale=", "--max_new_tokens=24", "--cache=bench/results/scratch/rq",
         "--out=bench/results/rollout_families_quick.json"]


def own_flags(argv, own: dict, doc: str, file: str, extra: str = "") -> tuple:
    """(a bench's own flags, {name: value} from `own`'s defaults and argv, the rest of argv for bench_rollout.py);
    -h / --help prints both sets of flags and exits."""
    if wants_help(argv):
        print(describe(doc, file) + "\n\nits own flags: " + " ".join(f"--{k}={v}" for k, v in own.items()) + extra
              + "; then bench_rollout.py's:\n")
        br.parse_args(["--help"])
    own, rest = dict(own), []
    for arg in argv:
        key, _, val = arg.removeprefix("--").partition("=")
        (own.__setitem__(key, val) if key in own else rest.append(arg))
    return own, rest


def parse(argv):
    """(bench_rollout.BenchConfig with trees and auto off, drafters, block_size, anchors); bad values: SystemExit."""
    own, rest = own_flags([a for a in argv if a != "--quick"], OWN, __doc__, __file__, " --quick")
    rest = QUICK + rest if "--quick" in argv else rest  # flags given after it win
    if not any(a.startswith("--out=") for a in rest):
        rest.append("--out=bench/results/rollout_families.json")
    cfg = replace(br.parse_args(rest), trees="", auto=False)
    try:
        names = family_list(own["drafters"])
    except ValueError as e:
        raise SystemExit(str(e))
    try:
        W, anchors = int(own["block_size"]), int(own["anchors"])
    except ValueError:
        raise SystemExit(f"--block_size={own['block_size']!r}, --anchors={own['anchors']!r}: expected integers")
    if W < 2 or anchors < 1:
        raise SystemExit(f"--block_size={W}, --anchors={anchors}: expected block_size >= 2 and anchors >= 1")
    if any(n != "eagle3" for n in names) and max(cfg.ks) > W - 1:
        raise SystemExit(f"--ks={cfg.ks}: a block drafter proposes k <= block_size - 1 = {W - 1} tokens per forward")
    return cfg, names, W, anchors


def mask_id(lang: br.PhraseLanguage, vocab: int) -> int:
    """The block drafters' MASK: the smallest id no phrase contains (the policy never learns to emit it)."""
    used = {t for w in lang.words for t in w}
    free = [i for i in range(vocab) if i not in used]
    if not free:
        raise SystemExit("the phrase language uses every id: no MASK id is left for the block drafters")
    return free[0]


def train_family(cfg, policy, lang, name: str, opts: dict):
    """bench_rollout.train_draft for any family: the same rollouts, steps, batch, lr and warm-up; the family's loss."""
    g = torch.Generator().manual_seed(cfg.seed + 2)
    prompts = list(lang.sample(cfg.draft_rollouts, cfg.prompt_len, g))
    roll = generate(policy, None, prompts, max_new_tokens=cfg.draft_new_tokens, temperature=cfg.temperature,
                    generator=g)
    seqs = torch.stack([torch.cat([p, t]) for p, t in zip(prompts, roll.tokens)])  # (R, L) equal lengths
    draft = build_draft(name, policy, opts)
    kw = (dict(num_passes=cfg.ttt_passes) if name == "eagle3" else
          {k: opts[k] for k in FAMILIES[name].loss_keys})
    opt = torch.optim.AdamW([p for p in draft.parameters() if p.requires_grad], lr=3e-3, weight_decay=0.0)
    B, L = cfg.draft_batch, seqs.shape[1]
    cu = torch.arange(0, B * L + 1, L, dtype=torch.int32)
    for step in range(cfg.draft_steps):
        for group in opt.param_groups:
            group["lr"] = 3e-3 * min(1.0, (step + 1) / 10)
        x = seqs[torch.randint(len(seqs), (B,), generator=g)].flatten()
        with torch.no_grad():
            out = policy(x, cu, tap_layers=draft.tap_layers)
        loss, m = draft.loss(out.taps, x, cu, out.logits, **kw)
        opt.zero_grad()
        loss.backward()
        opt.step()
        if step % 25 == 0 or step == cfg.draft_steps - 1:
            print(f"  {name} step {step:3d}  loss {loss.item():.3f}  alpha {[round(a, 2) for a in m['alpha']]}")
    return draft.eval(), m


def cached_family(cfg, policy, lang, name, opts, key):
    """Train (or load) the family's draft; the cache key is the policy's and the draft's settings (DSpark's "-cm": its
    confidence head reads the Markov embedding, an (H + r)-wide row, and its gamma is default_gamma(W + 1))."""
    tag = f"-W{opts['block_size']}-a{opts['anchors']}-m{opts['mask_token_id']}" + ("-cm" if name == "dspark" else "")
    path = os.path.join(cfg.cache, key, name + tag)
    if os.path.isfile(os.path.join(path, "draft", "config.json")):
        with open(os.path.join(path, "draft_metrics.json")) as f:
            return architecture(os.path.join(path, "draft")).load(os.path.join(path, "draft"), policy).eval(), \
                json.load(f), 0.0
    t0 = time.perf_counter()
    draft, metrics = train_family(cfg, policy, lang, name, opts)
    draft.save(os.path.join(path, "draft"))
    with open(os.path.join(path, "draft_metrics.json"), "w") as f:
        json.dump(metrics, f)
    return draft, metrics, time.perf_counter() - t0


def policy_of(cfg, lang):
    """The bench's policy, shared with bench_rollout.py's cache when its settings match."""
    key = f"L{cfg.layers}-p{cfg.phrases}-s{cfg.policy_steps}x{cfg.policy_batch}x{cfg.seq_len}-{cfg.seed}"
    path = os.path.join(cfg.cache, key, "policy")
    if os.path.isfile(os.path.join(path, "config.json")):
        return from_pretrained(path).eval(), key
    print("training the policy on the phrase language ...")
    policy = br.train_policy(cfg, lang)
    save_pretrained(policy, path)
    return policy, key


def markdown(res) -> str:
    head = ("| family | batch | tau | k | AR tok/s | spec tok/s | speedup | tokens / policy forward | acceptance per "
            "depth |\n|---|---:|---:|---:|---:|---:|---:|---:|---|")
    body = [f"| {name} | {r['batch']} | {r['temperature']:g} | {r['k']} | {r['tokens_per_s_ar']:.0f} | "
            f"{r['tokens_per_s_spec']:.0f} | **{r['speedup']:.2f}x** ± {r['speedup_sd'] or 0:.2f} | "
            f"{r['acceptance_length']:.2f} | {', '.join(f'{a:.2f}' for a in r['accept_per_position'])} |"
            for name, fam in res["families"].items() for r in fam["rows"]]
    exact = ", ".join(f"{n}: {f['greedy_exact']}" for n, f in res["families"].items())
    return "\n".join([head] + body + ["", f"greedy speculative == autoregressive: {exact}"])


def main(argv):
    cfg, names, W, anchors = parse(argv)
    torch.set_num_threads(cfg.threads)
    lang = br.PhraseLanguage(64, cfg.phrases, cfg.seed)
    policy, key = policy_of(cfg, lang)  # trained (or loaded) on the CPU, timed on cfg.device
    policy = policy.to(cfg.device)
    opts = dict(mask_token_id=mask_id(lang, policy.cfg.vocab_size), block_size=W, num_layers=1, markov_rank=16,
                anchors=anchors, gamma=None, seed=cfg.seed)
    g = torch.Generator().manual_seed(cfg.seed + 3)
    prompts = list(lang.sample(max(cfg.batches), cfg.prompt_len, g))  # held-out: a fresh generator stream
    res = dict(config=asdict(cfg), drafters=names, block_size=W, anchors=anchors, families={},
               machine=dict(platform=platform.platform(), cpus=os.cpu_count(), threads=cfg.threads,
                            torch=torch.__version__, load_avg_1min_at_start=os.getloadavg()[0]))
    for name in names:
        print(f"{name}: training (or loading) the draft ...")
        draft, metrics, train_s = cached_family(cfg, policy, lang, name, opts, key)
        draft = draft.to(cfg.device)
        draft.attach(policy)  # the shared embedding / head: `to` copied the draft's reference to them
        greedy = lambda B, k: [a.tolist() for a in generate(policy, draft if k else None, prompts[:B],  # noqa: E731
                                                            max_new_tokens=cfg.max_new_tokens, num_draft_tokens=k,
                                                            temperature=0.0).tokens]
        exact = all(greedy(B, 0) == greedy(B, k) for B in cfg.batches[:2] for k in cfg.ks)  # also the warm-up
        rows = []
        for B in cfg.batches:
            rows += br.measure(cfg, policy, draft, prompts, B, cfg.temperature)
        for B in [b for b in cfg.batches if b in cfg.hot_batches] if cfg.hot_temperature > 0 else []:
            rows += br.measure(cfg, policy, draft, prompts, B, cfg.hot_temperature)
        res["families"][name] = dict(rows=rows, greedy_exact=exact, draft_train_metrics=metrics,
                                     train_seconds=round(train_s, 1),
                                     best_speedup=max(r["speedup"] for r in rows),
                                     draft_parameters=sum(p.numel() for p in draft.parameters()))
    table = markdown(res)
    print("\n" + table)
    os.makedirs(os.path.dirname(cfg.out) or ".", exist_ok=True)
    with open(cfg.out, "w") as f:
        json.dump(res, f, indent=2)
    with open(os.path.splitext(cfg.out)[0] + ".md", "w") as f:
        f.write(f"`python bench/bench_rollout_families.py {' '.join(argv)}`\n\n{table}\n")
    print(f"wrote {cfg.out}")
    return res


if __name__ == "__main__":
    from parallel.cli import run_main  # an error: one line, exit 1 (COSPEC_TRACEBACK=1: the traceback)
    run_main(main, __file__, sys.argv[1:])
