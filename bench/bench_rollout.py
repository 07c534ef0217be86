"""Rollout throughput: plain autoregressive sampling vs speculative decoding with a trained EAGLE-3 draft, side by side.

    speedup = tokens/s(speculative, k) / tokens/s(autoregressive), same policy, prompts, batch and temperature

Seconds are the process's CPU time by default (`clock`; one torch thread, so CPU time is the run's time on the core):
on a shared VM wall time swings up to ~2x from one second to the next while the host runs other guests, and CPU time
leaves that steal out (a fixed matmul loop here: coefficient of variation 0.19 by wall time, 0.06 by CPU time). The
wall-clock speedup is kept beside it (speedup_wall).

The regime: a small deep-and-narrow policy (the `small` preset with 8 layers, 1.5M parameters) is first trained for
a minute on a synthetic "phrase language" (24 fixed phrases of 3-6 tokens over a 64-token vocabulary; after each
phrase one of two successors follows, so the text is predictable except for ~1 bit at each phrase boundary). Its
samples are therefore peaky, like an RL policy late in training on a structured task. The draft is then trained (TTT,
soft CE against the policy) on rollouts the policy itself sampled, and the two decoders run on held-out prompts at
batch sizes 1, 8, 64 and k = 2, 3, 4, 6 draft tokens at temperature 1, runs interleaved so machine noise hits all
methods alike; the median of `repeats` runs is reported (each repeat its own prompts and sampling seed, the same for
every draft; `repeat_scale` runs the small batches' rows, the noisiest and cheapest, several times as often: at batch 1
one prompt's acceptance moves a repeat's speedup by ~20%), and speedup_sd, the standard deviation over repeats of the
paired speedup (that repeat's spec / that repeat's AR). Exactness is checked on the way: at temperature 0 the
speculative tokens must equal the autoregressive ones.

`auto` (on by default) adds a row per (batch, tau) with "k": "auto": decoding/adaptive_k.py picks k in {0, ..., max(ks)}
every step from its own timings (the benchmark's clock) and measured acceptance. One controller serves all of a row's
repeats, as one serves all of a training run's rollouts (its probes are timed in the first repeat); the row records
the steps it ran at each k. The targets (auto_targets): per row, auto >= the best fixed k's speedup - 2 sd (sd of the
paired per-repeat difference auto - best) and >= 1 - 2 sd (auto's speedup_sd); the geometric mean of auto's speedups
>= 0.98 x that of the per-row best fixed k.

Tree drafts (speculative_tree.py) run beside the chains: `trees` (6-22 nodes, depth 2-6) at every batch, and all
drafts again at `hot_temperature` (batches `hot_batches`), where the policy is flatter and the per-position acceptance
drops to ~0.7-0.85 (the regime trees are for). `equal_depth` sets each chain beside the tree of its depth that keeps the
most tokens per policy forward, at the largest batch (64 rows x 96 tokens x `repeats`: the least noisy acceptance).
`costs` times the two terms a speculative step is made of, a policy forward over S tokens and a draft level of width n,
at each batch: they bound what any chain or tree can gain on this machine.

    python bench/bench_rollout.py                    # ~10 min on 2 CPU cores (training included; cached afterwards)
    python bench/bench_rollout.py --repeats=9 --batches=1,8
    python bench/bench_rollout.py --device=cuda --out=bench/results/rollout_gpu.json  # decoders timed on a GPU
    python bench/bench_rollout.py --trees=2,2,1:3,2,1 --hot_temperature=0   # other trees (':'-separated), no hot rows
    python bench/bench_rollout.py --trees= --repeats=15 --out=bench/results/rollout_auto.json  # chains, auto: 7 min

Writes bench/results/rollout.json (rows: batch, k, tokens_per_s_ar, tokens_per_s_spec, speedup, acceptance_length, ...;
best_speedup) and bench/results/rollout.md (the markdown table). Trained weights are cached under
bench/results/scratch/ (git-ignored); delete it to retrain.
"""
from __future__ import annotations

import json
import math
import os
import platform
import statistics
import sys
import time
from dataclasses import asdict, dataclass, fields

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from draft import Eagle3Draft  # noqa: E402
from serving.hf_io import from_pretrained, save_pretrained  # noqa: E402
from modeling.kv_cache import TreeLayout  # noqa: E402
from model import ModelConfig, Transformer  # noqa: E402
from speculative import generate  # noqa: E402
from decoding.speculative_tree import Tree  # noqa: E402
from decoding.adaptive_k import AdaptiveK  # noqa: E402
from decoding.call_model import call_steps, row_spread  # noqa: E402
from parallel.cli import describe, flags_help, wants_help  # noqa: E402


@dataclass
class BenchConfig:
    layers: int = 8  # policy depth (small preset: H=128, 4 heads, V=64)
    phrases: int = 24
    policy_steps: int = 80
    policy_batch: int = 16
    seq_len: int = 64
    draft_rollouts: int = 64  # policy samples the draft trains on
    draft_new_tokens: int = 64
    draft_steps: int = 150
    draft_batch: int = 16
    ttt_passes: int = 5
    batches: tuple = (1, 8, 64)
    ks: tuple = (2, 3, 4, 6)
    trees: str = "3,1:4,2:2,1,1:3,1,1:2,2,1:2,1,1,1:2,2,1,1:2,1,1,1,1,1:3,1,1,1,1,1:2,2,1,1,1,1"  # 6-22 nodes; "": none
    hot_temperature: float = 1.5  # the chains and trees again at `hot_batches` at this temperature (0: skip)
    hot_batches: tuple = (1, 8, 64)
    max_new_tokens: int = 96
    prompt_len: int = 8
    temperature: float = 1.0
    repeats: int = 9  # each row's speedup_sd is over these (times repeat_scale)
    repeat_scale: str = "1:4,8:2"  # batch:factor: that batch's rows run repeats x factor (small batches: noisy, cheap)
    auto: bool = True  # an adaptive-k row (decoding/adaptive_k.py, ceiling max(ks)) per (batch, tau)
    threads: int = 1
    clock: str = "auto"  # "cpu": the process's CPU time (excludes a shared host's steal; 1 thread), "wall"; auto: cpu
    device: str = "cpu"  # "cuda": train on the CPU, then time the decoders on the GPU (wall clock, synchronized)
    seed: int = 0
    out: str = "bench/results/rollout.json"
    cache: str = "bench/results/scratch/rollout"


def parse_args(argv) -> BenchConfig:
    """--key=value overrides, type-checked; unknown keys are an error (nanoGPT's configurator, made strict).
    -h / --help: the flags, exit 0."""
    if wants_help(argv):
        print(describe(__doc__, __file__) + "\n\n" +
              flags_help(BenchConfig, default_title="flags (--key=value; tuples comma-separated)"))
        raise SystemExit(0)
    cfg, types = BenchConfig(), {f.name: f.type for f in fields(BenchConfig)}
    for arg in argv:
        key, _, val = arg.removeprefix("--").partition("=")
        empty_ok = key in ("trees", "repeat_scale")  # --trees= : no trees; --repeat_scale= : every batch x 1
        if not arg.startswith("--") or key not in types or (not val and not empty_ok):
            raise SystemExit(f"bad argument {arg!r}; expected --key=value with key in {sorted(types)}")
        cur = getattr(cfg, key)
        try:
            if isinstance(cur, bool) and val.lower() not in ("true", "false", "1", "0"):
                raise ValueError
            new = (tuple(int(v) for v in val.split(",")) if isinstance(cur, tuple) else
                   val.lower() in ("true", "1") if isinstance(cur, bool) else type(cur)(val))
        except ValueError:
            raise SystemExit(f"--{key}={val!r}: expected {type(cur).__name__}")
        setattr(cfg, key, new)
    if cfg.device != "cpu" and not (cfg.device.startswith("cuda") and torch.cuda.is_available()):
        raise SystemExit(f"--device={cfg.device!r}: expected cpu, or cuda[:i] on a machine with a CUDA GPU")
    repeat_factors(cfg.repeat_scale)  # checked here: a bad value fails before the training
    if cfg.clock == "auto":
        cfg.clock = "cpu" if cfg.device == "cpu" else "wall"
    if cfg.clock not in CLOCKS or (cfg.clock == "cpu" and cfg.device != "cpu"):
        raise SystemExit(f"--clock={cfg.clock!r}: expected one of {sorted(CLOCKS)} (wall on a GPU: the host's CPU "
                         "time does not see the device's work)")
    return cfg


def repeat_factors(spec: str) -> dict:
    """--repeat_scale "1:4,8:2" -> {1: 4, 8: 2}; "" -> {}."""
    out = {}
    for item in filter(None, spec.split(",")):
        b, _, f = item.partition(":")
        if not (b.isdigit() and f.isdigit() and int(b) >= 1 and int(f) >= 1):
            raise SystemExit(f"--repeat_scale={spec!r}: expected comma-separated batch:factor pairs of ints >= 1, "
                             "e.g. 1:4,8:2")
        out[int(b)] = int(f)
    return out


# ------------------------------------------------------------------------------------------ the synthetic language
class PhraseLanguage:
    """Fixed random phrases; after phrase w comes succ[w][0] or succ[w][1] with equal probability."""

    def __init__(self, vocab: int, phrases: int, seed: int):
        g = torch.Generator().manual_seed(seed)
        self.words = [torch.randint(vocab, (int(torch.randint(3, 7, (1,), generator=g)),), generator=g).tolist()
                      for _ in range(phrases)]
        self.succ = torch.randint(phrases, (phrases, 2), generator=g).tolist()

    def sample(self, n: int, length: int, g) -> torch.Tensor:  # (n, length)
        out = []
        for _ in range(n):
            w, seq = int(torch.randint(len(self.words), (1,), generator=g)), []
            while len(seq) < length:
                seq += self.words[w]
                w = self.succ[w][int(torch.randint(2, (1,), generator=g))]
            out.append(seq[:length])
        return torch.tensor(out)


def train_policy(cfg: BenchConfig, lang: PhraseLanguage) -> Transformer:
    torch.manual_seed(cfg.seed)
    policy = Transformer(ModelConfig.preset("small", num_hidden_layers=cfg.layers))
    opt = torch.optim.AdamW(policy.parameters(), lr=3e-3, weight_decay=0.0)
    g = torch.Generator().manual_seed(cfg.seed + 1)
    B, T = cfg.policy_batch, cfg.seq_len
    cu = torch.arange(0, B * T + 1, T, dtype=torch.int32)
    keep = torch.ones(B * T, dtype=torch.bool)
    keep[T - 1:: T] = False  # the last token of each row has no target
    for step in range(cfg.policy_steps):
        for group in opt.param_groups:
            group["lr"] = 3e-3 * min(1.0, (step + 1) / 10)
        x = lang.sample(B, T, g).flatten()
        loss = F.cross_entropy(policy(x, cu).logits[keep], x.roll(-1)[keep])
        opt.zero_grad()
        loss.backward()
        opt.step()
        if step % 20 == 0 or step == cfg.policy_steps - 1:
            print(f"  policy step {step:3d}  loss {loss.item():.3f}")
    return policy.eval()


def train_draft(cfg: BenchConfig, policy: Transformer, lang: PhraseLanguage) -> tuple[Eagle3Draft, dict]:
    """TTT on rollouts the policy sampled itself: taps and teacher logits from one policy forward over them."""
    g = torch.Generator().manual_seed(cfg.seed + 2)
    prompts = list(lang.sample(cfg.draft_rollouts, cfg.prompt_len, g))
    roll = generate(policy, None, prompts, max_new_tokens=cfg.draft_new_tokens, temperature=cfg.temperature,
                    generator=g)
    seqs = torch.stack([torch.cat([p, t]) for p, t in zip(prompts, roll.tokens)])  # (R, L) equal lengths
    draft = Eagle3Draft.from_target(policy)
    opt = torch.optim.AdamW([p for p in draft.parameters() if p.requires_grad], lr=3e-3, weight_decay=0.0)
    B, L = cfg.draft_batch, seqs.shape[1]
    cu = torch.arange(0, B * L + 1, L, dtype=torch.int32)
    for step in range(cfg.draft_steps):
        for group in opt.param_groups:
            group["lr"] = 3e-3 * min(1.0, (step + 1) / 10)
        x = seqs[torch.randint(len(seqs), (B,), generator=g)].flatten()
        with torch.no_grad():
            out = policy(x, cu, tap_layers=draft.tap_layers)
        loss, m = draft.ttt_loss(out.taps, x, cu, out.logits, num_passes=cfg.ttt_passes)
        opt.zero_grad()
        loss.backward()
        opt.step()
        if step % 25 == 0 or step == cfg.draft_steps - 1:
            print(f"  draft step {step:3d}  loss {loss.item():.3f}  alpha {[round(a, 2) for a in m['alpha']]}  "
                  f"tau_hat {m['tau_hat']:.2f}")
    return draft.eval(), m


def cached(cfg, lang):
    """Train (or load) the policy and the draft; the cache key is every training setting."""
    key = f"L{cfg.layers}-p{cfg.phrases}-s{cfg.policy_steps}x{cfg.policy_batch}x{cfg.seq_len}-d{cfg.draft_rollouts}x" \
          f"{cfg.draft_new_tokens}-{cfg.draft_steps}x{cfg.draft_batch}-P{cfg.ttt_passes}-t{cfg.temperature}-{cfg.seed}"
    path = os.path.join(cfg.cache, key)
    if os.path.isfile(os.path.join(path, "draft", "config.json")):
        policy = from_pretrained(os.path.join(path, "policy")).eval()
        with open(os.path.join(path, "draft_metrics.json")) as f:
            return policy, Eagle3Draft.load(os.path.join(path, "draft"), policy).eval(), json.load(f), 0.0
    t0 = time.perf_counter()
    print("training the policy on the phrase language ...")
    policy = train_policy(cfg, lang)
    print("training the draft on the policy's own samples ...")
    draft, metrics = train_draft(cfg, policy, lang)
    save_pretrained(policy, os.path.join(path, "policy"))
    draft.save(os.path.join(path, "draft"))
    with open(os.path.join(path, "draft_metrics.json"), "w") as f:
        json.dump(metrics, f)
    return policy, draft, metrics, time.perf_counter() - t0


# --------------------------------------------------------------------------------------------------- measuring
def drafts(cfg) -> list:
    """[(label, k, tree)]: autoregressive first, then the chains, the adaptive k (ceiling max(ks)), the trees."""
    trees = [tuple(int(b) for b in t.split(",")) for t in cfg.trees.split(":") if t.strip()]
    return ([("AR", 0, None)] + [(f"chain k={k}", k, None) for k in cfg.ks] +
            ([("auto", max(cfg.ks), None)] if cfg.auto else []) +
            [(f"tree {','.join(map(str, t))}", len(t), t) for t in trees])


CLOCKS = {"cpu": time.process_time, "wall": time.perf_counter}


def clock_of(cfg):  # the benchmark's clock; on a GPU it waits for the device's queued work first
    clock = CLOCKS[cfg.clock]
    if cfg.device == "cpu":
        return clock

    def synchronized():
        torch.cuda.synchronize(cfg.device)
        return clock()
    return synchronized


def measure(cfg, policy, draft, prompts, B: int, tau: float) -> list:
    """Every draft at batch B and temperature tau, interleaved (AR, chains, trees, AR, ...), medians of `repeats`."""
    clock = clock_of(cfg)
    adapt = AdaptiveK(max(cfg.ks), clock=clock)  # the auto row's controller: one for all its repeats

    def run(label, k, tree, r):  # -> the stats, tokens per second of `clock`
        t0 = clock()
        st = generate(policy, draft, [prompts[(r * B + i) % len(prompts)] for i in range(B)],
                      max_new_tokens=cfg.max_new_tokens, num_draft_tokens=k if tree is None else 0, temperature=tau,
                      tree=tree, generator=torch.Generator(cfg.device).manual_seed(cfg.seed + r),
                      adapt=adapt if label == "auto" else None).stats
        return st, st.new_tokens / (clock() - t0)

    ds = drafts(cfg)
    res, tps = {label: [] for label, _, _ in ds}, {label: [] for label, _, _ in ds}
    reps = cfg.repeats * repeat_factors(cfg.repeat_scale).get(B, 1)
    for r in range(reps):  # repeat r: the same prompts and sampling seed for every draft, new ones per repeat,
        for label, k, tree in ds[r % len(ds):] + ds[:r % len(ds)]:  # so acceptance averages over prompts and paths
            st, rate = run(label, k, tree, r)  # (one at B = 1 is noisy); the order rotates: no draft always runs last
            res[label].append(st)
            tps[label].append(rate)
    ar, ar_wall = statistics.median(tps["AR"]), statistics.median(s.tokens_per_s for s in res["AR"])
    rows = []
    for label, k, tree in ds[1:]:
        st = res[label]
        sp, sp_wall = statistics.median(tps[label]), statistics.median(s.tokens_per_s for s in st)
        paired = [a / b for a, b in zip(tps[label], tps["AR"])]  # this repeat's spec / this repeat's AR
        acc = statistics.mean(s.acceptance_length for s in st)
        per_pos = [round(statistics.mean(s.accept_per_position[j] for s in st), 3) for j in range(k)]
        rows.append(dict(batch=B, temperature=tau, draft=label, k="auto" if label == "auto" else k,
                         tree=list(tree or ()), nodes=Tree(tree).num_nodes if tree else k, tokens_per_s_ar=round(ar, 1),
                         tokens_per_s_spec=round(sp, 1), speedup=round(sp / ar, 2),
                         speedup_sd=round(statistics.stdev(paired), 3) if len(paired) > 1 else None,
                         speedup_per_repeat=[round(x, 3) for x in paired], repeats=reps,
                         acceptance_length=round(acc, 2),
                         speedup_wall=round(sp_wall / ar_wall, 2), clock=cfg.clock,
                         accept_per_position=per_pos, policy_forwards_ar=res["AR"][0].policy_forwards,
                         policy_forwards_spec=st[0].policy_forwards,
                         **(straggle(st, k, B, cfg.max_new_tokens - 1) if tree is None and label != "auto" else {}),
                         **(dict(k_ceiling=k, auto=adapt.summary()) if label == "auto" else {})))
        print(f"B={B:3d} tau={tau} {label:>16}: AR {ar:8.1f} tok/s  spec {sp:8.1f} tok/s  speedup {sp / ar:5.2f}x "
              f"(sd {rows[-1]['speedup_sd']})  tokens/forward {acc:.2f}  per position {per_pos}" +
              (f"  steps at k=0..{k}: {adapt.chosen}" if label == "auto" else ""))
    return rows


@torch.inference_mode()
def costs(cfg, policy, draft, B: int, reps: int = 20) -> dict:
    """Median ms of a policy forward over S tokens per row (a chain of S-1 drafts, or a tree of S-1 nodes: same
    shapes) after a 64-token prefix, and of one draft level of width n, at batch B."""
    clock = clock_of(cfg)

    def timed(fn):
        ts = []
        for _ in range(reps):
            t0 = clock()
            fn()
            ts.append(clock() - t0)
        return round(1e3 * statistics.median(ts), 3)

    x = torch.randint(policy.cfg.vocab_size, (B, 64), device=cfg.device)
    pcache = policy.new_cache(B, 128)
    out = policy.forward_cached(x, pcache, tap_layers=draft.tap_layers)
    dcache = draft.new_cache(B, 128)
    h, _ = draft.extend(dcache, x, out.taps, torch.full((B,), 63, device=cfg.device))
    L = pcache.lengths.clone()

    def verify(S):
        policy.forward_cached(x[:, :S], pcache, tap_layers=draft.tap_layers)
        pcache.rollback(L)

    def level(n):
        eye = torch.eye(n, dtype=torch.bool, device=cfg.device)  # n siblings: each sees the prefix and itself
        nodes = TreeLayout(torch.zeros(n, dtype=torch.long, device=cfg.device), eye, dcache.lengths.clone(),
                           dcache.max_len).nodes()
        draft.tree_step(dcache, x[:, :n], h[:, None].expand(-1, n, -1), nodes)
        dcache.rollback(dcache.lengths - n)

    return dict(batch=B, policy_forward_ms={S: timed(lambda: verify(S)) for S in (1, 3, 5, 7, 11, 16, 23)},
                draft_level_ms={n: timed(lambda: level(n)) for n in (1, 2, 4, 8)})


def main(cfg: BenchConfig):
    torch.set_num_threads(cfg.threads)
    lang = PhraseLanguage(64, cfg.phrases, cfg.seed)
    policy, draft, metrics, train_s = cached(cfg, lang)  # trained (or loaded) on the CPU
    if cfg.device != "cpu":
        policy = policy.to(cfg.device)
        draft = draft.to(cfg.device)
        draft.attach(policy)  # the shared embedding: `to` copied the draft's reference (Eagle3Draft.attach)
    g = torch.Generator().manual_seed(cfg.seed + 3)
    prompts = list(lang.sample(max(cfg.batches), cfg.prompt_len, g))  # held-out: a fresh generator stream
    greedy = lambda B, k, tree: [a.tolist() for a in generate(  # noqa: E731
        policy, draft, prompts[:B], max_new_tokens=cfg.max_new_tokens, num_draft_tokens=k if tree is None else 0,
        temperature=0.0, tree=tree).tokens]
    exact = all(greedy(B, 0, None) == greedy(B, k, tree) for B in cfg.batches[:2] for _, k, tree in drafts(cfg)[1:])
    print(f"greedy speculative (chains and trees) == autoregressive: {exact}")
    generate(policy, draft, prompts[:1], max_new_tokens=cfg.max_new_tokens, num_draft_tokens=max(cfg.ks))  # warm-up
    rows, load = [], os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    for B in cfg.batches:
        rows += measure(cfg, policy, draft, prompts, B, cfg.temperature)
    for B in [b for b in cfg.batches if b in cfg.hot_batches] if cfg.hot_temperature > 0 else []:
        rows += measure(cfg, policy, draft, prompts, B, cfg.hot_temperature)
    cost = [costs(cfg, policy, draft, B) for B in cfg.batches]
    for c in cost:
        print(f"B={c['batch']:3d}: policy forward ms by tokens per row {c['policy_forward_ms']}; draft level ms by "
              f"width {c['draft_level_ms']}")
    best = {}
    for r in rows:  # the best chain and the best tree per (batch, temperature)
        key = (r["batch"], r["temperature"], r["draft"].split()[0])
        if key not in best or r["speedup"] > best[key]["speedup"]:
            best[key] = r
    chain = max((r for r in rows if r["tree"] == [] and r["k"] != "auto"), key=lambda r: r["speedup"])
    result = dict(
        config=asdict(cfg), rows=rows, costs=cost, best_speedup=chain["speedup"],
        best=dict(batch=chain["batch"], k=chain["k"]),
        best_per_batch=[dict(batch=b, temperature=t, kind=kind, draft=r["draft"], speedup=r["speedup"],
                             tokens_per_forward=r["acceptance_length"]) for (b, t, kind), r in best.items()],
        equal_depth=equal_depth(rows), auto_targets=auto_targets(rows), greedy_exact=exact,
        draft_train_metrics=metrics, train_seconds=round(train_s, 1),
        machine=dict(platform=platform.platform(), cpus=os.cpu_count(), threads=cfg.threads, device=cfg.device,
                     gpu=torch.cuda.get_device_name(cfg.device) if cfg.device != "cpu" else None,
                     torch=torch.__version__, load_avg_1min_at_start=load),
        policy_parameters=sum(p.numel() for p in policy.parameters()),
        draft_parameters=sum(p.numel() for p in draft.parameters()))
    table = "\n\n".join([markdown(rows), markdown_costs(cost), markdown_depth(result["equal_depth"]),
                          markdown_straggle(rows)] +
                          ([markdown_auto(result["auto_targets"])] if cfg.auto else []))
    print("\n" + table)
    os.makedirs(os.path.dirname(cfg.out), exist_ok=True)
    with open(cfg.out, "w") as f:
        json.dump(result, f, indent=2)
    with open(os.path.splitext(cfg.out)[0] + ".md", "w") as f:
        f.write(table + "\n")
    print(f"best chain speedup {chain['speedup']}x (B={chain['batch']}, k={chain['k']}); wrote {cfg.out}")
    return result


def markdown(rows) -> str:
    head = ("| batch | tau | draft | nodes | AR tok/s | spec tok/s | speedup | tokens / policy forward | "
            "acceptance per depth |\n|---:|---:|---|---:|---:|---:|---:|---:|---|")
    body = [f"| {r['batch']} | {r['temperature']:g} | {r['draft']} | {r['nodes']} | {r['tokens_per_s_ar']:.0f} | "
            f"{r['tokens_per_s_spec']:.0f} | **{r['speedup']:.2f}x** ± {r['speedup_sd'] or 0:.2f} | "
            f"{r['acceptance_length']:.2f} | "
            f"{', '.join(f'{a:.2f}' for a in r['accept_per_position'])} |" for r in rows]
    return "\n".join([head] + body)


def straggle(st: list, k: int, B: int, left: int) -> dict:
    """A fixed-k chain's calls against the slowest-row model (decoding/call_model.py): the verification steps a call
    took (its slowest row's), the mean row's, the rows' spread rho (row_spread over each call's per-row drafts tried /
    accepted, rho^2 averaged over the calls), and the model's steps for alike rows and at that rho, from the calls'
    mean per-position acceptance and `left` = max_new_tokens - 1 tokens after the prefill's."""
    al = [statistics.mean(x.accept_per_position[j] for x in st) for j in range(k)]
    rho = math.sqrt(max(statistics.mean(row_spread(x.row_tried, x.row_accepted, al)[0] for x in st), 0.0))
    return dict(call_steps=round(statistics.mean(x.policy_forwards for x in st), 2),
                row_steps=round(statistics.mean(statistics.mean(x.row_forwards) for x in st), 2), rho=round(rho, 3),
                model_steps_alike=round(call_steps(al, k, left, B), 2),
                model_steps=round(call_steps(al, k, left, B, rho), 2))


def markdown_straggle(rows) -> str:
    head = ("| batch | tau | k | steps of a call | of the mean row | rho | model, alike rows | model at rho |\n"
            "|---:|---:|---:|---:|---:|---:|---:|---:|")
    body = [f"| {r['batch']} | {r['temperature']:g} | {r['k']} | {r['call_steps']:.1f} | {r['row_steps']:.1f} | "
            f"{r['rho']:.3f} | {r['model_steps_alike']:.1f} | {r['model_steps']:.1f} |" for r in rows if "rho" in r]
    return "\n".join([head] + body + ["\n(verification steps per generate call, means over the repeats; "
                                       "decoding/call_model.py's model of the slowest row)"])


def equal_depth(rows) -> list:
    """Tokens per policy forward at equal depth: at the largest batch measured (the most rows, the least noise) and
    each temperature, the chain of k against the tree of depth k that keeps the most tokens per forward."""
    B, out = max(r["batch"] for r in rows), []
    for tau in sorted({r["temperature"] for r in rows if r["batch"] == B}):
        at = [r for r in rows if r["batch"] == B and r["temperature"] == tau and r["k"] != "auto"]
        for c in (r for r in at if not r["tree"]):
            trees = [r for r in at if len(r["tree"]) == c["k"]]
            if trees:
                t = max(trees, key=lambda r: r["acceptance_length"])
                out.append(dict(batch=B, temperature=tau, depth=c["k"], chain=c["acceptance_length"], tree=t["draft"],
                                tree_tokens=t["acceptance_length"], gain=round(t["acceptance_length"] /
                                                                               c["acceptance_length"] - 1, 3)))
    return out


def auto_targets(rows) -> dict:
    """Per (batch, tau): auto against the best fixed chain k (paired per repeat) and against autoregressive; the
    geometric means across rows."""
    out = []
    for a in (r for r in rows if r["k"] == "auto"):
        fixed = [r for r in rows if (r["batch"], r["temperature"]) == (a["batch"], a["temperature"])
                 and r["tree"] == [] and r["k"] != "auto"]
        best = max(fixed, key=lambda r: r["speedup"])
        diff = [x - y for x, y in zip(a["speedup_per_repeat"], best["speedup_per_repeat"])]
        sd_diff = statistics.stdev(diff) if len(diff) > 1 else 0.0
        out.append(dict(batch=a["batch"], temperature=a["temperature"], best_k=best["k"], best=best["speedup"],
                        best_heldout=heldout_best(fixed),
                        best_sd=best["speedup_sd"], auto=a["speedup"], auto_sd=a["speedup_sd"],
                        diff_sd=round(sd_diff, 3), steps_at_k=a["auto"]["steps_at_k"], k_mode=a["auto"]["k_mode"],
                        k_mean=a["auto"]["k_mean"], alpha=a["auto"]["alpha"],
                        vs_best_ok=a["speedup"] >= best["speedup"] - 2 * sd_diff,
                        vs_ar_ok=a["speedup"] >= 1.0 - 2 * (a["speedup_sd"] or 0.0)))
    if not out:
        return dict(rows=[])
    gm = lambda xs: math.exp(statistics.mean(math.log(x) for x in xs))  # noqa: E731
    g_auto, g_best = gm([t["auto"] for t in out]), gm([t["best"] for t in out])
    g_held = gm([t["best_heldout"] for t in out])  # against auto's own median paired speedup, the same statistic
    g_paired = gm([statistics.median(a["speedup_per_repeat"]) for a in rows if a["k"] == "auto"])
    return dict(rows=out, geomean_auto=round(g_auto, 3), geomean_best_fixed=round(g_best, 3),
                geomean_best_heldout=round(g_held, 3), geomean_auto_paired=round(g_paired, 3),
                geomean_ok=g_auto >= 0.98 * g_best)


def heldout_best(fixed) -> float:
    """The best fixed k chosen on half the repeats (even or odd) and measured on the other half (the median of its
    paired per-repeat speedups), the two ways averaged: the best of several noisy columns picked on the same repeats
    it is scored on is biased upwards (its noise picked it), this is not."""
    n = len(fixed[0]["speedup_per_repeat"])
    if n < 4:
        return max(r["speedup"] for r in fixed)
    med = lambda r, h: statistics.median(r["speedup_per_repeat"][h::2])  # noqa: E731
    return round(statistics.mean(med(max(fixed, key=lambda r: med(r, h)), 1 - h) for h in (0, 1)), 3)


def markdown_auto(t) -> str:
    head = ("| batch | tau | best fixed k | its speedup | auto speedup | sd of auto - best | steps at k = 0..K | "
            "k auto ran most | auto >= best - 2 sd | auto >= 1 - 2 sd |\n"
            "|---:|---:|---:|---:|---:|---:|---|---:|---|---|")
    body = [f"| {r['batch']} | {r['temperature']:g} | {r['best_k']} | {r['best']:.2f}x ± {r['best_sd']:.2f} | "
            f"**{r['auto']:.2f}x** ± {r['auto_sd']:.2f} | {r['diff_sd']:.2f} | {r['steps_at_k']} | {r['k_mode']} | "
            f"{'yes' if r['vs_best_ok'] else 'NO'} | {'yes' if r['vs_ar_ok'] else 'NO'} |" for r in t["rows"]]
    foot = (f"geometric mean of the speedups: auto {t['geomean_auto']:.3f}, per-row best fixed k "
            f"{t['geomean_best_fixed']:.3f} (auto >= 0.98 x best: {'yes' if t['geomean_ok'] else 'NO'}; the best "
            f"fixed k chosen on half the repeats, measured on the other half: {t['geomean_best_heldout']:.3f}, against "
            f"auto's {t['geomean_auto_paired']:.3f}, both medians of the paired per-repeat speedups); ± is the "
            "standard deviation over repeats of the paired per-repeat speedup") if t["rows"] else ""
    return "\n".join([head] + body) + "\n\n" + foot


def markdown_depth(eq) -> str:
    head = ("| batch | tau | depth | chain tokens / forward | best tree of that depth | tree tokens / forward | "
            "gain |\n|---:|---:|---:|---:|---|---:|---:|")
    body = [f"| {e['batch']} | {e['temperature']:g} | {e['depth']} | {e['chain']:.2f} | {e['tree']} | "
            f"{e['tree_tokens']:.2f} | {e['gain']:+.1%} |" for e in eq]
    return "\n".join([head] + body)


def markdown_costs(cost) -> str:
    S, n = list(cost[0]["policy_forward_ms"]), list(cost[0]["draft_level_ms"])
    head = ("| batch | " + " | ".join(f"policy fwd S={s}" for s in S) + " | " +
            " | ".join(f"draft level n={w}" for w in n) + " |\n|---:|" + "---:|" * (len(S) + len(n)))
    body = [f"| {c['batch']} | " + " | ".join(f"{v:.2f}" for v in c["policy_forward_ms"].values()) + " | " +
            " | ".join(f"{v:.2f}" for v in c["draft_level_ms"].values()) + " |" for c in cost]
    return "\n".join([head] + body) + "\n\n(milliseconds, median; S = tokens per row in one verification forward)"


if __name__ == "__main__":
    from parallel.cli import run_main  # an error: one line, exit 1 (COSPEC_TRACEBACK=1: the traceback)
    run_main(lambda: main(parse_args(sys.argv[1:])), __file__)
