"""A reduced draft vocabulary (EAGLE-3): the draft's LM head names only the N target tokens the policy writes most.

    ids    = the N most frequent target ids among the warm-up samples' *response* tokens (ties: the lower id first;
             ids never seen fill the remaining places in id order), sorted ascending
    d2t[v] = ids[v] - v          (Vd,) int64: draft id v proposes target id v + d2t[v] (EAGLE-3 and the engines
    t2d[x] = x in ids            (V,) bool    store offsets, not ids)

Why: the draft's head is H x Vd and its softmax O(Vd) per proposal; with a 150k-token target vocabulary that head is
most of a one-layer draft's cost. The price: a target token outside `ids` is never proposed (q = 0 there), so a
position whose teacher puts its mass outside `ids` cannot be accepted. The TTT loss renormalises the teacher over
`ids` and the acceptance metrics compare against the full teacher (draft.py), so the loss is measured honestly.
`coverage` is the share of response tokens inside `ids`: an upper bound on how often a greedy draft can be right.

    python -m serving.draft_vocab        # the built-in task's counts, coverage at a few N

Letters: V target vocab, Vd draft vocab (N).
"""
from __future__ import annotations

import torch


def count_tokens(responses, vocab_size: int) -> torch.Tensor:
    """(V,) int64 occurrences of each target id in `responses` (1-D id tensors: the generated tokens, EOS included)."""
    counts = torch.zeros(vocab_size, dtype=torch.long)
    for r in responses:
        r = torch.as_tensor(r, dtype=torch.long).flatten().cpu()
        if r.numel() and (int(r.min()) < 0 or int(r.max()) >= vocab_size):
            raise ValueError(f"responses: token ids must lie in [0, {vocab_size}), got {int(r.min())}..{int(r.max())}")
        counts += torch.bincount(r, minlength=vocab_size)
    return counts


def select_draft_vocab(responses, vocab_size: int, n: int) -> torch.Tensor:
    """(n,) int64 ascending: the n most frequent target ids of `responses` (see the module docstring)."""
    if not 1 <= n <= vocab_size:
        raise ValueError(f"draft_vocab={n}: expected 1..{vocab_size} (the target vocabulary; 0 means full, no "
                         "selection)")
    counts = count_tokens(responses, vocab_size)
    # sort by (-count, id): stable sort on -count of ids already in ascending order
    order = torch.sort(-counts, stable=True).indices
    return order[:n].sort().values


def maps(ids: torch.Tensor, vocab_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """ids (Vd,) distinct ascending target ids -> d2t (Vd,) int64 offsets, t2d (V,) bool."""
    d2t = ids.long() - torch.arange(ids.numel(), device=ids.device)
    t2d = torch.zeros(vocab_size, dtype=torch.bool, device=ids.device)
    t2d[ids] = True
    return d2t, t2d


def coverage(ids: torch.Tensor, responses) -> float:
    """Share of the response tokens that the draft vocabulary `ids` contains."""
    rs = [torch.as_tensor(r, dtype=torch.long).flatten().cpu() for r in responses]
    inside = sum(int(torch.isin(r, ids.cpu()).sum()) for r in rs)
    return inside / max(sum(r.numel() for r in rs), 1)


if __name__ == "__main__":
    from parallel.cli import answer_help
    answer_help(__doc__, __file__)  # -h / --help: usage and summary from the docstring, exit 0
    import random

    from tasks import task
    tok, src = task.Tokenizer(), task.ProblemSource(4, 7)
    rng = random.Random(0)
    resp = [task.encode_demo(tok, p, 0.7, rng) for p in src.sample(512, rng, "train")]
    resp = [x[n:] for x, n in resp]  # response tokens only
    for n in (4, 8, 12, 16, tok.vocab_size):
        ids = select_draft_vocab(resp, tok.vocab_size, n)
        print(f"N = {n:3d} of V = {tok.vocab_size}: coverage of demo response tokens {coverage(ids, resp):.3f}")
