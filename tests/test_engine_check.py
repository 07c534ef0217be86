"""serving/engine_check.py and serving/weight_sum.py without an engine (~2 s): the losslessness statistics, the rule
that applies the expand workaround only on a failure and refuses an engine that fails with it, the stale-draft and
stale-policy tripwires, and the checksums' map onto vLLM's layout (tests/test_vllm_engine.py runs them against vLLM
itself)."""
import random

import pytest
import torch

from draft import Eagle3Draft
from model import ModelConfig, Transformer
from serving.engine_check import (EngineRefused, StaleDraft, StalePolicy, acceptance_gap, checked_engine, prefix_stats,
                                  verify_policy_refit, verify_refit)
from serving.export import eagle3_state_dict
from serving.vllm_engine import policy_state
from serving.vllm_worker import _policy_sum_rpc
from serving.weight_sum import engine_layout, weight_sum


class FakeEngine:
    """Speculative samples from `spec_p` (or `fixed_p` once the workaround is on), autoregressive from `ar_p`:
    every token drawn independently from its distribution."""

    def __init__(self, ar_p, spec_p, fixed_p):
        self.ar_p, self.spec_p, self.fixed_p, self.on, self.sum = ar_p, spec_p, fixed_p, False, "x"

    def expand_workaround(self, on):
        self.on = on

    def generate(self, prompts, *, temperature, max_tokens, stop=(), n=1, seed=0, spec=True):
        p = self.ar_p if not spec else self.fixed_p if self.on else self.spec_p
        rng = random.Random(seed)
        toks = [[rng.choices(range(len(p)), p, k=max_tokens) for _ in range(n)] for _ in prompts]
        return type("Out", (), {"tokens": toks, "acceptance_length": 2.0})()

    def draft_sum(self):
        return self.sum


def test_prefix_stats_support_and_tv():
    u, d = prefix_stats([[[1, 2], [1, 2], [3, 4], [1, 2]]], [[[1, 2], [1, 2], [1, 2], [5, 6]]], first=2)
    assert u == pytest.approx(2 / 8)  # 3 at position 0 and 4 at position 1: never sampled autoregressively there
    assert d == pytest.approx((0.5 * (0.25 + 0.25) + 0.5 * (0.25 + 0.25)) / 2)
    assert prefix_stats([[[1], [1, 2]]], [[[1, 2], [1, 2]]], first=2) == (0, 0)  # an ended sample has no token 2


def test_workaround_only_when_needed_and_refusal_names_the_check():
    good = [0.7, 0.2, 0.1, 0.0]
    r = checked_engine(FakeEngine(good, good, good), [[1]] * 4, n=256)
    assert r["ok"] and not r["workaround"]  # a lossless engine runs unpatched
    broken = [0.1, 0.1, 0.1, 0.7]  # token 3 the policy never writes
    r = checked_engine(FakeEngine(good, broken, good), [[1]] * 4, n=256)
    assert r["workaround"] and not r["without"]["ok"] and r["without"]["support"] > 0.5 and r["ok"]
    with pytest.raises(EngineRefused, match="engine refused: losslessness check failed.*support.*TV"):
        checked_engine(FakeEngine(good, broken, broken), [[1]] * 4, n=256)
    shifted = [0.2, 0.7, 0.1, 0.0]  # same support, other distribution: the TV bound catches it
    with pytest.raises(EngineRefused):
        checked_engine(FakeEngine(good, shifted, shifted), [[1]] * 4, n=256)


def test_stale_draft_and_acceptance_gap():
    torch.manual_seed(0)
    policy = Transformer(ModelConfig.preset("tiny")).eval()
    draft = Eagle3Draft.from_target(policy)
    eng = FakeEngine([1.0], [1.0], [1.0])
    eng.sum = weight_sum(eagle3_state_dict(draft, dtype=torch.float32).items())
    assert verify_refit(eng, draft) == eng.sum
    with torch.no_grad():
        draft.fc.weight.add_(1e-3)  # the trainer moved on, the engine was not refit
    with pytest.raises(StaleDraft, match="stale draft"):
        verify_refit(eng, draft)
    assert acceptance_gap(2.0, 2.1, 0.2) is None and "stale" in acceptance_gap(1.0, 2.1, 0.2)


def test_weight_sum_in_vllms_layout_and_bf16_exact():
    torch.manual_seed(0)
    policy = Transformer(ModelConfig.preset("tiny")).eval()
    draft = Eagle3Draft.from_target(policy, draft_vocab=torch.arange(5, 45))
    sd = eagle3_state_dict(draft, dtype=torch.float32)
    eng = engine_layout(sd.items())
    assert "model.layers.0.self_attn.qkv_proj.weight" in eng and "draft_id_to_target_id" in eng
    assert not any(k.endswith(("q_proj.weight", "t2d")) for k in eng)
    assert torch.equal(eng["model.layers.0.mlp.gate_up_proj.weight"],
                       torch.cat([sd["midlayer.mlp.gate_proj.weight"], sd["midlayer.mlp.up_proj.weight"]]))
    assert weight_sum(eng.items(), engine_names=True) == weight_sum(sd.items())
    bf = eagle3_state_dict(draft, dtype=torch.bfloat16)  # an fp32 engine loading the bf16 export: the same sum
    assert weight_sum(bf.items()) == weight_sum({k: v.float() if v.is_floating_point() else v
                                                 for k, v in bf.items()}.items())
    assert weight_sum(bf.items()) != weight_sum(sd.items())


class FakeWorker:
    """What _policy_sum_rpc reads of a vLLM worker: model_runner.model.named_parameters(remove_duplicate=False)."""

    def __init__(self, named: dict):
        model = type("M", (), {"named_parameters": lambda self, remove_duplicate=True: list(named.items())})()
        self.model_runner = type("R", (), {"model": model})()


def test_policy_sum_read_back_from_vllms_layout_and_the_stale_policy_tripwire():
    torch.manual_seed(0)
    policy = Transformer(ModelConfig.preset("tiny")).eval()
    sd = policy_state(policy)
    eng = engine_layout(sd.items(), prefix="")  # what the worker's refit wrote: stacks, HF names
    assert "model.layers.0.self_attn.qkv_proj.weight" in eng and "model.embed_tokens.weight" in eng
    padded = dict(eng)
    e = eng["model.embed_tokens.weight"]
    padded["model.embed_tokens.weight"] = torch.cat([e, torch.randn(6, e.shape[1])])  # vLLM pads the vocabulary
    shapes = {k: list(v.shape) for k, v in eng.items()}
    got = _policy_sum_rpc(FakeWorker(padded), shapes)
    fake = type("E", (), {"dtype": "float32"})()
    assert verify_policy_refit(fake, policy, got) == got  # padding cut off, stacks and names as the trainer's
    assert got != weight_sum(eagle3_state_dict(Eagle3Draft.from_target(policy), dtype=torch.float32).items())
    with torch.no_grad():
        policy.model.layers["0"].self_attn.q_proj.weight.add_(1e-3)  # the trainer moved on, the engine was not refit
    with pytest.raises(StalePolicy, match="stale policy: the engine's policy weight_sum"):
        verify_policy_refit(fake, policy, got)
    with pytest.raises(ValueError, match="policy_sum: the engine has no readable parameters"):
        _policy_sum_rpc(FakeWorker({**padded, "model.norm.weight": torch.zeros(0)}), shapes)  # a packed-away weight
