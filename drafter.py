"""The drafter protocol: what a draft family gives the rollout engine, the co-training step and the serving export.

cospec trains three draft families through one design (the policy's detached taps in, a loss against the policy's
own distribution out; proposals verified by one lossless chain rule). Every family -- EAGLE-3 (draft.py, multi-pass
TTT), DFlash (draft_dflash.py, a block drafted in one forward) and DSpark (draft_dspark.py, DFlash plus a Markov
head) -- is an nn.Module with these members, and the engine (speculative.py), the pipeline's draft hook and
DistCotrainer (dist_step.py), rl_loop's draft loss, the warm-up, the control arms and the export speak to them alone:

    cfg                            its config: vocab_size, hidden_size, target_num_layers (generate checks the policy)
    tap_layers                     the policy layers whose outputs the draft reads (TapChannel carries them under PP)
    max_draft_tokens               None: a chain drafter (any k, tree drafts, adaptive k); K: a block drafter, which
                                   proposes k <= K tokens in one forward (no tree, no adaptive k)
    attach(policy)                 share the policy's embedding (and LM head) detached; again after a re-assembly
    fresh(policy)                  an untrained draft of the same shape (taps, vocabulary, block) for `policy`
    loss(taps, tokens, cu_seqlens, teacher..., loss_mask=, position_ids=, group=, attn_fn=, backend=, chunk=,
         **loss_options(trainer)) -> (loss, metrics)
                                   the training loss on detached taps (this rank's share under CP); metrics per draft
                                   position j: acc, acc_cond, alpha, count, n_cond, loss_per_pass, tau_hat
                                   (draft_ttt.merge_metrics pools them)
    loss_options(trainer)          the family's loss keywords, read from a rl_loop.DraftTrainer
    new_cache(batch, max_len, block=None)                  the draft's own KV cache (modeling/kv_cache.KVCache)
    extend(cache, tokens, taps, last) -> state             append the verified entries: entry j of row b is (the token
                                   after position j, the taps at j); row b keeps entries 0..last[b]. `state` is a
                                   tuple of (b, ...) tensors: whatever `propose` needs next
    propose(cache, state, k, temperature, generator) -> d (b, k), q (b, k, V) or None (tau = 0)
                                   k tokens and the distributions they were ACTUALLY sampled from (the accept rule's
                                   q); the cache is unchanged afterwards. A block drafter may cut rows short: d, q,
                                   lengths (b,), row b proposing d[b, :lengths[b]], d k' <= k wide (DSpark's
                                   confidence cut; speculative.verify never accepts past a row's length)
    save(path), load(path, policy) (classmethod)          its checkpoint (config.json names the family)
    check_exportable(), export(path, dtype=, **kw)         the serving format (a ValueError says why one cannot be)

The family's class answers what the harness asks before any draft exists (FAMILY; harness/drafters.py's registry
checks them when a family registers):

    from_target(policy, tap_layers=, **options)            a fresh draft (the options: the registry row's build_keys)
    kind                           "chain" or "block" (what max_draft_tokens says of a draft, known before one exists)
    architecture, config_class()   the name its save() writes in config.json, and its config dataclass
    default_taps(n_layers, cfg)    --tap_layers='': the family's rule; taps_ok(taps, n) / taps_rule: which taps it
                                   takes (ascending distinct layer ids, checked first) and the rule in words
    of_shape(model_cfg, cfg, taps) an unallocated draft of the run's shape (harness/memory_model counts it on meta)
    cache_shape(cfg)               the rollout's draft KV cache: (layers, slots beyond the policy's)
    act_bytes(size, cfg, T, n_taps, seqs)                  what one trained draft saves for backward (memory plan)
    size_flags(cfg)                the flags that size its copy (the fit check's hint)
    check_file(path, fmt), from_fields(fields, sd, path, n_layers) -> (config, tensors)    --draft in a served format
    a block family also: fitted_block(k) (the W --block_size=0 fits to k), slots_drafted(W) (its most k), and the
    two rules in words, fit_rule and slots_rule (the config's messages)

`select_rows(state, rows)` compacts a state with the batch (every family's state is rows-first; decoding/draft_trunk.py
compacts the engine's with it). The registry that maps `--drafter eagle3|dflash|dspark` to a family is
harness/drafters.py.

A family in miniature (`demo`, each family file's `__main__`): `teach(draft, policy)` trains a fresh draft through
`loss` alone on a confident tiny policy's own samples (`demo_policy`, `policy_samples`) and returns its metrics on
held-out samples before and after -- the predicted acceptance length tau_hat rises as the draft learns;
`demo_proposal` then drafts k tokens through `extend` and `propose`.

    python drafter.py --help
    python draft.py            # EAGLE-3's TTT learning: acceptance before and after (also draft_dflash.py, ...)
"""
from __future__ import annotations

import torch

from decoding.draft_trunk import select_rows  # noqa: F401  (part of the protocol's surface)
from decoding.spec_rule import sample
from model import ModelConfig, Transformer

PROTOCOL = ("tap_layers", "max_draft_tokens", "attach", "fresh", "loss", "loss_options", "new_cache", "extend",
            "propose", "save", "load", "check_exportable", "export")


FAMILY = ("from_target", "kind", "architecture", "config_class", "default_taps", "taps_ok", "taps_rule", "of_shape",
          "cache_shape", "act_bytes", "size_flags", "check_file", "from_fields")
BLOCK_FAMILY = ("fitted_block", "slots_drafted", "fit_rule", "slots_rule")


def check_family(cls) -> None:
    """A ValueError naming the first class-level member (FAMILY) a family's class lacks."""
    kind = getattr(cls, "kind", None)
    if kind not in ("chain", "block"):
        raise ValueError(f"draft class {cls.__name__}: kind={kind!r}, expected 'chain' or 'block' (drafter.py)")
    missing = [m for m in PROTOCOL + FAMILY + BLOCK_FAMILY * (kind == "block") if not hasattr(cls, m)]
    if missing:
        raise ValueError(f"draft class {cls.__name__} lacks the drafter protocol's {missing} (drafter.py)")


def check_drafter(draft) -> None:
    """A ValueError naming the first protocol member `draft` lacks (a family that forgot one fails at build time)."""
    missing = [m for m in PROTOCOL if not hasattr(draft, m)]
    if missing:
        raise ValueError(f"draft: {type(draft).__name__} lacks the drafter protocol's {missing} (drafter.py)")


def propose_chain(step, h, zq, k: int, temperature: float, generator):
    """A chain drafter's k proposals: d_j ~ q_j(. | d_<j) from the state (h, zq) at the last verified position, one
    `step(d_j, h) -> (h, zq)` per further token. Returns d (b, k) and q (b, k, V) (None at tau = 0)."""
    ds, qs = [], []
    for j in range(k):
        dj, qj = sample(zq, temperature, generator)
        ds.append(dj)
        qs.append(qj)
        if j < k - 1:
            h, zq = step(dj, h)
    return torch.stack(ds, 1), (torch.stack(qs, 1) if temperature > 0 else None)


# ---- a family in miniature: the demos of draft.py, draft_dflash.py and draft_dspark.py ----------------------------

def demo_policy(seed: int = 0, sharpness: float = 16.0) -> Transformer:
    """The `tiny` policy, seeded, its final norm scaled by `sharpness` (every logit times sharpness): a random policy is
    nearly flat, so any flat q overlaps it and a draft has little to learn. At x16 its top token has p ~ 0.23 on
    average (uniform: 1/97)."""
    torch.manual_seed(seed)
    policy = Transformer(ModelConfig.preset("tiny")).eval()
    with torch.no_grad():
        policy.model.norm.weight.mul_(sharpness)
    return policy


@torch.no_grad()
def policy_samples(policy, n: int, length: int, seed: int):
    """n sequences of `length` tokens sampled from the policy at tau = 1 (the rollouts a draft co-trains on), from a
    random first token; token 0 never (the block drafters' MASK in the demos). Returns tokens (n * length,) and
    cu_seqlens (n + 1,) int32."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(1, policy.cfg.vocab_size, (n, 1), generator=g)  # (n, 1)
    cache = policy.new_cache(n, length)
    for _ in range(length - 1):
        z = policy.forward_cached(x[:, -1:], cache).logits[:, -1].float()  # (n, V)
        z[:, 0] = -float("inf")
        x = torch.cat([x, torch.multinomial(z.softmax(-1), 1, generator=g)], 1)
    return x.flatten(), torch.arange(0, n * length + 1, length, dtype=torch.int32)


def teach(draft, policy, *, steps: int = 300, batch: int = 8, length: int = 32, pool: int = 256, held_out: int = 32,
          lr: float = 1e-2, seed: int = 0, **loss_kw) -> tuple:
    """Train `draft` by its family's `loss` alone on `policy`'s own samples -- the taps and the teacher logits of one
    policy forward, as co-training gets them -- for `steps` AdamW steps of `batch` sequences drawn in turn from a
    pool of `pool`. Returns (before, after): the loss's metrics on `held_out` other samples (tau_hat, the predicted
    acceptance length at tau = 1; alpha and acc per draft position)."""
    def forward(n, s):  # n sampled sequences -> (taps {layer: (T, H)}, tokens (T,), cu_seqlens, teacher logits (T, V))
        tokens, cu = policy_samples(policy, n, length, s)
        with torch.no_grad():
            out = policy(tokens, cu, tap_layers=draft.tap_layers)
        return out.taps, tokens, cu, out.logits

    def metrics(data):
        with torch.no_grad():
            return draft.loss(*data, **loss_kw)[1]

    taps, tokens, _, logits = forward(pool, seed)
    held = forward(held_out, seed + 1)
    cu = torch.arange(0, batch * length + 1, length, dtype=torch.int32)  # every sequence is `length` long
    opt = torch.optim.AdamW(draft.parameters(), lr=lr)
    before = metrics(held)
    for step in range(steps):
        first = (step * batch) % (pool - batch + 1)  # the pool in turn
        rows = slice(first * length, (first + batch) * length)
        loss, _ = draft.loss({l: t[rows] for l, t in taps.items()}, tokens[rows], cu, logits[rows], **loss_kw)
        opt.zero_grad()
        loss.backward()
        opt.step()
    return before, metrics(held)


@torch.no_grad()
def demo_proposal(draft, policy, tokens, k: int, temperature: float = 0.0, seed: int = 0) -> list:
    """k tokens the draft proposes after `tokens` (1-D, the policy's taps computed here): `extend` over the prefix,
    then one `propose`."""
    n = tokens.numel()
    out = policy(tokens, torch.tensor([0, n], dtype=torch.int32), tap_layers=draft.tap_layers)
    cache = draft.new_cache(1, n + k + 1)
    state = draft.extend(cache, tokens[None, 1:], {l: t[None, :-1] for l, t in out.taps.items()},
                         torch.tensor([n - 2]))
    return draft.propose(cache, state, k, temperature, torch.Generator().manual_seed(seed))[0][0].tolist()


def demo(name: str, make, *, k: int, temperature: float = 0.0, steps: int = 300, **loss_kw) -> tuple:
    """A family's demo: make(policy) -> a fresh draft on demo_policy(); teach it `steps` steps and print tau_hat,
    alpha and top-1 agreement per draft position before and after, then k proposed tokens. Returns (before, after)."""
    torch.set_num_threads(1)  # tensors this small gain nothing from a second thread, which spin-waits on a busy core
    policy = demo_policy()
    draft = make(policy)
    print(f"{name} draft on the tiny policy (its logits sharpened): taps {draft.tap_layers}, "
          f"{sum(p.numel() for p in draft.parameters()):,} parameters;\n{steps} steps of its loss on the policy's own "
          f"samples (tau = 1): taps and teacher from one policy forward, as in co-training")
    before, after = teach(draft, policy, steps=steps, **loss_kw)
    for tag, m in (("before", before), ("after", after)):
        print(f"  {tag:>6}: tau_hat {m['tau_hat']:.2f} | per position alpha {[round(a, 2) for a in m['alpha']]}, "
              f"top-1 agreement {[round(a, 2) for a in m['acc']]}")
    print("  (on held-out samples; tau_hat = 1 + sum_k prod_{j<=k} alpha_j is the predicted acceptance length at "
          "tau = 1,\n  alpha_j = E sum_x min(p, q) at draft position j; 1.00 would be no speedup)")
    prefix = policy_samples(policy, 1, 9, seed=7)[0]
    print(f"  {k} tokens proposed after {prefix.tolist()}: {demo_proposal(draft, policy, prefix, k, temperature)}")
    return before, after


if __name__ == "__main__":
    from parallel.cli import answer_help
    answer_help(__doc__, __file__)
