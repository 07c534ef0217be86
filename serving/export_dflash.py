"""The DFlash serving format: what vLLM's `DFlashDraftModel` (qwen3_dflash.py, the DFlash spec-decode method) loads.

    config.json        a Qwen3 config for the draft's own layers, plus
                       architectures ["DFlashDraftModel"], block_size, num_target_layers, target_hidden_size and
                       dflash_config {mask_token_id, target_layer_ids, block_size}
    model.safetensors  fc.weight (H, K*H), hidden_norm.weight, layers.{i}.{input_layernorm, self_attn.{q,k,v,o}_proj,
                       self_attn.{q,k}_norm, post_attention_layernorm, mlp.{gate,up,down}_proj}.weight, norm.weight

No embedding and no LM head: the engine shares the target's, as the draft did in training. target_layer_ids are the
policy layers whose OUTPUTS form the context (z-lab/dflash reads hidden_states[id + 1], the state after layer id: the
same ids as cospec's taps). The engine's forward (tests/test_export_dflash.py re-implements it from these facts):
context c = fc([f_id ...]); per layer K = RoPE(k_norm(k_proj(hidden_norm(c)))), V = v_proj(hidden_norm(c)),
precomputed into the KV cache at the context positions; the query block [y, MASK x (W - 1)] attends to them and to
itself, non-causally; logits = the target's LM head on norm(h).

    draft.export(path)   (draft_dflash.DFlashDraft.export calls export_dflash)
"""
from __future__ import annotations

import json
import os

import torch
from safetensors.torch import save_file

from serving.export import PAIR_FILE, _write_json, atomic_dir

ARCHITECTURE = "DFlashDraftModel"


def dflash_config(draft, *, dtype=torch.bfloat16, max_position_embeddings: int | None = None) -> dict:
    """The config.json of a DFlash export (module docstring)."""
    c = draft.cfg
    return {
        "architectures": [ARCHITECTURE], "model_type": "qwen3",
        "hidden_size": c.hidden_size, "intermediate_size": c.intermediate_size, "num_hidden_layers": c.num_layers,
        "num_attention_heads": c.num_attention_heads, "num_key_value_heads": c.num_key_value_heads,
        "head_dim": c.head_dim, "rms_norm_eps": c.rms_norm_eps, "rope_theta": c.rope_theta,
        "rope_parameters": {"rope_theta": c.rope_theta, "rope_type": "default"},
        "max_position_embeddings": max_position_embeddings or c.max_position_embeddings,
        "vocab_size": c.vocab_size, "hidden_act": "silu", "attention_bias": False, "tie_word_embeddings": False,
        "torch_dtype": str(dtype).removeprefix("torch."),
        "block_size": c.block_size, "num_target_layers": c.target_num_layers, "target_hidden_size": c.hidden_size,
        "dflash_config": {"mask_token_id": c.mask_token_id, "target_layer_ids": list(c.tap_layers),
                          "block_size": c.block_size},
    }


def dflash_state_dict(draft, *, dtype=torch.bfloat16) -> dict:
    """fc, hidden_norm, layers.*, norm in `dtype` (the shared embedding and head are buffers, not exported)."""
    return {k: v.detach().to(dtype).contiguous() for k, v in draft.state_dict().items()}


def export_dflash(draft, path: str, *, dtype=torch.bfloat16, max_position_embeddings: int | None = None,
                  pair: dict | None = None):
    """config.json + model.safetensors (+ PAIR_FILE with `pair`), written atomically into `path`."""
    cfg = dflash_config(draft, dtype=dtype, max_position_embeddings=max_position_embeddings)
    sd = dflash_state_dict(draft, dtype=dtype)

    def write(tmp):
        save_file(sd, os.path.join(tmp, "model.safetensors"), metadata={"format": "pt"})
        with open(os.path.join(tmp, "config.json"), "w") as f:
            json.dump(cfg, f, indent=2)
        if pair is not None:
            _write_json(os.path.join(tmp, PAIR_FILE), pair)
    atomic_dir(path, write)
