"""The drafter protocol: what a draft family gives the rollout engine, the co-training step and the serving export.

cospec trains three draft families through one design (the policy's detached taps in, a loss against the policy's
own distribution out; proposals verified by one lossless chain rule). Every family -- EAGLE-3 (draft.py, multi-pass
TTT), DFlash (draft_dflash.py, a block drafted in one forward) and DSpark (draft_dspark.py, DFlash plus a Markov
head) -- is an nn.Module with these members, and the engine (speculative.py), the pipeline's draft hook and
DistCotrainer (dist_step.py), rl_loop's draft loss, the warm-up, the control arms and the export speak to them alone:

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
                                   q); the cache is unchanged afterwards
    save(path), load(path, policy) (classmethod)          its checkpoint (config.json names the family)
    check_exportable(), export(path, dtype=, **kw)         the serving format (a ValueError says why one cannot be)

`select_rows(state, rows)` compacts a state with the batch (every family's state is rows-first; decoding/draft_trunk.py
compacts the engine's with it). The registry that maps `--drafter eagle3|dflash|dspark` to a family is
harness/drafters.py.

    python drafter.py --help
"""
from __future__ import annotations

import torch

from decoding.draft_trunk import select_rows  # noqa: F401  (part of the protocol's surface)
from decoding.spec_rule import sample

PROTOCOL = ("tap_layers", "max_draft_tokens", "attach", "fresh", "loss", "loss_options", "new_cache", "extend",
            "propose", "save", "load", "check_exportable", "export")


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


if __name__ == "__main__":
    from parallel.cli import answer_help
    answer_help(__doc__, __file__)
