"""Activation checkpointing per decoder layer (model.Transformer(activation_checkpointing=True)) changes memory, not
the math: logits, taps and every gradient equal the plain model in fp64 (to 1e-12), on one process with the default
packed attention and under CP (ring attention recomputed in backward, cp = 2 ranks as threads), and on a pipeline
stage slice. A KV-cache forward is never checkpointed (a recompute would fill the cache twice)."""
import functools

import pytest
import torch

from attention_cp import ring_branch_attention
from branch_mask import cu_seqlens_from_lengths, pad_for_cp, position_ids, zigzag_shard
from model import EMBED_TAP, ModelConfig, Transformer
from parallel.ring import run_ranks

pytestmark = pytest.mark.usefixtures("one_thread")
TOL = 1e-12
TAPS = (EMBED_TAP, 1, 2)


def _pair(layers=None):
    torch.manual_seed(0)
    cfg = ModelConfig.preset("tiny")
    plain = Transformer(cfg, layers=layers).double()
    ckpt = Transformer(cfg, layers=layers, activation_checkpointing=True).double()
    ckpt.load_state_dict(plain.state_dict())
    return cfg, plain, ckpt


def _grads(m):
    return {n: p.grad.clone() for n, p in m.named_parameters()}


def _close(a, b):
    return max(float((a[k] - b[k]).abs().max()) for k in a) <= TOL


def test_checkpointed_equals_plain_fp64():
    cfg, plain, ckpt = _pair()
    cu = torch.tensor([0, 7, 12, 20], dtype=torch.int32)
    tok = torch.randint(cfg.vocab_size, (20,), generator=torch.Generator().manual_seed(1))
    w = torch.randn(20, cfg.vocab_size, dtype=torch.float64)
    outs = []
    for m in (plain, ckpt):
        o = m(tok, cu, tap_layers=TAPS)
        ((o.logits * w).sum() + sum(t.square().sum() for t in o.taps.values())).backward()
        outs.append((o, _grads(m)))
    (a, ga), (b, gb) = outs
    assert float((a.logits - b.logits).detach().abs().max()) <= TOL
    assert all(float((a.taps[t] - b.taps[t]).detach().abs().max()) <= TOL for t in TAPS)
    assert _close(ga, gb)
    with torch.no_grad():  # no graph: the checkpointed model runs as the plain one
        assert torch.equal(ckpt(tok, cu).logits, plain(tok, cu).logits)


def test_checkpointed_stage_slice_with_hidden_input():
    cfg, plain, ckpt = _pair(layers=(1, 3))
    cu = torch.tensor([0, 5, 9], dtype=torch.int32)
    x = torch.randn(9, cfg.hidden_size, dtype=torch.float64)
    grads = []
    for m in (plain, ckpt):
        xi = x.clone().requires_grad_()
        m(xi, cu).hidden.square().sum().backward()
        grads.append(({"x": xi.grad}, _grads(m)))
    assert _close(grads[0][0], grads[1][0]) and _close(grads[0][1], grads[1][1])


def test_checkpointed_equals_plain_under_cp_ring():
    cfg, plain, ckpt = _pair()
    cp = 2
    cu = pad_for_cp(cu_seqlens_from_lengths([6, 11]), cp).cu_seqlens
    tok = torch.randint(cfg.vocab_size, (int(cu[-1]),), generator=torch.Generator().manual_seed(2))
    pos = position_ids(cu)

    def run(model):
        def rank(ring):
            shard = lambda x: zigzag_shard(x, cu, cp, ring.rank)  # noqa: E731
            m = Transformer(cfg, activation_checkpointing=model.activation_checkpointing).double()
            m.load_state_dict(model.state_dict())
            out = m(shard(tok), cu, shard(pos), attn_fn=functools.partial(ring_branch_attention, group=ring))
            out.logits.square().sum().backward()
            return out.logits.detach(), _grads(m)
        return run_ranks(cp, rank, timeout=60)

    for (la, ga), (lb, gb) in zip(run(plain), run(ckpt)):
        assert float((la - lb).abs().max()) <= TOL and _close(ga, gb)


def test_kv_cache_forward_is_not_checkpointed(monkeypatch):
    cfg, plain, ckpt = _pair()
    calls = []
    real = torch.utils.checkpoint.checkpoint
    monkeypatch.setattr(torch.utils.checkpoint, "checkpoint", lambda *a, **k: calls.append(1) or real(*a, **k))
    tok = torch.randint(cfg.vocab_size, (2, 4), generator=torch.Generator().manual_seed(3))
    ckpt.forward_cached(tok, ckpt.new_cache(2, 8))
    assert calls == []
    ckpt(tok[0], torch.tensor([0, 4], dtype=torch.int32))
    assert len(calls) == cfg.num_hidden_layers
