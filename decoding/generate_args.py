"""The checks of speculative.generate's arguments (prompts, budgets, k, temperature, eos_id, the draft's shape)."""
from __future__ import annotations

import torch

from decoding import speculative_tree


def check_generate_args(target, draft, prompts, max_new_tokens: int, k: int, temperature: float, eos_id=None):
    """Every argument of speculative.generate that could make it fail late or answer wrongly, checked up front: a
    ValueError / TypeError naming the argument and what was expected."""
    if not isinstance(prompts, (list, tuple)) or len(prompts) == 0:
        raise ValueError("prompts: expected a non-empty list of 1-D token tensors")
    for i, p in enumerate(prompts):
        if not isinstance(p, torch.Tensor) or p.dtype not in (torch.int32, torch.int64):
            raise TypeError(f"prompts[{i}]: expected an integer token tensor, got {type(p).__name__} "
                            f"{getattr(p, 'dtype', '')}")
        if p.dim() != 1 or p.numel() == 0:
            raise ValueError(f"prompts[{i}]: expected a non-empty 1-D tensor, got shape {tuple(p.shape)}")
    if max_new_tokens < 0:
        raise ValueError(f"max_new_tokens={max_new_tokens}: expected >= 0")
    if k < 0:
        raise ValueError(f"num_draft_tokens={k}: expected >= 0")
    if not temperature >= 0:
        raise ValueError(f"temperature={temperature}: expected >= 0 (0 = greedy)")
    if not (target.is_first and target.is_last):
        raise ValueError("target: generation needs the whole policy, not a pipeline-stage slice")
    V = target.cfg.vocab_size
    if not all(isinstance(i, int) and not isinstance(i, bool) and 0 <= i < V for i in eos_list(eos_id)):
        raise ValueError(f"eos_id={eos_id!r}: expected an int token id in [0, vocab_size={V}), a list or tuple of "
                         "them, or None (a row would never stop at an id the policy cannot sample)")
    ids = torch.cat(list(prompts))  # one min/max for the whole batch: two host syncs, not two per prompt
    if int(ids.min()) < 0 or int(ids.max()) >= V:
        i = next(i for i, p in enumerate(prompts) if int(p.min()) < 0 or int(p.max()) >= V)
        raise ValueError(f"prompts[{i}]: token ids must lie in [0, vocab_size={V}), got min {int(prompts[i].min())} "
                         f"max {int(prompts[i].max())}")
    if draft is not None:
        c, dc = target.cfg, draft.cfg
        if dc.vocab_size != c.vocab_size:
            raise ValueError(f"draft: vocab_size={dc.vocab_size} does not match the target's vocab_size={c.vocab_size}")
        if dc.hidden_size != c.hidden_size or dc.target_num_layers != c.num_hidden_layers:
            raise ValueError(f"draft: built for hidden_size={dc.hidden_size} / {dc.target_num_layers} layers, the "
                             f"target has {c.hidden_size} / {c.num_hidden_layers}")


def eos_list(eos_id) -> list:
    """generate's eos_id -> the ids that end a row: None -> [], a list or tuple -> its items, anything else -> [it]
    (check_generate_args then checks each is an int token id)."""
    if eos_id is None:
        return []
    return list(eos_id) if isinstance(eos_id, (list, tuple)) else [eos_id]


def draft_shape(draft, tree, num_draft_tokens: int, adapt=None):
    """What speculative.generate drafts -> (speculative_tree.Tree or None for a chain, k the most draft tokens a
    step proposes; 0: plain sampling). A ValueError for a combination the draft cannot run."""
    if adapt is not None and (draft is None or tree):
        raise ValueError("adapt: expected a chain draft (a draft, and tree=None: a tree keeps its fixed shape)")
    K = None if draft is None else draft.max_draft_tokens  # drafter.py: None for a chain drafter
    if K is not None and (tree or adapt is not None or num_draft_tokens > K):
        raise ValueError(f"num_draft_tokens={num_draft_tokens}, tree={tree}, adapt={adapt}: a block drafter proposes "
                         f"k <= {K} tokens in one forward, as a chain (no tree, no adaptive k)")
    tree = speculative_tree.Tree(tree) if tree else None
    if tree is not None and num_draft_tokens not in (0, tree.k):
        raise ValueError(f"num_draft_tokens={num_draft_tokens}: with tree={tree.branching} expected 0 or {tree.k}")
    k = (tree.k if tree is not None else num_draft_tokens) if draft is not None else 0
    return (tree if k else None), k  # no draft: plain sampling
