"""export.py: the draft in vLLM's / SGLang's LlamaForCausalLMEagle3 format, checked without an engine.

The reference below is written from the engines' formulas (vLLM llama_eagle3.py / SGLang llama_eagle3.py), reading
only the exported config.json + model.safetensors and a transformers Llama's output_hidden_states at the exported
aux ids -- never the project's draft. It must give the project's draft-inference logits (Eagle3Draft.extend / step) at
every position, fp64, for a full and a reduced vocabulary.
"""
import json
import math
import os

import pytest
import torch
from safetensors.torch import load_file, save_file

from serving import export
from draft import Eagle3Draft
from serving.hf_io import from_pretrained, save_pretrained
from model import ModelConfig, Transformer
from harness.draft_formats import load_draft

TOL = dict(rtol=1e-9, atol=1e-9)  # fp64 end to end; the two paths differ only by summation order


def _pair(n_layers=6, vocab=97, seed=0, draft_vocab=None):
    """A random fp64 policy and a draft whose every weight is random (norm weights too, so a swapped norm shows)."""
    torch.manual_seed(seed)
    policy = Transformer(ModelConfig.preset("tiny", num_hidden_layers=n_layers, vocab_size=vocab)).double().eval()
    draft = Eagle3Draft.from_target(policy, draft_vocab=draft_vocab)
    with torch.no_grad():
        for name, p in draft.named_parameters():
            p.add_(0.3 * torch.randn_like(p)) if name.endswith("norm.weight") else p.normal_(0, 0.2)
    return policy, draft.eval()


class _Consumed(dict):  # records which exported tensors the reference read
    def __init__(self, *a):
        super().__init__(*a)
        self.read = set()

    def __getitem__(self, k):
        self.read.add(k)
        return super().__getitem__(k)


def _rms(x, w, eps):
    return w * x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + eps)


def _rope(x, pos, theta):  # x (N, heads, D); HF's rotate_half convention, which both engines' Llama RoPE follows
    D = x.shape[-1]
    ang = pos.double()[:, None] * theta ** (-torch.arange(0, D, 2, dtype=torch.float64) / D)  # (N, D/2)
    cos, sin = torch.cat([ang.cos()] * 2, -1)[:, None], torch.cat([ang.sin()] * 2, -1)[:, None]
    x1, x2 = x.chunk(2, -1)
    return x * cos + torch.cat([-x2, x1], -1) * sin


def _engine_layer(W, cfg, e, h, pos):
    """The EAGLE-3 midlayer over N rows attending causally in row order: e, h (N, H) -> the pre-norm output (N, H)."""
    eps, Hq, Hkv, D = cfg["rms_norm_eps"], cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    assert cfg["norm_before_residual"] is False  # residual = h itself, hidden_norm only on the attention input
    x = torch.cat([_rms(e, W["midlayer.input_layernorm.weight"], eps),
                   _rms(h, W["midlayer.hidden_norm.weight"], eps)], -1)  # (N, 2H)
    N = x.shape[0]
    q = _rope((x @ W["midlayer.self_attn.q_proj.weight"].T).view(N, Hq, D), pos, cfg["rope_theta"])
    k = _rope((x @ W["midlayer.self_attn.k_proj.weight"].T).view(N, Hkv, D), pos, cfg["rope_theta"])
    v = (x @ W["midlayer.self_attn.v_proj.weight"].T).view(N, Hkv, D)
    k, v = (t.repeat_interleave(Hq // Hkv, dim=1) for t in (k, v))  # GQA
    s = torch.einsum("ihd,jhd->hij", q, k) / math.sqrt(D)
    s = s.masked_fill(torch.ones(N, N, dtype=torch.bool).triu(1), float("-inf"))
    o = torch.einsum("hij,jhd->ihd", s.softmax(-1), v).reshape(N, Hq * D)
    r = h + o @ W["midlayer.self_attn.o_proj.weight"].T
    y = _rms(r, W["midlayer.post_attention_layernorm.weight"], eps)
    y = torch.nn.functional.silu(y @ W["midlayer.mlp.gate_proj.weight"].T) * (y @ W["midlayer.mlp.up_proj.weight"].T)
    return r + y @ W["midlayer.mlp.down_proj.weight"].T


def _engine_logits(W, cfg, h):  # (N, H) -> (N, V): the draft head, then d2t places the rows among the target ids
    z = _rms(h, W["norm.weight"], cfg["rms_norm_eps"]) @ W["lm_head.weight"].T  # (N, Vd)
    if cfg["draft_vocab_size"] == cfg["vocab_size"]:  # vLLM: no draft_id_to_target_id, the rows are the target ids
        assert "d2t" not in W and "t2d" not in W
        return z
    ids = torch.arange(cfg["draft_vocab_size"]) + W["d2t"]
    assert torch.equal(W["t2d"], torch.zeros(cfg["vocab_size"], dtype=torch.bool).index_fill(0, ids, True))
    return z.new_full((z.shape[0], cfg["vocab_size"]), float("-inf")).index_copy(1, ids, z)


def _fp64(hf):
    """transformers computes RMSNorm statistics and RoPE angles in fp32 even in an fp64 model (the hidden states come
    out ~5e-9 off, the draft's logits ~3e-7); the same formulas in fp64 keep the comparison at fp64 precision."""
    D = hf.config.head_dim
    inv_freq = hf.config.rope_parameters["rope_theta"] ** (-torch.arange(0, D, 2, dtype=torch.float64) / D)

    def rope(x, position_ids):  # -> cos, sin (B, T, D)
        ang = position_ids[..., None].double() * inv_freq
        ang = torch.cat([ang, ang], -1)
        return ang.cos().to(x.dtype), ang.sin().to(x.dtype)
    hf.model.rotary_emb.forward = rope
    norms = [m for m in hf.modules() if type(m).__name__ == "LlamaRMSNorm"]
    assert len(norms) == 2 * hf.config.num_hidden_layers + 1
    for m in norms:
        m.forward = lambda h, m=m: m.weight * h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + m.variance_epsilon)
    return hf


def _export(draft, tmp_path, dtype):
    path = str(tmp_path / "draft")
    draft.export(path, dtype=dtype)
    with open(os.path.join(path, "config.json")) as f:
        return json.load(f), _Consumed(load_file(os.path.join(path, "model.safetensors")))


@pytest.mark.parametrize("reduced", [False, True])
def test_engine_formulas_match_draft_inference(tmp_path, reduced):
    transformers = pytest.importorskip("transformers",
                                       reason="the reference reads a transformers Llama's hidden states")
    V = 97
    policy, draft = _pair(vocab=V, draft_vocab=torch.randperm(V)[:40] if reduced else None)
    cfg, W = _export(draft, tmp_path, torch.float64)
    transformers.LlamaConfig(**cfg)  # parses as a Llama config (vLLM / SGLang build one from it)
    save_pretrained(policy, str(tmp_path / "policy"))
    hf = transformers.LlamaForCausalLM.from_pretrained(str(tmp_path / "policy"), dtype=torch.float64).eval()
    _fp64(hf)
    T = 12
    x = torch.randint(V, (T,))
    with torch.no_grad():
        hs = hf(x[None], output_hidden_states=True).hidden_states  # hs[j] (1, T, H): the state entering layer j
        aux_v = [hs[j][0] for j in cfg["eagle_aux_hidden_state_layer_ids"]]
        aux_s = [hs[j + 1][0] for j in cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"]]  # SGLang adds one
        for a, b in zip(aux_v, aux_s):
            assert torch.equal(a, b)
        embed = hf.model.embed_tokens.weight  # the draft has none: the engines share the target's
        # engine step 1 at anchor i: token x_{i+1}, hidden fc(aux_i), position i, causal over anchors 0..i
        h0 = torch.cat(aux_v, -1) @ W["fc.weight"].T  # (T, H)
        e = embed[x[1:]]  # (T-1, H)
        h1 = _engine_layer(W, cfg, e, h0[:-1], torch.arange(T - 1))
        ref = _engine_logits(W, cfg, h1)  # (T-1, V)
        # engine step 2 after the last anchor: its proposal, the pre-norm state it returned, position T-1
        y = ref[-1].argmax()
        h2 = _engine_layer(W, cfg, torch.cat([e, embed[y][None]]), torch.cat([h0[:-1], h1[-1:]]), torch.arange(T))
        ref2 = _engine_logits(W, cfg, h2[-1:])
        # the project's draft inference, one position at a time on its own KV cache
        taps = policy(x, torch.tensor([0, T], dtype=torch.int32), tap_layers=draft.tap_layers).taps
        cache, got = draft.new_cache(1, T + 1), []
        for i in range(T - 1):
            h, z = draft.extend(cache, x[None, i + 1: i + 2], {l: t[None, i: i + 1] for l, t in taps.items()},
                                torch.tensor([0]))
            got.append(z[0])
        _, z2 = draft.step(cache, y[None], h)
    names = set(export.exported_names(cfg["draft_vocab_size"], V))
    assert W.read == names == set(W), "every exported tensor is read and none is missing"
    assert ("d2t" in names) == reduced
    torch.testing.assert_close(torch.stack(got), ref, **TOL)  # -inf outside the draft vocabulary on both sides
    torch.testing.assert_close(z2, ref2, **TOL)
    assert bool(torch.isinf(ref).any()) == reduced


def test_bf16_export_dtypes_and_shapes(tmp_path):
    policy, draft = _pair(draft_vocab=torch.arange(10, 50))
    cfg, W = _export(draft, tmp_path, torch.bfloat16)
    H, Hq, Hkv, D = cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    want = {"fc.weight": (H, 3 * cfg["target_hidden_size"]), "lm_head.weight": (cfg["draft_vocab_size"], H),
            "d2t": (cfg["draft_vocab_size"],), "t2d": (cfg["vocab_size"],),
            "midlayer.self_attn.q_proj.weight": (Hq * D, 2 * H), "midlayer.self_attn.k_proj.weight": (Hkv * D, 2 * H),
            "midlayer.mlp.gate_proj.weight": (cfg["intermediate_size"], H)}
    assert set(W) == set(export.WEIGHTS + export.VOCAB_MAPS) and not any("embed" in k for k in W)
    for k, shape in want.items():
        assert tuple(W[k].shape) == shape, k
    assert W["d2t"].dtype == torch.int64 and W["t2d"].dtype == torch.bool
    assert all(W[k].dtype == torch.bfloat16 for k in W if k not in ("d2t", "t2d"))
    assert cfg["torch_dtype"] == "bfloat16" and cfg["draft_vocab_size"] == 40 and cfg["vocab_size"] == 97
    assert cfg["architectures"] == ["LlamaForCausalLMEagle3"] and cfg["num_hidden_layers"] == 1
    assert cfg["tie_word_embeddings"] is False and isinstance(cfg["draft_vocab_size"], int)
    taps = list(draft.tap_layers)
    assert cfg["eagle_aux_hidden_state_layer_ids"] == [t + 1 for t in taps]
    assert cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == taps
    assert torch.equal(W["lm_head.weight"], draft.lm_head.weight.detach().to(torch.bfloat16))
    assert torch.equal(W["d2t"] + torch.arange(40), torch.arange(10, 50))
    assert export.check_export(str(tmp_path / "draft")) == cfg


def test_check_export_names_what_is_wrong(tmp_path):
    _, draft = _pair()
    draft.export(str(tmp_path / "d"))
    sd = load_file(str(tmp_path / "d" / "model.safetensors"))
    sd["midlayers.0.fc.weight"] = sd.pop("fc.weight")  # a name SGLang would silently ignore
    save_file(sd, str(tmp_path / "d" / "model.safetensors"))
    with pytest.raises(ValueError, match="fc.weight"):
        export.check_export(str(tmp_path / "d"))


def test_unexportable_taps_are_clear_errors(tmp_path):
    policy, _ = _pair(n_layers=6)
    with pytest.raises(ValueError, match="exactly 3"):
        Eagle3Draft.from_target(policy, tap_layers=(1, 3)).export(str(tmp_path / "a"))
    with pytest.raises(ValueError, match="last"):
        Eagle3Draft.from_target(policy, tap_layers=(1, 3, 5)).export(str(tmp_path / "b"))
    small, _ = _pair(n_layers=3)  # default taps (0, 1): trainable, not servable
    with pytest.raises(ValueError, match="exactly 3"):
        Eagle3Draft.from_target(small).export(str(tmp_path / "c"))
    assert not any(p.name.startswith(("a", "b", "c")) for p in tmp_path.iterdir())  # nothing half-written


def test_write_servables_layout_and_overwrite(tmp_path):
    policy, draft = _pair(n_layers=4)
    policy = policy.float()
    for _ in range(2):  # the second call replaces the first atomically and leaves no temporary directory
        export.write_servables(str(tmp_path / "out"), policy, draft)
    assert sorted(os.listdir(tmp_path / "out")) == ["draft", "policy"]
    back = from_pretrained(str(tmp_path / "out" / "policy"))
    for (k, a), b in zip(policy.state_dict().items(), back.state_dict().values()):
        assert torch.equal(a, b), k
    with open(tmp_path / "out" / "draft" / "config.json") as f:
        cfg = json.load(f)
    assert cfg["max_position_embeddings"] == policy.cfg.max_position_embeddings
    export.check_export(str(tmp_path / "out" / "draft"))
    with pytest.raises(ValueError, match="whole model"):
        export.write_servables(str(tmp_path / "x"), Transformer(policy.cfg, layers=(0, 2)), draft)
    with pytest.raises(ValueError, match="tokenizer_dir"):
        export.write_servables(str(tmp_path / "x"), policy, draft, tokenizer_dir=str(tmp_path))
    small, _ = _pair(n_layers=3)  # 2 taps: the policy is servable, the draft is not
    small_draft = Eagle3Draft.from_target(small)
    with pytest.raises(ValueError, match="exactly 3"):
        export.write_servables(str(tmp_path / "s"), small, small_draft)
    got = export.write_servables(str(tmp_path / "s"), small, small_draft, require_draft=False)
    assert got["draft"] is None and "exactly 3" in got["skipped"]
    assert sorted(os.listdir(tmp_path / "s")) == ["policy"]


def test_write_servables_copies_the_tokenizer_in_hf_mode(tmp_path):
    pytest.importorskip("transformers", reason="builds a tiny HF Llama checkpoint")
    from hf_util import write_tiny_llama
    ckpt = write_tiny_llama(tmp_path / "ckpt", num_hidden_layers=4)
    policy = from_pretrained(str(ckpt))
    export.write_servables(str(tmp_path / "out"), policy, Eagle3Draft.from_target(policy), tokenizer_dir=str(ckpt))
    files = set(os.listdir(tmp_path / "out" / "policy"))
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"} <= files


def test_full_vocabulary_export_has_no_maps_and_loads_back(tmp_path):
    """vLLM 0.32 creates draft_id_to_target_id only for a reduced vocabulary and refuses a d2t at the full one."""
    policy, draft = _pair()
    draft.export(str(tmp_path / "d"), dtype=torch.float64)
    sd = load_file(str(tmp_path / "d" / "model.safetensors"))
    assert set(sd) == set(export.WEIGHTS)
    back = load_draft(str(tmp_path / "d"), policy)
    for (k, a), b in zip(draft.state_dict().items(), back.state_dict().values()):
        assert torch.equal(a, b), k  # d2t zeros and t2d all-true come back as the identity maps
    sd["d2t"] = torch.zeros(policy.cfg.vocab_size, dtype=torch.int64)  # the old format, which vLLM refuses
    save_file(sd, str(tmp_path / "d" / "model.safetensors"))
    with pytest.raises(ValueError, match="full draft vocabulary.*vLLM"):
        export.check_export(str(tmp_path / "d"))


def test_check_export_refuses_what_vllm_would_misread(tmp_path):
    _, draft = _pair(draft_vocab=torch.arange(10, 50))
    draft.export(str(tmp_path / "d"))
    sd = load_file(str(tmp_path / "d" / "model.safetensors"))
    save_file({k: v for k, v in sd.items() if k != "d2t"}, str(tmp_path / "d" / "model.safetensors"))
    with pytest.raises(ValueError, match="d2t"):  # vLLM would keep zero offsets: draft ids read as target ids
        export.check_export(str(tmp_path / "d"))
    save_file(sd, str(tmp_path / "d" / "model.safetensors"))
    export.check_export(str(tmp_path / "d"))
    with open(tmp_path / "d" / "config.json") as f:
        cfg = json.load(f)
    for key, value in (("norm_before_fc", True), ("norm_before_residual", True), ("logit_scale", 2.0)):
        with open(tmp_path / "d" / "config.json", "w") as f:
            json.dump({**cfg, key: value}, f)
        with pytest.raises(ValueError, match=key):
            export.check_export(str(tmp_path / "d"))


def test_check_pair_refuses_a_draft_that_does_not_fit_its_policy(tmp_path):
    policy, draft = _pair(n_layers=4)
    export.write_servables(str(tmp_path / "out"), policy.float(), draft)
    d = tmp_path / "out" / "draft"
    with open(d / "config.json") as f:
        cfg = json.load(f)
    with open(d / "config.json", "w") as f:
        json.dump({**cfg, "eagle_aux_hidden_state_layer_ids": [1, 2, 4],
                   "eagle_config": {**cfg["eagle_config"], "eagle_aux_hidden_state_layer_ids": [0, 1, 3]}}, f)
    with pytest.raises(ValueError, match="4 layers"):
        export.check_export(str(d))
