"""Block drafts' training (DFlash, DSpark): seeded anchors, one block per anchor, the loss streamed over the vocabulary.

A block drafter (draft_dflash.py) is trained on blocks [x_a, MASK x (W - 1)] at positions a..a+W-1, one per sampled
anchor a. Slot k of the block predicts the token `shift` positions past its own, x_{a+k+shift} (DFlash: shift 0, slots
1..W-1; DSpark: shift 1, slots 0..W-1); its teacher is the policy's distribution at a+k+shift-1, the position that
predicts that token. With j = 1..P numbering the trained slots and m_{a,j} = 1 when x_{a+k_j+shift} is a response
token (else 0):

    L = sum_{a,j} w_j m_{a,j} CE(p_{a+k_j+shift-1}, q_{a,k_j}) / sum_{a,j} m_{a,j},
    w_j = exp(-(j - 1) / gamma)                                           (DFlash [arXiv 2602.06036])

one mean over every trained (anchor, slot) pair of the batch, as speculators' loss_function normalises it (the
weighted sum over the count of pairs, not over the weights' sum, nor a mean per slot).

streamed by draft_loss.StreamingSoftCE (no (anchors * W, V) tensor), against the policy's LM head shared with the
draft. Slots past a sequence's end are masked (cp_shift's valid), never wrapped. Under CP a block's targets at a+k may
live on the next rank: they are read through draft_loss's halo and teacher_index, as TTT's i+d are.

Anchors: up to `anchors` per sequence among the positions a where x_a and x_{a+1} are both response tokens (loss_mask
at a - 1 and at a): the blocks inference drafts, whose first slot is a token the policy sampled (speculative.prefill
starts the first block at the first response token, never at the last prompt token), with at least one trained slot.
As speculators' select_anchors, anchors only where x_a is a response token; unlike it, a block near a response's end
is kept (inference drafts it too), its slots past the end masked. Chosen by the smallest keys of a counter hash of
(seed, the sequence's content, the position): the same anchors on every mesh (cp, pp, dp), since a key depends on no
layout; under CP the per-sequence threshold is agreed over the ring (each rank sends its `anchors` smallest keys per
sequence).

gamma by block size: 4 for W = 8, 5 for W = 10, 7 for W = 16 (the paper's); between and beyond them the piecewise
linear interpolation of those three points (slope 1/2 below 10, 1/3 above), at least 1.

Letters: T packed tokens (this rank's), S sequences, N anchors (this rank's), W block size, H hidden, V vocab.
"""
from __future__ import annotations

import math

import torch

from branch_mask import cp_shift, cu_local, position_ids, seq_ids, shift_packed, zigzag_shard
from parallel.host_copy import host_cu
from draft_loss import StreamingSoftCE, chunk_rows, make_teacher, ring_sum, teacher_index
from draft_ttt import pad_inputs, position_metrics
from parallel.ring import as_ring

_BIG = 1 << 62  # the key of a position that cannot be an anchor


def default_gamma(W: int) -> float:
    """The position-weight decay gamma for block size W (module docstring)."""
    if W <= 10:
        return max(1.0, 4.0 + (W - 8) / 2)
    return 5.0 + (W - 10) / 3


def _mix(x: torch.Tensor) -> torch.Tensor:  # int64 -> int64 in [0, 2^62): a splitmix-style counter hash
    x = x & ((1 << 62) - 1)
    for m in (0x5851F42D4C957F2D, 0x14057B7EF767814F):
        x = ((x ^ (x >> 29)) * (m & ((1 << 62) - 1))) & ((1 << 62) - 1)
    return x ^ (x >> 31)


def sample_anchors(tokens, cu_seqlens, loss_mask, anchors: int, seed: int, ring, pos=None) -> torch.Tensor:
    """(N,) int64 ascending local rows: up to `anchors` per sequence among rows a with loss_mask at a - 1 and at a
    (x_a and x_{a+1} response tokens), the same positions on every mesh (module docstring). tokens / loss_mask / pos
    are this rank's rows (its zigzag shard under CP)."""
    cp = ring.size
    lcu = host_cu(cu_local(cu_seqlens, cp)) if cp > 1 else host_cu(cu_seqlens)
    dev = tokens.device
    if pos is None:
        pos = position_ids(cu_seqlens)
        pos = pos if cp == 1 else zigzag_shard(pos, cu_seqlens, cp, ring.rank)
    S = len(lcu) - 1
    seq = seq_ids(cu_local(cu_seqlens, cp) if cp > 1 else cu_seqlens).long()  # (T,)
    m = loss_mask.bool()
    content = torch.zeros(S, dtype=torch.long, device=dev).index_add_(  # the sequence's key: its trained tokens
        0, seq, torch.where(m, _mix(tokens.long() * 1000003 + pos.long() * 7919 + 1), 0) & ((1 << 40) - 1))
    content = ring_sum(content, ring)  # (S,) sync point under CP: S integers
    key = _mix(_mix(content[seq] + seed * 0x9E3779B97F4A7C15 % (1 << 61)) + pos.long())
    # x_a sampled by the policy too (loss_mask at a - 1): never a prompt's last token, an anchor inference never has
    prev = shift_packed(m, cu_seqlens, -1, fill=False) if cp == 1 else cp_shift(m, cu_seqlens, -1, group=ring,
                                                                                 fill=False)  # one hop under CP
    ok = m & prev[0]  # (T,)
    key = torch.where(ok, key, _BIG)  # (T,)
    n = max(int(anchors), 0)
    best = torch.zeros((cp, S, max(n, 1)), dtype=torch.long, device=dev)  # slot r: rank r's n smallest per sequence
    best[ring.rank] = _BIG
    for s, (a, b) in enumerate(zip(lcu, lcu[1:])):
        if b > a and n:
            v = key[a:b].topk(min(n, b - a), largest=False).values
            best[ring.rank, s, : v.numel()] = v
    best = ring_sum(best, ring)  # every rank's n smallest (each rank fills its own slot, zeros elsewhere)
    thr = best.permute(1, 0, 2).flatten(1).sort(-1).values[:, n - 1] if n else torch.full((S,), -1, device=dev)
    return ((key <= thr[seq]) & ok).nonzero()[:, 0]


def block_targets(loss_mask, cu_seqlens, anchors, offsets, halo: int, ring):
    """Per trained slot j: valid (N,) bool (the slot's token exists and is a response token) and src (N,) the teacher
    row of its prediction, as an index into [local rows ; halo rows] (draft_loss.teacher_index). offsets[j] = the
    teacher's distance from the anchor. Returns (valid list, src list, count (P,) global)."""
    lcu = cu_local(cu_seqlens, ring.size)
    valid, src = [], []
    for d in offsets:
        v = loss_mask.bool() if d == 0 else cp_shift(loss_mask.bool(), cu_seqlens, d, group=ring, fill=False)[0]
        valid.append(v[anchors])
        src.append(teacher_index(lcu, d, halo, ring.size)[anchors])
    count = ring_sum(torch.stack([v.sum() for v in valid]).double(), ring)  # (P,) sync point under CP
    return valid, src, count


def block_loss(draft, h, teacher, valid, src, count, *, gamma: float, chunk: int):
    """sum_{a,j} w_j m_{a,j} CE / sum_{a,j} m_{a,j} (module docstring); h (N, W, H) the block's final states
    (pre-norm), the draft's logits W_head norm(h) through the policy's head, streamed; count (P,) the global m sums
    per slot. Returns (loss, stats (P, 5) this rank's sums)."""
    loss, stats = 0.0, []
    agree_prev = torch.ones(h.shape[0], dtype=torch.bool, device=h.device)
    n = count.sum().clamp_min(1)  # every trained (anchor, slot) pair: one mean, speculators' (not one per slot)
    for j, k in enumerate(draft.trained_slots):
        x = draft.norm(h[:, k])  # (N, H)
        dt = torch.promote_types(x.dtype, torch.float32)
        coef = (math.exp(-j / gamma) / n).to(dt) * valid[j].to(dt)  # (N,)
        l, s, agree = StreamingSoftCE.apply(x, draft.head_weight, coef, valid[j], src[j], None, None, agree_prev,
                                            teacher, chunk)
        loss, agree_prev = loss + l, agree_prev & agree
        stats.append(s)
    return loss, torch.stack(stats)


def anchor_backend(backend: str) -> str:
    """The kernel a block's anchor attention runs under the run's --attn_backend: the same one, except flash ->
    triton. A block's W queries see their sequence's trunk up to their anchor (j < a: a key end per anchor,
    attention_cp.anchor_branch_attention), which flash-attn's varlen kernels cannot express (one key range per
    sequence); the Triton kernel computes the same attention with per-row key ends. The policy keeps flash."""
    return "triton" if backend == "flash" else backend


def train_blocks(draft, taps, tokens, cu_seqlens, teacher_logits=None, *, teacher_hidden=None, teacher_head=None,
                 loss_mask=None, anchors: int = 4, gamma=None, seed: int = 0, position_ids=None, group=None,
                 attn_fn=None, backend: str = "torch", chunk=None):
    """A block drafter's loss on the policy's own forward -> (loss, metrics); the arguments as draft_ttt.ttt_loss's
    (this rank's share of the loss under CP; metrics global, per trained slot). backend: the run's --attn_backend,
    its anchor kernel anchor_backend(backend); anchors: per sequence; gamma: the position weights' decay (None:
    default_gamma(block_size)); seed: the anchors' seed; chunk: rows per chunk of the streamed loss (None or 0:
    draft_loss.chunk_rows's byte budget; the tests hold the dense reference)."""
    ring = as_ring(group)
    T = tokens.shape[0]
    halo = max(draft.teacher_offsets) + 1
    teacher = make_teacher(teacher_logits, teacher_hidden, teacher_head, T, draft.cfg.vocab_size, cu_seqlens, halo,
                           ring)
    taps, tokens, cu_seqlens, loss_mask, position_ids = pad_inputs(draft, taps, tokens, cu_seqlens, loss_mask,
                                                                   position_ids, ring, teacher)
    a = sample_anchors(tokens, cu_seqlens, loss_mask, anchors, seed, ring, position_ids)
    valid, src, count = block_targets(loss_mask, cu_seqlens, a, draft.teacher_offsets, halo, ring)
    h = draft.block_forward(taps, tokens, cu_seqlens, a, position_ids=position_ids, group=ring, attn_fn=attn_fn,
                            backend=anchor_backend(backend))  # (N, W, H)
    g = default_gamma(draft.cfg.block_size) if gamma is None else float(gamma)
    def slot_tokens(k):  # (N,) x_{a+k}: the token at each anchor's slot k (0 past the sequence's end)
        return (tokens if k == 0 else cp_shift(tokens, cu_seqlens, k, group=ring, fill=0)[0])[a]
    loss, stats = draft.block_loss(h, teacher, valid, src, count, gamma=g, slot_tokens=slot_tokens,
                                   chunk=chunk_rows(draft.cfg.vocab_size, chunk) or chunk_rows(draft.cfg.vocab_size))
    return loss, position_metrics(ring_sum(stats, ring), count)
