"""modeling.layers.cached_attention, the KV-cache attention of prefill and decode: against dense fp64 attention with
GQA expanded and the full mask, at block sizes that cut a prefill into several blocks of query rows (a byte budget),
for chains (per-row causal) and trees (KVCache.visible's mask); and the prefill's peak temporaries stay O(P), not
O(P^2). Adds ~2 s.
"""
import math

import pytest
import torch

from model import ModelConfig, Transformer
import modeling.layers as layers
from modeling.layers import cached_attention


def _dense(q, K, V, mask, scale):  # the reference: GQA expanded, the whole (B, S, Lk) mask at once, fp64
    G = q.shape[2] // K.shape[1]
    Ke, Ve = K.repeat_interleave(G, 1), V.repeat_interleave(G, 1)  # (B, Hq, Lk, D)
    s = torch.einsum("bshd,bhld->bhsl", q, Ke) * scale
    s = s.masked_fill(~mask[:, None], float("-inf"))
    return torch.einsum("bhsl,bhld->bshd", s.softmax(-1), Ve)


@pytest.mark.parametrize("scores_mib", [1e-4, 2e-3, 256.0])  # 1 row per block, a few rows, one block
@pytest.mark.parametrize("Hq,Hkv", [(4, 1), (4, 2), (2, 2)])
def test_blocks_and_gqa_match_dense(scores_mib, Hq, Hkv):
    g = torch.Generator().manual_seed(Hq * 10 + Hkv)
    B, S, Lk, D = 3, 7, 19, 8
    q = torch.randn(B, S, Hq, D, generator=g, dtype=torch.float64)
    K, V = (torch.randn(B, Hkv, Lk, D, generator=g, dtype=torch.float64) for _ in range(2))
    pos = torch.tensor([3, 12, 0])[:, None] + torch.arange(S)  # per-row lengths 3, 12, 0: causal per row
    mask = torch.arange(Lk)[None, None] <= pos[:, :, None]
    mask[1, 2, 5] = False  # a tree-like hole: visible() may return any mask
    got = cached_attention(q, K, V, lambda lo, hi: mask[:, lo:hi], 1 / math.sqrt(D), scores_mib=scores_mib)
    torch.testing.assert_close(got, _dense(q, K, V, mask, 1 / math.sqrt(D)), atol=1e-12, rtol=1e-12)


def test_prefill_holds_no_quadratic_tensor(monkeypatch):
    """A prefill of P = 512 tokens with a tiny block budget: no tensor allocated during the forward reaches P^2
    elements (the old path's (B, S, Lk) mask and (B, H, S, Lk) scores did)."""
    torch.manual_seed(0)
    model = Transformer(ModelConfig.preset("tiny", num_hidden_layers=2)).eval()
    P = 512
    cache = model.new_cache(1, P)
    biggest = [0]

    class Track(torch.utils._python_dispatch.TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in out if isinstance(out, (tuple, list)) else (out,):
                if isinstance(t, torch.Tensor):
                    biggest[0] = max(biggest[0], t.numel())
            return out

    monkeypatch.setattr(layers, "CACHED_SCORES_MIB", 0.25)  # 64K fp32 scores per block: 32 rows x 4 heads x 512
    with torch.no_grad(), Track():
        model.forward_cached(torch.randint(model.cfg.vocab_size, (1, P)), cache, logits_at=torch.tensor([P - 1]))
    assert biggest[0] < P * P, f"a {biggest[0]}-element tensor in a {P}-token prefill (P^2 = {P * P})"
