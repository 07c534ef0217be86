"""DSpark [arXiv 2607.05147]: the DFlash backbone, a low-rank Markov head sampled left to right, a confidence head.

The backbone is DFlash's (draft_dflash.py: one forward over [y, MASK x (W - 1)] with the policy's context injected as
keys and values), with every slot shifted one token on: slot k, at position s+k, predicts x_{s+k+1}, so all W slots
draft (k <= W). The Markov head makes the block semi-autoregressive at the price of V-sized logits only, and the
confidence head reads its embedding too (the paper's eq. 7; speculators' and DeepSpec's confidence_head_with_markov):

    z_k  = W_head norm(h_k) + W2 W1[prev_k],       prev_0 = y,  prev_k = the token drafted at slot k-1     (rank r)
         = [W_head | W2] [norm(h_k) ; W1[prev_k]]      (the same as one stacked head: the tests' dense reference)
    c_k  = sigmoid(w_c . [norm(h_k) ; W1[prev_k]] + b_c)    the confidence head (H + r -> 1): the expected
                                                   acceptance of slot k's token once its prefix is accepted

Drafting: after the one backbone pass, d_{k+1} ~ softmax(z_k / tau) with prev_k = d_k, k = 0..K-1, left to right; the
accept rule's q_k is exactly that distribution (the one each token was sampled from). With confidence_threshold > 0 a
row's block ends before its first slot with c_k < threshold (DeepSpec's static cut). c_k reads prev_k = d_k, never slot
k's own d_{k+1}: whether slot k is proposed is decided before its token is drawn, so the shorter proposal is still
verified exactly. Training (draft_block.py's anchors and targets; teacher-forced prev_k = x_{a+k}):

    L = sum_{a,k} w_k m_{a,k} [0.1 CE(p, q_k) + 0.9 ||q_k - p||_1 + BCE(c_k, alpha_k)] / sum_{a,k} m_{a,k},
        w_k = exp(-k / gamma),  p = p_{a+k}   (one mean over every trained pair, as speculators' DSpark loss)

with alpha_k = sum_v min(p_v, q_{k,v}) (detached) and gamma by default default_gamma(W + 1) (`loss`). The two logit
terms are computed apart and streamed over chunks of anchors (`StreamingMarkovLoss`, draft_loss.StreamingSoftCE's
scheme with the L1 term): backward recomputes each chunk's (chunk, V) logits, no (anchors, V) tensor is kept, the
(V, H + r) stacked head is never built, and the policy's LM head (shared, detached) gets no gradient: the only
vocabulary-sized gradient is W2's (V, r), once.

    python draft_dspark.py     # a DSpark draft learning (~15 s): tau_hat before and after, then one sampled block

Letters: N anchors, W block size, B batch rows, H hidden, r Markov rank, V vocab.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from decoding.spec_rule import sample
from draft_block import default_gamma
from draft_dflash import DFlashConfig, DFlashDraft
from modeling.kv_cache import KVCache
from modeling.layers import at_least_f32


@dataclass
class DSparkConfig(DFlashConfig):
    markov_rank: int = 16  # r of the Markov head (256 at 8B; small for the tiny CPU policies)
    confidence_threshold: float = 0.0  # propose: a row's block ends before its first slot with c_k below it (0: off)

    def __post_init__(self):
        super().__post_init__()
        if self.markov_rank < 1:
            raise ValueError(f"markov_rank={self.markov_rank}: expected >= 1")
        if not 0 <= self.confidence_threshold <= 1:
            raise ValueError(f"confidence_threshold={self.confidence_threshold}: expected in [0, 1] (0: off)")


class DSparkDraft(DFlashDraft):
    """DFlashDraft's parameters plus markov_in (W1, (V, r)), markov_out (W2, (V, r)) and confidence (H + r -> 1)."""

    block_offset = 1
    architecture = "CospecDSparkDraft"
    build_keys = DFlashDraft.build_keys + ("markov_rank", "confidence_threshold")

    def __init__(self, cfg: DSparkConfig, policy):
        super().__init__(cfg, policy)
        self.markov_in = nn.Embedding(cfg.vocab_size, cfg.markov_rank)
        self.markov_out = nn.Linear(cfg.markov_rank, cfg.vocab_size, bias=False)
        self.confidence = nn.Linear(cfg.hidden_size + cfg.markov_rank, 1)  # c_k from [norm(h_k); W1[prev_k]]
        nn.init.normal_(self.markov_in.weight, std=1.0 / math.sqrt(cfg.markov_rank))
        nn.init.zeros_(self.markov_out.weight)  # the head starts as DFlash's
        nn.init.zeros_(self.confidence.weight)
        nn.init.zeros_(self.confidence.bias)

    @classmethod
    def config_class(cls):
        return DSparkConfig

    def markov_logits(self, h, prev):  # h (..., H), prev (...) -> z (..., V) = W_head norm(h) + W2 W1[prev]
        return self.logits(h) + self.markov_out(self.markov_in(prev).to(h.dtype))

    def confidence_logit(self, x, m):  # x (..., H) = norm(h_k), m (..., r) = W1[prev_k] -> (...) c_k's logit
        return self.confidence(torch.cat([x, m.to(x.dtype)], -1)).squeeze(-1)

    def head(self):
        """[W_head | W2] (V, H + r), the stacked form z = [W_head | W2] [norm(h); W1[prev]]: the dense reference's
        (tests). Training and drafting never build it; they add the two terms (markov_logits, StreamingMarkovLoss)."""
        return torch.cat([self.head_weight.to(self.markov_out.weight.dtype), self.markov_out.weight], 1)

    def propose(self, cache: KVCache, state, k: int, temperature: float, generator=None):
        """drafter.py: one backbone forward, then slots 0..k-1 sampled left to right through the Markov head, each
        from the q it returns -> d (B, k), q (B, k, V) (None at tau = 0). The cache is unchanged.

        With confidence_threshold > 0 also lengths (B,): row b proposes d[b, :lengths[b]], cut before its first slot
        with c_k < threshold, c_k read before d_k is drawn (DeepSpec, deepspec/eval/dspark/draft_ops.py,
        _confident_prefix_length: the first slot whose sigmoid(confidence) < threshold ends the block, each slot's
        own c_k, not their running product). d and q keep max(lengths) columns: one host sync, the verification's
        width. Every slot is still sampled (no sync per slot); a row's slots past its cut are never verified."""
        h = self.run_block(cache, state[0])  # (B, W, H)
        thr = self.cfg.confidence_threshold
        prev, ds, qs = state[0], [], []
        lengths, live = torch.zeros_like(prev), torch.ones_like(prev, dtype=torch.bool)  # (B,)
        for j in range(k):
            if thr > 0:  # c_j from h_j and W1[prev] (the anchor, or slot j-1's token): decided before slot j samples
                c = torch.sigmoid(at_least_f32(self.confidence_logit(self.norm(h[:, j]), self.markov_in(prev))))
                live = live & (c >= thr)
                lengths = lengths + live
            prev, q = sample(self.markov_logits(h[:, j], prev), temperature, generator)
            ds.append(prev)
            qs.append(q)
        d, q = torch.stack(ds, 1), (torch.stack(qs, 1) if temperature > 0 else None)
        if thr <= 0:
            return d, q
        w = int(lengths.max()) if k else 0
        return d[:, :w], (None if q is None else q[:, :w]), lengths

    def loss(self, taps: dict, tokens, cu_seqlens, teacher_logits=None, *, gamma=None, **kw):
        """DFlashDraft.loss with gamma None read as default_gamma(W + 1): the rule by block size counts a DFlash block
        of W - 1 drafts and its anchor, and a DSpark block of W drafts weighs its slots as a DFlash block of W + 1
        does. At W = 7: gamma 4.0, DeepSpec's (loss_decay_gamma = 4.0 at block_size 7; speculators' 4.0)."""
        g = default_gamma(self.cfg.block_size + 1) if gamma is None else gamma
        return super().loss(taps, tokens, cu_seqlens, teacher_logits, gamma=g, **kw)

    def block_loss(self, h, teacher, valid, src, count, *, gamma: float, chunk: int, slot_tokens=None):
        """The DSpark loss over the W slots (module docstring), streamed `chunk` anchors at a time. A rank without
        anchors (N = 0) still returns a zero on the graph of h, so under CP it joins the ring's backward.
        Returns (loss, stats (W, 5) this rank's sums: ce, agree, agree & all earlier agreed, all earlier, alpha)."""
        N = h.shape[0]
        loss, stats = h[:0].sum(), []  # () an exact zero attached to the block's graph, whatever N
        agree_prev = torch.ones(N, dtype=torch.bool, device=h.device)
        n = count.sum().clamp_min(1)  # every trained (anchor, slot) pair
        for j, k in enumerate(self.trained_slots):
            x = self.norm(h[:, k])  # (N, H)
            v, dt = valid[j], at_least_f32(x).dtype
            coef = (math.exp(-j / gamma) / n).to(dt) * v.to(dt)  # (N,) one mean over every pair, as DFlash's
            m = self.markov_in(slot_tokens(k)).to(x.dtype)  # (N, r) W1[prev], prev = x_{a+k} (teacher-forced)
            l, alpha, s, agree = StreamingMarkovLoss.apply(x, m, self.head_weight, self.markov_out.weight, coef, v,
                                                           src[j], agree_prev, teacher, max(chunk, 1))
            conf = at_least_f32(self.confidence_logit(x, m))  # (N,) c_k's logit from [norm(h_k); W1[x_{a+k}]]
            bce = F.binary_cross_entropy_with_logits(conf, alpha.to(conf.dtype), reduction="none")
            loss = loss + l + (torch.where(v, bce, 0) * coef).sum()
            agree_prev = agree_prev & agree
            stats.append(s)
        return loss, torch.stack(stats)

    def check_exportable(self):  # drafter.py: the speculators format holds every field
        return None

    # -- the family's facts beyond DFlash's (drafter.FAMILY) -----------------------------------------------------
    fit_rule = "k, at least 2"  # every slot drafts, so none is trained that is never proposed; DFlashConfig's floor
    slots_rule = "block_size"

    @staticmethod
    def fitted_block(k: int) -> int:
        return max(k, 2)

    @staticmethod
    def slots_drafted(W: int) -> int:
        return W

    @classmethod
    def shape_options(cls, cfg) -> dict:  # + the Markov head's rank
        return dict(DFlashDraft.shape_options(cfg), markov_rank=cfg.markov_rank)

    @staticmethod
    def size_flags(cfg) -> str:
        return f"--markov_rank={cfg.markov_rank} (DSpark's two (V, r) Markov tables) and --draft_layers"

    def export(self, path: str, *, dtype=torch.bfloat16, pair: dict | None = None, verifier: str | None = None,
               **kw):
        """The speculators format (serving/speculators_format.py: the Markov and confidence heads in its names), at
        `path` itself; vLLM's DFlash format has no Markov head. kw (max_position_embeddings) is not needed there."""
        from serving.export import write_export
        from serving.speculators_format import beside
        cfg, sd = beside(self, "dspark", verifier=verifier, dtype=dtype)["speculators"]
        write_export(path, cfg, sd, pair, top="speculators", also={})


# --------------------------------------------------------------------------------------------- the streamed function
class StreamingMarkovLoss(torch.autograd.Function):
    """sum_a coef_a [0.1 CE(p_a, q_a) + 0.9 ||q_a - p_a||_1] for one slot, `chunk` anchors at a time, z = x W_head^T +
    m W2^T (never [W_head | W2]); backward recomputes each chunk's (c, V) logits and applies

        dL/dz = coef [0.1 (q - p) + 0.9 q (s - <s, q>)],   s = sign(q - p)   (the L1 term through the softmax)
        dL/dx = dL/dz W_head,   dL/dm = dL/dz W2,   dL/dW2 = dL/dz^T m        (W_head the policy's: no gradient)

    x (N, H) = norm(h_k), m (N, r) = W1[prev_k], Wh (V, H), W2 (V, r), coef / valid / src / agree_prev (N,).
    Returns loss (), alpha (N,) = sum_v min(p, q) (detached: the confidence head's target), stats (5,) fp64 [ce,
    agree, agree & agree_prev, agree_prev, alpha] over valid rows, agree (N,) bool. Saved: x, m and two (N,)
    normalisers (lse z, lse of the teacher logits); the teacher's rows are read again."""

    @staticmethod
    def forward(ctx, x, m, Wh, W2, coef, valid, src, agree_prev, teacher, chunk):
        N = x.shape[0]
        dt = torch.promote_types(x.dtype, torch.float32)
        loss = torch.zeros((), dtype=torch.float64, device=x.device)
        stats = torch.zeros(5, dtype=torch.float64, device=x.device)
        alpha, agree = torch.zeros(N, dtype=dt, device=x.device), torch.zeros_like(valid)
        norms = torch.zeros(2, N, dtype=dt, device=x.device)  # (2, N) [lse z, lse t]
        for a in range(0, N, chunk):
            b = min(a + chunk, N)
            z = _markov_z(x[a:b], m[a:b], Wh, W2)  # (c, V)
            t = teacher.logits(src[a:b])  # (c, V) the policy's logits at a + k
            norms[0, a:b], norms[1, a:b] = z.logsumexp(-1), t.logsumexp(-1)
            ag = z.argmax(-1) == t.argmax(-1)
            p = t.sub_(norms[1, a:b, None]).exp_()  # (c, V) softmax(t), in place
            ce = norms[0, a:b] * p.sum(-1) - torch.linalg.vecdot(p, z)  # -sum_v p_v log q_v
            q = z.sub_(norms[0, a:b, None]).exp_()  # (c, V) softmax(z), in place
            alpha[a:b] = torch.minimum(p, q).sum(-1)
            rows = 0.1 * ce + 0.9 * (q - p).abs_().sum(-1)
            v = valid[a:b]
            md, ce_d, al_d = v.double(), torch.where(v, ce, 0).double(), torch.where(v, alpha[a:b], 0).double()
            loss += (torch.where(v, rows, 0).double() * coef[a:b].double()).sum()
            stats += torch.stack([(ce_d * md).sum(), (ag * md).sum(), ((ag & agree_prev[a:b]) * md).sum(),
                                  (agree_prev[a:b] * md).sum(), (al_d * md).sum()])
            agree[a:b] = ag
        ctx.save_for_backward(x, m, Wh, W2, coef, valid, src, norms)
        ctx.teacher, ctx.chunk = teacher, chunk
        ctx.mark_non_differentiable(alpha, stats, agree)
        return loss.to(dt), alpha, stats, agree

    @staticmethod
    def backward(ctx, grad_loss, _alpha, _stats, _agree):
        x, m, Wh, W2, coef, valid, src, norms = ctx.saved_tensors
        Wh = Wh.to(x.dtype)
        dx = torch.empty_like(x) if ctx.needs_input_grad[0] else None  # (N, H)
        dm = torch.empty_like(m) if ctx.needs_input_grad[1] else None  # (N, r)
        dW2 = torch.zeros(W2.shape, dtype=norms.dtype, device=W2.device) if ctx.needs_input_grad[3] else None  # (V, r)
        for a in range(0, x.shape[0], ctx.chunk):
            b = min(a + ctx.chunk, x.shape[0])
            q = _markov_z(x[a:b], m[a:b], Wh, W2).sub_(norms[0, a:b, None]).exp_()  # (c, V) q, recomputed
            p = ctx.teacher.logits(src[a:b]).sub_(norms[1, a:b, None]).exp_()  # (c, V) p
            s = (q - p).sign_()  # (c, V) s
            sq = torch.linalg.vecdot(s, q)  # (c,) <s, q>
            g = s.sub_(sq[:, None]).mul_(q).mul_(0.9)  # (c, V) the L1 term's 0.9 q (s - <s, q>)
            g.add_(q.sub_(p), alpha=0.1)  # + the CE term's 0.1 (q - p): dL/dz per unit coef
            g.mul_((coef[a:b] * grad_loss).to(g.dtype)[:, None]).masked_fill_(~valid[a:b, None], 0)
            if dx is not None:
                dx[a:b] = (g.to(Wh.dtype) @ Wh).to(x.dtype)
            if dm is not None:
                dm[a:b] = (g.to(W2.dtype) @ W2).to(m.dtype)
            if dW2 is not None:
                dW2 += g.T @ at_least_f32(m[a:b]).to(dW2.dtype)
        return dx, dm, None, None if dW2 is None else dW2.to(W2.dtype), None, None, None, None, None, None


def _markov_z(x, m, Wh, W2):  # x (c, H), m (c, r) -> z (c, V) = x Wh^T + m W2^T, fp32 at least
    z = at_least_f32(F.linear(x, Wh.to(x.dtype)))
    return z.add_(F.linear(m.to(W2.dtype), W2))


if __name__ == "__main__":
    from parallel.cli import answer_help
    answer_help(__doc__, __file__)
    from drafter import demo  # the block sampled left to right through the Markov head (tau = 1)
    demo("DSpark (blocks of 4)", lambda p: DSparkDraft.from_target(p, mask_token_id=0, block_size=4, markov_rank=8),
         k=4, temperature=1.0, anchors=4)
