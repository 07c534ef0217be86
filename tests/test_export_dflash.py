"""serving/export_dflash.py: a DFlash draft exported in vLLM's DFlash format, and that export run through a forward
written here from vLLM 0.32's source alone (the target's aux states at target_layer_ids + 1, as
get_eagle3_aux_layers_from_config offsets them: aux id 0 the embeddings, aux id L the pre-norm state after layer L - 1;
context K/V precomputed from hidden_norm(fc(concat)), k_norm, RoPE;
then the query block [y, MASK...] attending to them and to itself, non-causal; the target's head on norm(h)) --
plain torch over the exported tensors and config.json, no cospec module -- against the draft's own block forward.
Also the export's round trip through --draft's loader and the served k <= block_size - 1. ~4 s on 2 CPU cores. The
export served by vLLM itself: tests/test_vllm_engine.py."""
import json
import os

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from draft_dflash import DFlashDraft
from draft_dspark import DSparkDraft
from model import EMBED_TAP, ModelConfig, Transformer
from harness.draft_formats import load_draft


def rms(x, w, eps):
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def rope(x, pos, theta):  # x (L, heads, D), neox layout (rotate_half), positions (L,)
    D = x.shape[-1]
    inv = 1.0 / theta ** (torch.arange(0, D, 2, dtype=torch.float64) / D)
    ang = pos.double()[:, None] * inv
    ang = torch.cat([ang, ang], -1)[:, None]
    cos, sin = ang.cos().to(x.dtype), ang.sin().to(x.dtype)
    x1, x2 = x.chunk(2, -1)
    return x * cos + torch.cat([-x2, x1], -1) * sin


def engine_forward(path, hidden_states, y, embed, head):
    """The serving forward of one request: hidden_states [aux id] (s, H) of the target at positions 0..s-1 (aux id 0
    the embeddings, aux id L the pre-norm state after layer L - 1: what vLLM's LlamaModel.forward records through
    _maybe_add_hidden_state), y the last verified token at position s -> the draft's logits at the W block slots."""
    cfg = json.load(open(os.path.join(path, "config.json")))
    w = load_file(os.path.join(path, "model.safetensors"))
    eps, theta, D = cfg["rms_norm_eps"], cfg["rope_theta"], cfg["head_dim"]
    Hq, Hkv, W = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["block_size"]
    # eagle3_utils.get_eagle3_aux_layers_from_config: "Add 1 to convert DFlash's aux layer id semantics"
    aux = sorted(i + 1 for i in cfg["dflash_config"]["target_layer_ids"])  # concatenated in layer order
    ctx = F.linear(torch.cat([hidden_states[a] for a in aux], -1), w["fc.weight"])  # combine_hidden_states
    ctx = rms(ctx, w["hidden_norm.weight"], eps)
    s = ctx.shape[0]
    x = embed[torch.tensor([y] + [cfg["dflash_config"]["mask_token_id"]] * (W - 1))]
    pos_c, pos_q = torch.arange(s), torch.arange(s, s + W)
    for i in range(cfg["num_hidden_layers"]):
        p = f"layers.{i}."
        kc = rope(rms(F.linear(ctx, w[p + "self_attn.k_proj.weight"]).view(s, Hkv, D), w[p + "self_attn.k_norm.weight"],
                      eps), pos_c, theta)  # precompute_and_store_context_kv
        vc = F.linear(ctx, w[p + "self_attn.v_proj.weight"]).view(s, Hkv, D)
        hn = rms(x, w[p + "input_layernorm.weight"], eps)
        q = rope(rms(F.linear(hn, w[p + "self_attn.q_proj.weight"]).view(W, Hq, D), w[p + "self_attn.q_norm.weight"],
                     eps), pos_q, theta)
        kq = rope(rms(F.linear(hn, w[p + "self_attn.k_proj.weight"]).view(W, Hkv, D), w[p + "self_attn.k_norm.weight"],
                      eps), pos_q, theta)
        vq = F.linear(hn, w[p + "self_attn.v_proj.weight"]).view(W, Hkv, D)
        K, V = torch.cat([kc, kq]).repeat_interleave(Hq // Hkv, 1), torch.cat([vc, vq]).repeat_interleave(Hq // Hkv, 1)
        a = torch.softmax(torch.einsum("qhd,khd->hqk", q, K) / D ** 0.5, -1)  # non-causal: every key
        x = x + F.linear(torch.einsum("hqk,khd->qhd", a, V).reshape(W, Hq * D), w[p + "self_attn.o_proj.weight"])
        hn = rms(x, w[p + "post_attention_layernorm.weight"], eps)
        gate, up = F.linear(hn, w[p + "mlp.gate_proj.weight"]), F.linear(hn, w[p + "mlp.up_proj.weight"])
        x = x + F.linear(F.silu(gate) * up, w[p + "mlp.down_proj.weight"])
    return F.linear(rms(x, w["norm.weight"], eps), head)


def test_export_matches_engine_forward(tmp_path):
    torch.manual_seed(0)
    policy = Transformer(ModelConfig.preset("tiny", qk_norm=True)).double().eval()
    draft = DFlashDraft.from_target(policy, mask_token_id=3, block_size=5, num_layers=2)
    with torch.no_grad():
        for p in draft.parameters():
            p.add_(torch.randn_like(p) * 0.1)  # norms and all off their init
    draft.export(str(tmp_path / "d"), dtype=torch.float64)
    cfg = json.load(open(tmp_path / "d" / "config.json"))
    assert cfg["architectures"] == ["DFlashDraftModel"] and cfg["num_target_layers"] == 4 and cfg["block_size"] == 5
    assert cfg["dflash_config"] == {"mask_token_id": 3, "target_layer_ids": list(draft.tap_layers), "block_size": 5}
    names = set(load_file(str(tmp_path / "d" / "model.safetensors")))
    assert "fc.weight" in names and "hidden_norm.weight" in names and "layers.1.self_attn.k_norm.weight" in names
    assert not any("embed" in n or "lm_head" in n for n in names)
    tokens = torch.randint(1, 97, (11,))
    with torch.no_grad():
        n = policy.cfg.num_hidden_layers
        out = policy(tokens, torch.tensor([0, 11], dtype=torch.int32), tap_layers=(EMBED_TAP,) + tuple(range(n)))
        s = 8  # the context is positions 0..7; y = tokens[8]
        aux = [out.taps[i][:s] for i in (EMBED_TAP,) + tuple(range(n))]  # aux id a = tap a - 1
        # the last layer's tap is vLLM's: pre-norm (hidden_states + residual), the head reads its final norm
        assert torch.allclose(F.linear(rms(out.taps[n - 1], policy.model.norm.weight, policy.cfg.rms_norm_eps),
                                       policy.head_weight), out.logits, atol=1e-10)
        want = engine_forward(str(tmp_path / "d"), aux, int(tokens[s]), policy.embed.weight, policy.head_weight)
        cache = draft.new_cache(1, 16)
        draft.extend(cache, tokens[None, 1: s + 1], {l: t[None, :s] for l, t in out.taps.items()},
                     torch.tensor([s - 1]))
        got = draft.logits(draft.run_block(cache, tokens[s: s + 1]))[0]
    assert torch.allclose(got, want, atol=1e-10)


def test_from_export_round_trip_and_served_method(tmp_path):
    from serving.vllm_engine import served_method
    torch.manual_seed(0)
    policy = Transformer(ModelConfig.preset("tiny", qk_norm=True)).eval()
    draft = DFlashDraft.from_target(policy, mask_token_id=3, block_size=4, tap_layers=(0, 2))
    draft.export(str(tmp_path / "d"), dtype=torch.float32)
    back = load_draft(str(tmp_path / "d"), policy)
    assert back.tap_layers == (0, 2) and back.block_size == 4 and back.cfg.mask_token_id == 3
    assert all(torch.equal(a, b) for a, b in zip(draft.state_dict().values(), back.state_dict().values()))
    assert served_method(str(tmp_path / "d"), 3) == "dflash"
    with pytest.raises(ValueError, match="k: a DFlash draft of block_size 4 drafts 1..3"):
        served_method(str(tmp_path / "d"), 4)  # vLLM would run a 5th slot the draft never trained
    with pytest.raises(ValueError, match="expected a draft folder with config.json"):
        load_draft(str(tmp_path), policy)
