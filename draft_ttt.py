"""Training-time test (TTT, EAGLE-3 [Li et al. 2025]): the draft unrolled for d = 1..P passes on every anchor at once.

Pass d's query at anchor i attends to the *trunk* -- the pass-1 keys at positions j <= i of its sequence -- and to
its *branch* -- the keys of passes 2..d at anchor i (RoPE positions i+1..i+d-1). That is exactly the key set the draft
sees at inference after d-1 own steps from anchor i, so training matches inference. The attention is
`attention_cp.ring_branch_attention`, which also runs it under context parallelism (zigzag ring for the trunk, the
branch local). With the draft's equations (draft.py):

    h^d_i = Layer(x = [norm(e(x_{i+d})); norm(h^{d-1}_i)],  residual h^{d-1}_i,  RoPE position i+d-1)
    L     = sum_d w_d * mean_i CE(p_{i+d}, q^d_i),          w_d = pass_weight^(d-1)   (0.8 unless --ttt_decay)

over the anchors i whose x_{i+1} and x_{i+d+1} are response tokens (`pass_targets`).

(soft CE = forward KL + const), streamed over token chunks by draft_loss.py (no (T, V) tensor kept; the teacher may be
the policy's hidden + LM head). Metrics per pass: top-1 agreement with the teacher, that agreement given all earlier
passes agreed, the expected acceptance alpha_d = E sum_x min(p(x), q(x)), and the predicted acceptance length
tau_hat = 1 + sum_k prod_{j<=k} alpha_j. merge_metrics pools the metrics of several calls (micro-batches, updates)
as one call over all their anchors.

The functions take the draft (draft.Eagle3Draft) as their first argument; `Eagle3Draft.ttt_forward` / `ttt_loss` call
them. This file does not import draft.py (the draft is the caller), so its demo is the draft's:

    python draft.py     # TTT learning (~15 s): tau_hat on held-out samples before and after 300 steps of ttt_loss

Letters: T packed tokens, S sequences, H hidden, Hq/Hkv heads, D head dim, V target vocab, P passes / branch entries.
"""
from __future__ import annotations

import math
from typing import Optional

import torch

import branch_mask
from branch_mask import cp_shift, cu_local, pad_ring_of_one, shift_packed, zigzag_shard
from parallel.host_copy import host_cu
from draft_loss import chunk_rows, dense_pass_losses, make_teacher, pass_targets, ring_sum, streaming_pass_losses
from model import EMBED_TAP
from modeling.layers import rope_cos_sin
from parallel.ring import as_ring


def ttt_forward(draft, taps: dict, tokens, cu_seqlens, num_passes: int, *, position_ids=None, group=None,
                attn_fn=None, backend: str = "torch") -> list:
    """Passes 1..num_passes at every anchor -> [h^1, ..., h^P], each (T, H) (pre-norm; `logits(h)` gives q).

    taps {layer: (T, H)} (detached here: no draft gradient reaches the policy) and tokens (T,) are the packed batch,
    or this rank's zigzag shard of it under CP; cu_seqlens (S+1) the global boundaries (CP-padded under CP;
    without CP any lengths). position_ids (T,): each row's position within its sequence (default: from cu_seqlens),
    below the longest (CP-padded) sequence's length -- the RoPE table is sized from the host copy of cu_seqlens, so
    no position is read back from the device. group: None, a torch ProcessGroup or a ring.Ring. attn_fn defaults to
    attention_cp.ring_branch_attention (tests pass the dense oracle).

    taps[EMBED_TAP] (T, H), if given, is the policy's own input embedding e(x_i) (its first stage's tap, carried by
    TapChannel): e(x_{i+d}) is then that tap shifted by d rows (cp_shift: under CP only boundary rows travel)
    instead of a lookup in the shared embedding, so the update path needs no full policy copy. The two agree at
    every position that has a next token; past a sequence's end the shift fills zeros where the lookup embeds id
    0, and those positions carry no loss and are seen by no counted query."""
    if num_passes < 1:
        raise ValueError(f"num_passes={num_passes}: expected >= 1")
    ring = as_ring(group)
    taps = tap_inputs(draft, taps, tokens.shape[0])
    pad = pad_ring_of_one(cu_seqlens) if ring.size == 1 else None  # under CP the caller has padded
    if pad is not None:  # cp = 1, odd lengths (branch_mask.pad_ring_of_one says why): pad, run, drop the padding
        hs = ttt_forward(draft, {l: pad.pad(t) for l, t in taps.items()}, pad.pad(tokens), pad.cu_seqlens,
                              num_passes, position_ids=None if position_ids is None else pad.pad(position_ids),
                              group=ring, attn_fn=attn_fn, backend=backend)
        return [pad.unpad(h) for h in hs]
    if attn_fn is None:
        from attention_cp import ring_branch_attention as attn_fn
    attn = draft.midlayer.self_attn
    scale = 1.0 / math.sqrt(draft.cfg.head_dim)
    pos = _local_positions(cu_seqlens, ring) if position_ids is None else position_ids.long()  # (T,)
    cu = host_cu(cu_seqlens)
    longest = max(b - a for a, b in zip(cu, cu[1:]))  # positions < longest (global, CP-padded): no device read
    h = draft.features(taps)  # h^0 (T, H)
    emb = taps[EMBED_TAP].to(h.dtype) if EMBED_TAP in taps else None  # (T, H) e(x_i), or None: look tokens up
    k1 = v1 = None
    branch_k, branch_v, hs = [], [], []
    for d in range(1, num_passes + 1):
        # 1. inputs: the token d positions ahead (CP-aware shift; past a sequence end -> id 0, masked in the loss)
        e = (draft.embed(cp_shift(tokens, cu_seqlens, d, group=ring, fill=0)[0]) if emb is None
             else cp_shift(emb, cu_seqlens, d, group=ring, fill=0)[0])  # (T, H) e(x_{i+d})
        cos, sin = rope_cos_sin(pos + (d - 1), draft.cfg.head_dim, draft.cfg.rope_theta, h.dtype,
                                bound=longest + d - 1)
        x = torch.cat([draft.midlayer.input_layernorm(e), draft.midlayer.hidden_norm(h)], dim=-1)  # (T, 2H)
        q, k, v = attn.qkv(x, cos, sin)  # (T, Hq, D), (T, Hkv, D) x2
        # 2. trunk = pass-1 K/V; branch = K/V of passes 2..d at the same anchor (P = d-1, own key included)
        if d == 1:
            k1, v1, bk, bv = k, v, None, None
        else:
            branch_k.append(k)
            branch_v.append(v)
            bk, bv = torch.stack(branch_k, 1), torch.stack(branch_v, 1)  # (T, P, Hkv, D)
        o = attn_fn(q, k1, v1, cu_seqlens, bk, bv, group=ring, softmax_scale=scale, backend=backend)
        # 3. residual on the previous state (gradient kept through h^{d-1}), then the MLP
        h = h + attn.o_proj(o.flatten(-2))
        h = h + draft.midlayer.mlp(draft.midlayer.post_attention_layernorm(h))
        hs.append(h)
    return hs

def tap_inputs(draft, taps, T):  # {layer: (T, H)} checked and detached
    missing = [l for l in draft.tap_layers if l not in taps]
    if missing:
        raise ValueError(f"taps: missing layers {missing}; the draft reads {draft.tap_layers}")
    keep = draft.tap_layers + ((EMBED_TAP,) if EMBED_TAP in taps else ())  # the embedding tap: optional
    bad = [l for l in keep if tuple(taps[l].shape) != (T, draft.cfg.hidden_size)]
    if bad:
        raise ValueError(f"taps: layers {bad} are not (T={T}, H={draft.cfg.hidden_size})")
    return {l: taps[l].detach() for l in keep}

def ttt_loss(draft, taps: dict, tokens, cu_seqlens, teacher_logits=None, *, teacher_hidden=None, teacher_head=None,
             loss_mask=None, num_passes: int = 3, pass_weight: float = 0.8, hard_labels: bool = False,
             position_ids=None, group=None, attn_fn=None, backend: str = "torch", chunk=None):
    """Multi-pass TTT loss on the policy's own forward. Returns (loss, metrics dict).

    The teacher is the policy at each position (predicting the next token): its logits teacher_logits (T, V), or
    -- no (T, V) tensor at all -- its final normed hidden teacher_hidden (T, H) with its LM-head weight
    teacher_head (V, H). loss_mask (T,) bool per prediction: row j's prediction of x_{j+1} counts (default: each row
    whose sequence has a next token; required under CP, false on the padding). Pass d at anchor i counts iff
    loss_mask[i] and loss_mask[i+d]: the chain starts at a token the policy sampled (as at inference, where the
    first chain starts after the prefill's sampled token) and predicts a counted token. Under CP every (T, ...)
    input is this rank's zigzag shard and the returned loss is this rank's share: the sum over ranks is the global
    loss, so the draft's grads are summed over the CP group (as data parallelism does). Metrics are global floats.
    chunk: rows per chunk of the streamed loss (draft_loss.StreamingSoftCE, O(chunk * V) memory; None: one 256 MiB
    fp32 block, draft_loss.chunk_rows); 0 runs the dense reference (draft_loss.dense_pass_losses, every (T, V) tensor
    materialised)."""
    ring = as_ring(group)
    teacher = make_teacher(teacher_logits, teacher_hidden, teacher_head, tokens.shape[0], draft.cfg.vocab_size,
                           cu_seqlens, num_passes, ring)
    taps, tokens, cu_seqlens, loss_mask, position_ids = pad_inputs(draft, taps, tokens, cu_seqlens, loss_mask,
                                                                   position_ids, ring, teacher)
    hs = ttt_forward(draft, taps, tokens, cu_seqlens, num_passes, position_ids=position_ids, group=ring,
                          attn_fn=attn_fn, backend=backend)
    valid, labels, count = pass_targets(tokens, cu_seqlens, loss_mask, num_passes, ring, hard_labels=hard_labels,
                                        t2d=draft.t2d)
    labels = None if labels is None else [_to_draft_id(draft, y) for y in labels]
    chunk = chunk_rows(draft.cfg.vocab_size, chunk)
    if chunk == 0:
        shifted = lambda x, d, fill: cp_shift(x, cu_seqlens, d, group=ring, fill=fill)[0]  # noqa: E731
        loss, stats = dense_pass_losses(hs, draft.logits, draft.draft_to_target, teacher.dense(), valid, labels,
                                        count, pass_weight=pass_weight, shifted=shifted)
    else:
        full = draft.cfg.draft_vocab_size == draft.cfg.vocab_size
        loss, stats = streaming_pass_losses(hs, draft.norm, draft.lm_head.weight,
                                            None if full else draft.draft_to_target, teacher, valid, labels, count,
                                            pass_weight=pass_weight, cp=ring.size,
                                            local_cu=cu_local(cu_seqlens, ring.size),
                                            chunk=chunk)
    return loss, _metrics(ring_sum(stats, ring), count)


def pad_inputs(draft, taps, tokens, cu_seqlens, loss_mask, position_ids, ring, teacher):
    """The training inputs checked (taps detached, loss_mask defaulted without CP) and, at cp = 1 with odd lengths,
    padded (branch_mask.pad_ring_of_one says why); the teacher then reads its rows through a row map. Returns (taps,
    tokens, cu_seqlens, loss_mask, position_ids). Shared by TTT and the block drafters (draft_block.py)."""
    T = tokens.shape[0]
    taps = tap_inputs(draft, taps, T)
    if loss_mask is None:
        if ring.size > 1:
            raise ValueError("loss_mask: required under CP (false on the padding)")
        loss_mask = shift_packed(tokens, cu_seqlens, 1)[1]  # (T,) a next token exists in the sequence
    elif loss_mask.shape != (T,):
        raise ValueError(f"loss_mask: expected shape ({T},), got {tuple(loss_mask.shape)}")
    pad = pad_ring_of_one(cu_seqlens) if ring.size == 1 else None
    if pad is None:
        return taps, tokens, cu_seqlens, loss_mask, position_ids
    taps = {l: pad.pad(t) for l, t in taps.items()}  # cp = 1, odd lengths: pad the (T, H) inputs
    teacher.row_map = pad.pad(torch.arange(T, device=tokens.device))
    return (taps, pad.pad(tokens), pad.cu_seqlens, pad.pad(loss_mask.bool(), False),
            None if position_ids is None else pad.pad(position_ids))


def _to_draft_id(draft, y):  # (T,) target ids -> draft ids (0 where outside the draft vocabulary)
    if draft.cfg.draft_vocab_size == draft.cfg.vocab_size:
        return y
    inv = torch.zeros(draft.cfg.vocab_size, dtype=torch.long, device=y.device)
    inv[draft.draft_to_target] = torch.arange(draft.cfg.draft_vocab_size, device=y.device)
    return inv[y]


def _metrics(stats, count) -> dict:
    """stats (P, 5) summed over valid anchors: ce, agree, agree & all earlier agreed, all earlier agreed, alpha.
    count (P,): the valid anchors of each pass; n_cond (P,): stats[:, 3], acc_cond's denominator."""
    stats, count = stats.double(), count.double()  # counts stay exact below 2^53
    n = count.clamp_min(1)
    per_pass = torch.stack([stats[:, 0] / n, stats[:, 1] / n, stats[:, 2] / stats[:, 3].clamp_min(1), stats[:, 4] / n,
                            count, stats[:, 3]])  # (6, P)
    loss, acc, acc_cond, alpha, count, n_cond = per_pass.tolist()  # the one host sync of the metrics
    tau, run = 1.0, 1.0
    for a in alpha:  # tau_hat = 1 + sum_k prod_{j<=k} alpha_j
        run *= a
        tau += run
    return {"loss_per_pass": loss, "acc": acc, "acc_cond": acc_cond, "alpha": alpha, "tau_hat": tau,
            "count": [int(c) for c in count], "n_cond": [int(c) for c in n_cond]}


position_metrics = _metrics  # the per-position metrics of any drafter's loss (draft_block.py reads them too)


def merge_metrics(parts) -> Optional[dict]:
    """The metrics of several ttt_loss calls (micro-batches, updates) as one call over all their anchors reports them:
    each per-pass mean back to its sum (times its count; acc_cond times n_cond), summed, then _metrics again -- so
    tau_hat is the one-micro-batch tau_hat (to round-off), not a mean of tau_hats. None parts are skipped."""
    parts = [m for m in parts if m is not None]
    if not parts:
        return None
    f64 = lambda x: torch.tensor(x, dtype=torch.float64)  # noqa: E731
    count, stats = 0, 0
    for m in parts:
        n, c = f64(m["count"]), f64(m["n_cond"])
        sums = [f64(m["loss_per_pass"]) * n.clamp_min(1), f64(m["acc"]) * n.clamp_min(1),
                f64(m["acc_cond"]) * c.clamp_min(1), c, f64(m["alpha"]) * n.clamp_min(1)]
        count, stats = count + n, stats + torch.stack(sums, 1)  # (P,), (P, 5)
    return _metrics(stats, count)


def _local_positions(cu_seqlens, ring):  # (T_local,) RoPE position of this rank's tokens
    pos = branch_mask.position_ids(cu_seqlens)  # O(T_global) integers, no activations
    return pos if ring.size == 1 else zigzag_shard(pos, cu_seqlens, ring.size, ring.rank)

