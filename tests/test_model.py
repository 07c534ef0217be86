"""model.py + hf_io.py: HF parity for the three families, packed == separate, cache == recompute, slices, errors."""
import json
import os

import pytest
import torch
from hypothesis import given, settings, strategies as st

from branch_mask import cu_seqlens_from_lengths, position_ids
from serving.hf_io import from_pretrained, save_pretrained
import model
from modeling import layers
from model import EMBED_TAP, ModelConfig, Transformer, check_tap_layers, default_tap_layers, greedy_generate
from modeling.layers import rope_cos_sin


COMMON = dict(vocab_size=101, hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=256, initializer_range=0.2, rope_theta=5000.0)
FAMILIES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", dict(attention_bias=True)),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", dict(tie_word_embeddings=True)),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(head_dim=16)),
}


def cu(lens):
    return cu_seqlens_from_lengths(lens)


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def hf_pair(request, tmp_path_factory):
    transformers = pytest.importorskip("transformers", reason="HF parity needs transformers (pip install -e '.[test]')")
    cfg_cls, model_cls, extra = FAMILIES[request.param]
    torch.manual_seed(0)
    hf = getattr(transformers, model_cls)(getattr(transformers, cfg_cls)(**COMMON, **extra)).eval()
    with torch.no_grad():  # HF zero-inits biases; make them matter for the parity check
        for n, p in hf.named_parameters():
            if n.endswith("bias"):
                p.normal_(0, 0.2)
    path = tmp_path_factory.mktemp(request.param)
    hf.save_pretrained(path, max_shard_size="40KB")  # small shards: exercises the sharded index
    return request.param, hf, str(path)


def test_hf_parity_logits_and_greedy(hf_pair):
    name, hf, path = hf_pair
    assert os.path.exists(os.path.join(path, "model.safetensors.index.json")), "expected a sharded checkpoint"
    ours = from_pretrained(path).eval()
    assert ours.cfg.qkv_bias == (name in ("llama", "qwen2")) and ours.cfg.qk_norm == (name == "qwen3")
    torch.manual_seed(1)
    x = torch.randint(COMMON["vocab_size"], (2, 17))
    with torch.no_grad():
        ref = hf(x).logits
        for b in range(2):
            got = ours(x[b], cu([17])).logits
            torch.testing.assert_close(got, ref[b], atol=1e-5, rtol=0)
    prompts = [x[0, :9], x[1, :5]]  # ragged: each HF call runs one prompt alone, ours batches them
    gens = greedy_generate(ours, prompts, max_new_tokens=12)
    for p, g in zip(prompts, gens):
        with torch.no_grad():
            want = hf.generate(p[None], attention_mask=torch.ones(1, p.numel(), dtype=torch.long),
                               max_new_tokens=12, do_sample=False)[0, p.numel():]
        assert g.tolist() == want.tolist()


def test_save_load_roundtrip_exact(hf_pair, tmp_path):
    _, _, path = hf_pair
    a = from_pretrained(path)
    save_pretrained(a, tmp_path)
    b = from_pretrained(str(tmp_path))
    assert a.cfg == b.cfg
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)
    assert not [f for f in os.listdir(tmp_path) if f.startswith(".")], "temporary files left behind"


def test_a_checkpoint_loads_in_the_run_dtype_with_no_random_init_and_no_fp32_copy(hf_pair, tmp_path):
    """from_pretrained builds on the meta device and takes the file's tensors: a bf16 checkpoint loaded as bf16
    allocates no fp32 tensor (a randomly initialised model first would: its parameters are fp32); a stage slice reads
    only its own tensors."""
    from harness.memory_track import StorageTracker
    _, _, path = hf_pair
    ref = from_pretrained(path)
    save_pretrained(ref.to(torch.bfloat16), tmp_path)
    with StorageTracker(lambda t: f"{t.device.type} {t.dtype}") as tr:
        got = from_pretrained(str(tmp_path), dtype=torch.bfloat16)
    made = {cat for _, n, cat in tr.events if n > 0 and not cat.startswith("meta")}
    assert not made & {"cpu torch.float32", "cpu torch.float64"}, made  # bf16 weights (and the finite check's bools)
    sa, sb = ref.state_dict(), got.state_dict()
    assert all(sb[k].dtype == torch.bfloat16 and torch.equal(sb[k], sa[k].to(torch.bfloat16)) for k in sa)
    stage = from_pretrained(str(tmp_path), layers=(1, 2), dtype=torch.bfloat16)
    assert set(stage.state_dict()) == {k for k in sa if k.startswith("model.layers.1.")}


def test_hf_config_errors(tmp_path):
    base = {"architectures": ["LlamaForCausalLM"], "vocab_size": 11, "hidden_size": 8, "intermediate_size": 16,
            "num_hidden_layers": 1, "num_attention_heads": 2}
    for bad, match in [({"architectures": ["GPT2LMHeadModel"]}, "architectures"),
                       ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "rope type 'yarn'"),
                       ({"rope_parameters": {"rope_type": "llama3", "rope_theta": 1e4}}, "rope type 'llama3'"),
                       ({"hidden_act": "gelu"}, "hidden_act")]:
        with open(tmp_path / "config.json", "w") as f:
            json.dump({**base, **bad}, f)
        with pytest.raises(ValueError, match=match):
            from_pretrained(str(tmp_path))
    with pytest.raises(ValueError, match="config.json"):
        from_pretrained(str(tmp_path / "nowhere"))


# ------------------------------------------------------------------------------------------------ our own invariants
def tiny(seed=0, dtype=torch.float64, **kw):
    torch.manual_seed(seed)
    return Transformer(ModelConfig.preset("tiny", **kw)).to(dtype)


@settings(max_examples=8)
@given(lens=st.lists(st.integers(1, 12), min_size=1, max_size=4), seed=st.integers(0, 2 ** 16),
       arch=st.sampled_from([{}, {"qkv_bias": True}, {"qk_norm": True, "architecture": "Qwen3ForCausalLM"}]))
def test_packed_equals_separate(lens, seed, arch):
    m = tiny(seed, **arch)
    toks = torch.randint(m.cfg.vocab_size, (sum(lens),), generator=torch.Generator().manual_seed(seed))
    taps = default_tap_layers(m.cfg.num_hidden_layers) + (EMBED_TAP,)
    packed = m(toks, cu(lens), tap_layers=taps)
    for s, (a, b) in enumerate(zip(cu(lens)[:-1].tolist(), cu(lens)[1:].tolist())):
        alone = m(toks[a:b], cu([b - a]), tap_layers=taps)
        torch.testing.assert_close(packed.logits[a:b], alone.logits, atol=1e-12, rtol=0)
        for t in taps:
            torch.testing.assert_close(packed.taps[t][a:b], alone.taps[t], atol=1e-12, rtol=0)


def test_taps_are_hidden_after_layer():
    m = tiny()
    toks = torch.randint(97, (10,))
    out = m(toks, cu([10]), tap_layers=(EMBED_TAP, 0, 2, 3))
    torch.testing.assert_close(out.taps[EMBED_TAP], m.embed(toks), atol=0, rtol=0)
    for l in (0, 2):  # a non-last stage slice [0, l+1) returns exactly the hidden state after layer l
        stage = Transformer(m.cfg, layers=(0, l + 1)).to(torch.float64)
        stage.load_slice(m.state_dict())
        torch.testing.assert_close(out.taps[l], stage(toks, cu([10])).hidden, atol=0, rtol=0)
    torch.testing.assert_close(m.model.norm(out.taps[3]), out.hidden, atol=0, rtol=0)  # last layer: before the norm


def test_default_tap_rule():
    assert default_tap_layers(32) == (1, 15, 28)
    assert default_tap_layers(8) == (1, 3, 4)
    assert default_tap_layers(6) == (1, 2, 3)  # (1, 2, 2): the collision pushed up one layer
    assert default_tap_layers(4) == (0, 1, 2)  # (1, 1, 0) -> sorted (0, 1, 1) -> (0, 1, 2)
    assert default_tap_layers(5) == (1, 2, 3)
    assert default_tap_layers(3) == (0, 1) and default_tap_layers(2) == (0, 1) and default_tap_layers(1) == (0,)
    for n in range(1, 200):
        t = default_tap_layers(n)
        assert all(0 <= i < n for i in t) and list(t) == sorted(set(t))
        if n >= 4:  # exportable to vLLM / SGLang: exactly 3 taps, none on the last layer
            assert len(t) == 3 and max(t) <= n - 2
    with pytest.raises(ValueError, match="tap_layers"):
        check_tap_layers((0, 4), 4)
    with pytest.raises(ValueError, match="tap_layers"):
        check_tap_layers((-2,), 4)
    with pytest.raises(ValueError, match="duplicate"):
        check_tap_layers((1, 1), 4)


@settings(max_examples=6)
@given(lens=st.lists(st.integers(1, 8), min_size=1, max_size=4), steps=st.lists(st.integers(1, 4), min_size=1,
                                                                                 max_size=4),
       seed=st.integers(0, 2 ** 16))
def test_cache_equals_recompute(lens, steps, seed):
    """Right-padded prefill + rollback, then several appends of S tokens: every logit equals a fresh full forward."""
    m = tiny(seed)
    g = torch.Generator().manual_seed(seed)
    B = len(lens)
    seqs = [torch.randint(97, (n,), generator=g) for n in lens]
    cache = m.new_cache(B, max(lens) + sum(steps))
    x = torch.zeros(B, max(lens), dtype=torch.long)
    for b, s in enumerate(seqs):
        x[b, : s.numel()] = s
    logits = m.forward_cached(x, cache).logits
    cache.rollback(torch.tensor(lens))
    for b, s in enumerate(seqs):
        torch.testing.assert_close(logits[b, : s.numel()], m(s, cu([s.numel()])).logits, atol=1e-12, rtol=0)
    for S in steps:
        new = torch.randint(97, (B, S), generator=g)
        logits = m.forward_cached(new, cache).logits
        for b in range(B):
            seqs[b] = torch.cat([seqs[b], new[b]])
            full = m(seqs[b], cu([seqs[b].numel()])).logits
            torch.testing.assert_close(logits[b], full[-S:], atol=1e-12, rtol=0)
    assert cache.lengths.tolist() == [s.numel() for s in seqs]


def test_logits_at_one_position_per_row():
    """forward_cached(logits_at=): (B, V) logits at one new position per row == those rows of the full (B, S, V)."""
    torch.manual_seed(0)
    m = Transformer(ModelConfig.preset("tiny")).double()
    x = torch.randint(m.cfg.vocab_size, (3, 6))
    full = m.forward_cached(x, m.new_cache(3, 8)).logits  # (3, 6, V)
    at = torch.tensor([5, 0, 3])
    out = m.forward_cached(x, m.new_cache(3, 8), logits_at=at)
    assert out.logits.shape == (3, m.cfg.vocab_size) and out.hidden.shape == (3, 6, m.cfg.hidden_size)
    torch.testing.assert_close(out.logits, full[torch.arange(3), at], rtol=1e-12, atol=1e-12)
    with pytest.raises(ValueError, match="logits_at"):
        m.forward_cached(x, m.new_cache(3, 8), logits_at=at[:2])


def test_per_row_rollback():
    """Rows advance by different amounts: append 4, keep 1 / 3 / 4, then continue — equals the kept prefixes."""
    m = tiny(3)
    seqs = [torch.randint(97, (n,)) for n in (5, 2, 7)]
    cache = m.new_cache(3, 20)
    x = torch.zeros(3, 7, dtype=torch.long)
    for b, s in enumerate(seqs):
        x[b, : s.numel()] = s
    m.forward_cached(x, cache)
    cache.rollback(torch.tensor([5, 2, 7]))
    spec = torch.randint(97, (3, 4))
    m.forward_cached(spec, cache)
    keep = [1, 3, 4]
    cache.rollback(torch.tensor([5 + 1, 2 + 3, 7 + 4]))
    seqs = [torch.cat([s, spec[b, :k]]) for b, (s, k) in enumerate(zip(seqs, keep))]
    nxt = torch.randint(97, (3, 2))
    logits = m.forward_cached(nxt, cache).logits
    for b in range(3):
        full = m(torch.cat([seqs[b], nxt[b]]), cu([seqs[b].numel() + 2])).logits
        torch.testing.assert_close(logits[b], full[-2:], atol=1e-12, rtol=0)
    with pytest.raises(RuntimeError, match="rollback"):  # device-side asserts (no host sync): RuntimeError on CPU
        cache.rollback(torch.tensor([100, 0, 0]))
    with pytest.raises(RuntimeError, match="overflow"):
        m.forward_cached(torch.zeros(3, 20, dtype=torch.long), cache)
    with pytest.raises(RuntimeError, match="begin"):
        cache.write(0, torch.zeros(3, 1, 2, 8), torch.zeros(3, 1, 2, 8))


@pytest.mark.parametrize("cuts", [(0, 2, 4), (0, 1, 2, 3, 4), (0, 3, 4)])
@pytest.mark.parametrize("tied", [False, True])
def test_stage_slices_chain_to_full(cuts, tied):
    full = tiny(7, tie_word_embeddings=tied)
    toks, c = torch.randint(97, (13,)), cu([6, 7])
    taps = (EMBED_TAP, 0, 1, 2, 3)
    ref = full(toks, c, tap_layers=taps)
    x, got_taps = toks, {}
    for a, b in zip(cuts[:-1], cuts[1:]):
        stage = Transformer(full.cfg, layers=(a, b)).to(torch.float64)
        stage.load_slice(full.state_dict())
        own_layers = tuple("model.layers.%d." % i for i in range(a, b))
        assert all(k.startswith(own_layers) or not k.startswith("model.layers.") for k in stage.state_dict())
        out = stage(x, c, tap_layers=taps)
        got_taps.update(out.taps)
        x = out.hidden
    torch.testing.assert_close(out.logits, ref.logits, atol=0, rtol=0)
    assert sorted(got_taps) == sorted(taps)
    for t in taps:
        torch.testing.assert_close(got_taps[t], ref.taps[t], atol=0, rtol=0)


def rope_direct(pos, D, theta, dtype):  # the textbook formula, per position, no table
    inv_freq = 1.0 / theta ** (torch.arange(0, D, 2, dtype=torch.float64) / D)
    ang = pos.double()[..., None] * inv_freq
    return torch.cat([ang, ang], -1).cos().to(dtype), torch.cat([ang, ang], -1).sin().to(dtype)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
def test_rope_table_equals_direct(dtype):
    """The cached table gives the direct formula's values for any positions, bit for bit, grows past its first size,
    and a table first built under inference_mode still serves forwards that autograd records."""
    layers._ROPE_TABLES.clear()
    with torch.inference_mode():
        rope_cos_sin(torch.arange(3), 16, 5000.0, dtype)
    for pos in (torch.arange(7), torch.tensor([[5, 0], [1023, 1024]]), torch.tensor([70000, 3])):
        got, want = rope_cos_sin(pos, 16, 5000.0, dtype), rope_direct(pos, 16, 5000.0, dtype)
        assert got[0].shape == pos.shape + (16,)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    assert layers._ROPE_TABLES[(16, 5000.0, dtype, torch.device("cpu"))][0].shape[0] == 1 << 17  # 70001 -> 2^17
    if dtype != torch.bfloat16:
        x = torch.randn(7, 16, dtype=dtype, requires_grad=True)
        cos, sin = rope_cos_sin(torch.arange(7), 16, 5000.0, dtype)
        (x * cos + x * sin).sum().backward()
        torch.testing.assert_close(x.grad, cos + sin, atol=0, rtol=0)
    layers._ROPE_TABLES.clear()


def test_position_ids():
    assert position_ids(cu([3, 1, 2])).tolist() == [0, 1, 2, 0, 0, 1]


def test_bad_input_errors():
    m = tiny(dtype=torch.float32)
    toks = torch.randint(97, (6,))
    with pytest.raises(TypeError, match="tokens"):
        m(toks.float(), cu([6]))
    with pytest.raises(ValueError, match="tokens"):
        m(toks[None], cu([6]))
    with pytest.raises(ValueError, match="tokens"):
        m(toks + 1000, cu([6]))
    with pytest.raises(ValueError, match="tokens"):
        m(toks - 100, cu([6]))
    with pytest.raises(ValueError, match="cu_seqlens"):
        m(toks, torch.tensor([0, 4, 3, 6], dtype=torch.int32))
    with pytest.raises(ValueError, match="cu_seqlens"):
        m(toks, cu([2, 3]))  # sums to 5 != 6
    with pytest.raises(ValueError, match="cu_seqlens"):
        m(toks, torch.tensor([1, 6], dtype=torch.int32))
    with pytest.raises(TypeError, match="cu_seqlens"):
        m(toks, [0, 6])
    with pytest.raises(ValueError, match="position_ids"):
        m(toks, cu([6]), position_ids=torch.arange(5))
    with pytest.raises(ValueError, match="tap_layers"):
        m(toks, cu([6]), tap_layers=(9,))
    stage = Transformer(m.cfg, layers=(2, 4))
    with pytest.raises(TypeError, match="hidden"):
        stage(toks, cu([6]))
    with pytest.raises(ValueError, match="hidden"):
        stage(torch.zeros(6, 5), cu([6]))
    with pytest.raises(ValueError, match="layers"):
        Transformer(m.cfg, layers=(3, 9))
    with pytest.raises(ValueError, match="architecture"):
        ModelConfig(architecture="GPT2")
    with pytest.raises(ValueError, match="num_key_value_heads"):
        ModelConfig(num_attention_heads=4, num_key_value_heads=3)
    with pytest.raises(ValueError, match="preset"):
        ModelConfig.preset("huge")
    with pytest.raises(ValueError, match="batch"):
        m.forward_cached(torch.zeros(2, 3, dtype=torch.long), m.new_cache(3, 8))
    with pytest.raises(ValueError, match="prompts"):
        greedy_generate(m, [torch.zeros(0, dtype=torch.long)], 3)
