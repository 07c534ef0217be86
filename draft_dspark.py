"""DSpark [arXiv 2607.05147]: the DFlash backbone, a low-rank Markov head sampled left to right, a confidence head.

The backbone is DFlash's (draft_dflash.py: one forward over [y, MASK x (W - 1)] with the policy's context injected as
keys and values), with every slot shifted one token on: slot k, at position s+k, predicts x_{s+k+1}, so all W slots
draft (k <= W). The Markov head makes the block semi-autoregressive at the price of V-sized logits only:

    z_k  = W_head norm(h_k) + W2 W1[prev_k],       prev_0 = y,  prev_k = the token drafted at slot k-1     (rank r)
         = [W_head | W2] [norm(h_k) ; W1[prev_k]]      (one linear head over stacked features, how it is computed)
    c_k  = sigmoid(w_c . norm(h_k) + b_c)          the confidence head: the expected acceptance of slot k's token

Drafting: after the one backbone pass, d_{k+1} ~ softmax(z_k / tau) with prev_k = d_k, k = 0..K-1, left to right; the
accept rule's q_k is exactly that distribution (the one each token was sampled from). Training (draft_block.py's
anchors and targets; teacher-forced prev_k = x_{a+k}):

    L = sum_k exp(-k / gamma) mean_a [0.1 CE(p, q_k) + 0.9 ||q_k - p||_1 + BCE(c_k, alpha_k)],   p = p_{a+k}

with alpha_k = sum_v min(p_v, q_{k,v}) (detached), computed over chunks of anchors under activation checkpointing (the
(chunk, V) logits are recomputed in backward: no (anchors, V) tensor is kept).

    python draft_dspark.py     # a DSpark draft on the tiny policy: its loss and one proposed block

Letters: N anchors, W block size, B batch rows, H hidden, r Markov rank, V vocab.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from decoding.spec_rule import sample
from draft_dflash import DFlashConfig, DFlashDraft
from model import ModelConfig, Transformer
from modeling.kv_cache import KVCache
from modeling.layers import at_least_f32


@dataclass
class DSparkConfig(DFlashConfig):
    markov_rank: int = 16  # r of the Markov head (256 at 8B; small for the tiny CPU policies)

    def __post_init__(self):
        super().__post_init__()
        if self.markov_rank < 1:
            raise ValueError(f"markov_rank={self.markov_rank}: expected >= 1")


class DSparkDraft(DFlashDraft):
    """DFlashDraft's parameters plus markov_in (W1, (V, r)), markov_out (W2, (V, r)) and confidence (H -> 1)."""

    block_offset = 1
    architecture = "CospecDSparkDraft"
    build_keys = DFlashDraft.build_keys + ("markov_rank",)

    def __init__(self, cfg: DSparkConfig, policy):
        super().__init__(cfg, policy)
        self.markov_in = nn.Embedding(cfg.vocab_size, cfg.markov_rank)
        self.markov_out = nn.Linear(cfg.markov_rank, cfg.vocab_size, bias=False)
        self.confidence = nn.Linear(cfg.hidden_size, 1)
        nn.init.normal_(self.markov_in.weight, std=1.0 / math.sqrt(cfg.markov_rank))
        nn.init.zeros_(self.markov_out.weight)  # the head starts as DFlash's
        nn.init.zeros_(self.confidence.weight)
        nn.init.zeros_(self.confidence.bias)

    @classmethod
    def config_class(cls):
        return DSparkConfig

    def features(self, h, prev):  # h (..., H), prev (...) -> [norm(h); W1[prev]] (..., H + r)
        return torch.cat([self.norm(h), self.markov_in(prev).to(h.dtype)], -1)

    def head(self):  # [W_head | W2] (V, H + r): the policy's head held detached, W2 trained
        return torch.cat([self.head_weight.to(self.markov_out.weight.dtype), self.markov_out.weight], 1)

    def propose(self, cache: KVCache, state, k: int, temperature: float, generator=None):
        """drafter.py: one backbone forward, then slots 0..k-1 sampled left to right through the Markov head, each
        from the q it returns -> d (B, k), q (B, k, V) (None at tau = 0). The cache is unchanged."""
        h = self.run_block(cache, state[0])  # (B, W, H)
        W, prev, ds, qs = self.head(), state[0], [], []
        for j in range(k):
            prev, q = sample(F.linear(self.features(h[:, j], prev), W), temperature, generator)
            ds.append(prev)
            qs.append(q)
        return torch.stack(ds, 1), (torch.stack(qs, 1) if temperature > 0 else None)

    def block_loss(self, h, teacher, valid, src, count, *, gamma: float, chunk: int, slot_tokens=None):
        """The DSpark loss over the W slots (module docstring), `chunk` anchors at a time under checkpointing.
        Returns (loss, stats (W, 5) this rank's sums: ce, agree, agree & all earlier agreed, all earlier, alpha)."""
        N, W = h.shape[0], self.head()
        loss, stats = 0.0, []
        agree_prev = torch.ones(N, dtype=torch.bool, device=h.device)
        for j, k in enumerate(self.trained_slots):
            x, prev, v, sj = h[:, k], slot_tokens(k), valid[j], src[j]
            coef = (math.exp(-j / gamma) / count[j].clamp_min(1)) * v.to(at_least_f32(h).dtype)  # (N,)
            s = torch.zeros(5, dtype=torch.float64, device=h.device)
            agree = torch.zeros(N, dtype=torch.bool, device=h.device)
            for a in range(0, N, max(chunk, 1)):
                b = min(a + chunk, N)
                l, ag, st = checkpoint(self._chunk_loss, x[a:b], prev[a:b], W, sj[a:b], coef[a:b], v[a:b],
                                       agree_prev[a:b], teacher, use_reentrant=False)
                loss, s, agree[a:b] = loss + l, s + st, ag
            agree_prev = agree_prev & agree
            stats.append(s)
        return loss, torch.stack(stats)

    def _chunk_loss(self, x, prev, W, src, coef, valid, agree_prev, teacher):
        """One chunk of anchors at one slot: sum coef * [0.1 CE + 0.9 L1 + BCE], agree (c,), stats (5,)."""
        z = at_least_f32(F.linear(self.features(x, prev), W))  # (c, V)
        logq = torch.log_softmax(z, -1)
        q = logq.exp()
        t = teacher.logits(src)  # (c, V) the policy's logits at a + k
        p = torch.softmax(t, -1)
        ce = -(p * logq).sum(-1)
        alpha = torch.minimum(p, q).sum(-1)
        conf = self.confidence(self.norm(x)).squeeze(-1)
        bce = F.binary_cross_entropy_with_logits(at_least_f32(conf), alpha.detach(), reduction="none")
        rows = 0.1 * ce + 0.9 * (q - p).abs().sum(-1) + bce
        loss = (torch.where(valid, rows, 0) * coef).sum()
        with torch.no_grad():
            agree = z.argmax(-1) == t.argmax(-1)
            m = valid.double()
            st = torch.stack([(ce.double() * m).sum(), (agree * m).sum(), ((agree & agree_prev) * m).sum(),
                              (agree_prev * m).sum(), (alpha.double() * m).sum()])
        return loss, agree, st

    def check_exportable(self):  # drafter.py
        raise ValueError("a DSpark draft has no serving format here (vLLM's DFlash loader has no Markov head); "
                         "save() keeps it")

    def export(self, path: str, **kw):
        self.check_exportable()


if __name__ == "__main__":
    from parallel.cli import answer_help
    answer_help(__doc__, __file__)
    torch.manual_seed(0)
    target = Transformer(ModelConfig.preset("tiny")).eval()
    draft = DSparkDraft.from_target(target, mask_token_id=0, block_size=4, markov_rank=8)
    cu = torch.tensor([0, 9, 16, 30], dtype=torch.int32)
    tokens = torch.randint(1, target.cfg.vocab_size, (30,))
    with torch.no_grad():
        out = target(tokens, cu, tap_layers=draft.tap_layers)
    loss, m = draft.loss(out.taps, tokens, cu, out.logits, anchors=3)
    loss.backward()
    print(f"DSpark: {sum(p.numel() for p in draft.parameters()):,} parameters; loss {loss.item():.4f}, alpha per "
          f"slot {[round(a, 3) for a in m['alpha']]}, tau_hat {m['tau_hat']:.2f}")
    cache = draft.new_cache(1, 32)
    with torch.no_grad():
        state = draft.extend(cache, tokens[None, 1:9], {l: t[None, :8] for l, t in out.taps.items()},
                             torch.tensor([7]))
        d, _ = draft.propose(cache, state, 4, 1.0, torch.Generator().manual_seed(0))
    print(f"one block sampled through the Markov head after the first 9 tokens of sequence 0: {d[0].tolist()}")
