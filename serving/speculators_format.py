"""The `speculators` format (vllm-project/speculators 0.9.0): one draft format for EAGLE-3, DFlash and DSpark.

A folder holds config.json and model.safetensors. The config names the family in `speculators_model_type` and keeps
the draft's own decoder layers in `transformer_layer_config` (a transformers config: Llama for cospec's EAGLE-3 layer,
Qwen3 for the block drafts' q/k-normed layers). The verifier's embedding and LM head are not stored: the library
reloads them from `speculators_config.verifier.name_or_path`, and cospec shares the policy's. EAGLE-3's folder
holds the embedding too (embed_tokens.weight, the policy's at export): the library reads it from the file; cospec
shares the live policy's and does not read it.

    field (config.json)                    cospec                          note
    eagle_aux_hidden_state_layer_ids       tap + 1  (EAGLE-3)              hidden_states index: 0 is the embedding,
    aux_hidden_state_layer_ids             tap + 1  (DFlash, DSpark)       i + 1 the output of layer i (cospec's tap i)
    draft_vocab_size, d2t, t2d             draft_vocab_size, d2t, t2d      target id = draft id + d2t[draft id]
    block_size, mask_token_id              the same
    sample_from_anchor                     False for DFlash (slot k predicts x_{a+k}), True for DSpark (x_{a+k+1})
    sliding_window_non_causal              true: the block attends to all of itself (vLLM 0.32 reads the field as
                                           dflash_config.causal for every layer; the library, for sliding layers)
    speculators_config.proposal_methods    greedy, speculative_tokens = the trained slots (EAGLE-3: 3, cospec's
                                           default TTT passes)
    markov_rank                            markov_rank (DSpark; head type "vanilla")
    enable_confidence_head,                true, true: DSpark's confidence head reads [norm(h_k); W1[prev_k]]
    confidence_head_with_markov

    weight (model.safetensors)             cospec
    layers.0.*  (EAGLE-3)                  midlayer.*
    markov_head.markov_w1.weight (V, r)    markov_in.weight               W1[prev]
    markov_head.markov_w2.weight (V, r)    markov_out.weight              W2
    confidence_head.proj.{weight,bias}     confidence.{weight,bias}
    every other name                       the same (fc, hidden_norm, layers.i.*, norm, lm_head, d2t, t2d)

The library's switches that change the computation cospec trains (EAGLE-3's norm_before_residual, norm_before_fc,
fc_norm, norm_output; sliding-window layers; another Markov head type) are written at cospec's values, and a file with
another value is refused naming the field. `to_cospec` checks a file against the policy and returns what the family's
constructor takes; `from_cospec` writes a cospec draft.

    python -m serving.export runs/default/draft/speculators     # reads a folder back, checks it
"""
from __future__ import annotations

import json
import os

import torch

FAMILIES = ("eagle3", "dflash", "dspark")
ARCHITECTURES = {"eagle3": "Eagle3DraftModel", "dflash": "DFlashDraftModel", "dspark": "DSparkDraftModel"}
LAYER_TYPE = {"eagle3": "llama", "dflash": "qwen3", "dspark": "qwen3"}  # cospec's layer of each family
EAGLE3_FIXED = {"norm_before_residual": False, "norm_before_fc": False, "fc_norm": False, "norm_output": False}
DSPARK_FIXED = {"markov_head_type": "vanilla", "enable_confidence_head": True, "confidence_head_with_markov": True}
RENAMES = {"markov_head.markov_w1.weight": "markov_in.weight", "markov_head.markov_w2.weight": "markov_out.weight",
           "confidence_head.proj.weight": "confidence.weight", "confidence_head.proj.bias": "confidence.bias"}
VERSION = "0.9.0"  # the library version whose format this is (its config field `speculators_version`)


def is_speculators(cfg: dict) -> bool:
    return "speculators_model_type" in cfg


def family_of(cfg: dict, path: str) -> str:
    fam = cfg.get("speculators_model_type")
    if fam not in FAMILIES:
        raise ValueError(f"draft {path!r}: speculators_model_type={fam!r}: cospec trains {list(FAMILIES)}")
    return fam


def _layer(family: str, c) -> dict:
    """transformer_layer_config of the draft's own decoder layers (cospec's config `c`)."""
    d = {"model_type": LAYER_TYPE[family], "hidden_size": c.hidden_size, "intermediate_size": c.intermediate_size,
         "num_hidden_layers": getattr(c, "num_layers", 1), "num_attention_heads": c.num_attention_heads,
         "num_key_value_heads": c.num_key_value_heads, "head_dim": c.head_dim, "hidden_act": "silu",
         "rms_norm_eps": c.rms_norm_eps, "rope_parameters": {"rope_theta": c.rope_theta, "rope_type": "default"},
         "max_position_embeddings": c.max_position_embeddings, "vocab_size": c.vocab_size,
         "attention_bias": False, "tie_word_embeddings": False}
    if family != "eagle3":
        d.update(layer_types=["full_attention"] * d["num_hidden_layers"], sliding_window=None,
                 use_sliding_window=False)
    return d


def from_cospec(draft, family: str, *, verifier: str | None = None, verifier_architecture: str | None = None,
                dtype=torch.bfloat16) -> tuple:
    """(config.json, {name: tensor}) of cospec `draft` of `family` in the speculators format. verifier: the policy's
    HF checkpoint (a hub id or folder) the library reloads the embedding and LM head from."""
    c = draft.cfg
    aux = [t + 1 for t in c.tap_layers]
    block = family != "eagle3"
    k = (c.block_size if family == "dspark" else c.block_size - 1) if block else 3  # drafts per step, served
    cfg = {"architectures": [ARCHITECTURES[family]], "speculators_model_type": family, "speculators_version": VERSION,
           "transformer_layer_config": _layer(family, c),
           "draft_vocab_size": int(getattr(c, "draft_vocab_size", c.vocab_size)), "target_hidden_size": None,
           "tie_word_embeddings": False, "dtype": str(dtype).removeprefix("torch."),
           "speculators_config": {"algorithm": family, "default_proposal_method": "greedy",
                                  "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": k,
                                                        "verifier_accept_k": 1, "accept_tolerance": 0.0}],
                                  "verifier": {"name_or_path": verifier,
                                               "architectures": [verifier_architecture] if verifier_architecture
                                               else []}}}
    if block:
        cfg.update(aux_hidden_state_layer_ids=aux, block_size=c.block_size, mask_token_id=c.mask_token_id,
                   sample_from_anchor=family == "dspark", sliding_window_non_causal=True)
    else:
        cfg.update(eagle_aux_hidden_state_layer_ids=aux, embed_requires_grad=False, **EAGLE3_FIXED)
    if family == "dspark":
        cfg.update(markov_rank=c.markov_rank, **DSPARK_FIXED)
    back = {v: k for k, v in RENAMES.items()}
    sd = {}
    if not block:  # the library's EAGLE-3 reads its embedding from the file (only a missing one from the verifier)
        sd["embed_tokens.weight"] = draft.embed_weight.detach().to(device="cpu", dtype=dtype).contiguous()
    for name, t in draft.state_dict().items():
        if not block and name in ("d2t", "t2d") and c.draft_vocab_size == c.vocab_size:
            continue  # the library keeps no maps at a full draft vocabulary
        name = "layers.0." + name.removeprefix("midlayer.") if name.startswith("midlayer.") else back.get(name, name)
        cast = {"d2t": torch.int64, "t2d": torch.bool}.get(name, dtype)
        sd[name] = t.detach().to(device="cpu", dtype=cast).contiguous()
    return cfg, sd


def beside(draft, family: str, *, verifier: str | None = None, dtype=torch.bfloat16) -> dict:
    """{"speculators": (config, tensors)}: what a native export writes beside itself (serving/export.write_export's
    `also`). verifier: the policy's folder (its config.json gives the architecture) or a hub id."""
    arch = None
    if verifier and os.path.isfile(os.path.join(verifier, "config.json")):
        with open(os.path.join(verifier, "config.json")) as f:
            arch = (json.load(f).get("architectures") or [None])[0]
    return {"speculators": from_cospec(draft, family, verifier=verifier, verifier_architecture=arch, dtype=dtype)}


def _need(cfg: dict, key: str, path: str):
    if key not in cfg:
        fam = cfg.get("speculators_model_type")
        raise ValueError(f"draft {path!r}: config.json has no {key!r} (a speculators {fam} config holds it)")
    return cfg[key]


def to_cospec(cfg: dict, sd: dict, policy_cfg, path: str, names: dict | None = None) -> tuple:
    """(family, cospec config fields, state dict in cospec's names) of a speculators folder read as (cfg, sd), checked
    against the policy's config. Every mismatch is a ValueError naming the field and both values. names: {field:
    the name the file uses} for a file translated from another format (serving/formats.from_vllm)."""
    fam = family_of(cfg, path)
    names = names or {}

    def bad(field, got, want):
        raise ValueError(f"draft {path!r}: {names.get(field, field)}={got!r}, expected {want}")

    fields = _layer_fields(fam, cfg, sd, policy_cfg, path, bad)
    part = _eagle3_part if fam == "eagle3" else _block_part
    return (fam,) + part(fam, cfg, sd, policy_cfg, path, bad, fields)


def _layer_fields(fam: str, cfg: dict, sd: dict, P, path: str, bad) -> dict:
    """The draft layer's config fields every family shares, checked against the policy P and the weights' shapes."""
    tl = _need(cfg, "transformer_layer_config", path)
    if tl.get("model_type") != LAYER_TYPE[fam]:
        bad("transformer_layer_config.model_type", tl.get("model_type"),
            f"{LAYER_TYPE[fam]!r} (cospec's {fam} layer: " + ("Llama's, no q/k norm)" if fam == "eagle3"
                                                              else "Qwen3's, q/k-normed)"))
    if tl.get("hidden_size") != P.hidden_size:
        bad("transformer_layer_config.hidden_size", tl.get("hidden_size"), f"the policy's hidden_size {P.hidden_size}")
    if cfg.get("target_hidden_size") not in (None, P.hidden_size):
        bad("target_hidden_size", cfg["target_hidden_size"], f"None or the policy's hidden_size {P.hidden_size}")
    if tl.get("vocab_size") != P.vocab_size:
        bad("transformer_layer_config.vocab_size", tl.get("vocab_size"), f"the policy's vocab_size {P.vocab_size}")
    heads, kv, hd = (tl.get(k) for k in ("num_attention_heads", "num_key_value_heads", "head_dim"))
    hd = hd or (P.hidden_size // heads if heads else None)
    q = sd.get("layers.0.self_attn.q_proj.weight")
    if not heads or not kv or q is None or q.shape[0] != heads * hd:
        bad("transformer_layer_config.num_attention_heads", heads,
            f"heads x head_dim = q_proj's rows ({None if q is None else q.shape[0]}), head_dim={hd}")
    if sd["layers.0.self_attn.k_proj.weight"].shape[0] != kv * hd:
        bad("transformer_layer_config.num_key_value_heads", kv,
            f"kv heads x head_dim = k_proj's rows ({sd['layers.0.self_attn.k_proj.weight'].shape[0]})")
    rope = tl.get("rope_parameters") or {"rope_type": "default", "rope_theta": tl.get("rope_theta", 10000.0)}
    if rope.get("rope_type", "default") != "default":
        bad("transformer_layer_config.rope_parameters.rope_type", rope.get("rope_type"), "'default' (plain RoPE)")
    if any(t != "full_attention" for t in tl.get("layer_types") or ()) or tl.get("use_sliding_window"):
        bad("transformer_layer_config.layer_types", tl.get("layer_types"), "full attention only (no sliding window)")
    key = "eagle_aux_hidden_state_layer_ids" if fam == "eagle3" else "aux_hidden_state_layer_ids"
    aux = _need(cfg, key, path)
    if aux is None or not all(isinstance(i, int) and 1 <= i <= P.num_hidden_layers for i in aux) \
            or list(aux) != sorted(set(aux)):
        bad(key, aux, f"ascending distinct hidden-state ids in [1, {P.num_hidden_layers}] (layer i's output is i + 1;"
                      f" the policy has {P.num_hidden_layers} layers)")
    if sd["fc.weight"].shape[1] != len(aux) * P.hidden_size:
        bad(key, aux, f"{sd['fc.weight'].shape[1] // P.hidden_size} ids: fc.weight reads "
                      f"{sd['fc.weight'].shape[1]} = ids x hidden_size")
    return dict(vocab_size=P.vocab_size, hidden_size=P.hidden_size, intermediate_size=tl["intermediate_size"],
                num_attention_heads=heads, num_key_value_heads=kv, head_dim=hd,
                tap_layers=tuple(i - 1 for i in aux), target_num_layers=P.num_hidden_layers,
                rms_norm_eps=tl.get("rms_norm_eps", 1e-6), rope_theta=rope.get("rope_theta", 10000.0),
                max_position_embeddings=tl.get("max_position_embeddings", P.max_position_embeddings))


def _eagle3_part(fam, cfg: dict, sd: dict, P, path: str, bad, fields: dict) -> tuple:
    """EAGLE-3's switches, one layer, its draft vocabulary; layers.0.* -> midlayer.*."""
    tl, Vd = cfg["transformer_layer_config"], _need(cfg, "draft_vocab_size", path)
    for k, v in EAGLE3_FIXED.items():
        if cfg.get(k, v) != v:
            bad(k, cfg[k], f"{v} (cospec's EAGLE-3 computes with {k}={v})")
    if tl.get("num_hidden_layers", 1) != 1:
        bad("transformer_layer_config.num_hidden_layers", tl.get("num_hidden_layers"), "1 (one EAGLE-3 layer)")
    if not 1 <= Vd <= P.vocab_size:
        bad("draft_vocab_size", Vd, f"in [1, the policy's vocab_size {P.vocab_size}]")
    if Vd < P.vocab_size and not {"d2t", "t2d"} <= set(sd):
        bad("draft_vocab_size", Vd, "a full vocabulary, or d2t and t2d in model.safetensors")
    out = {"midlayer." + k.removeprefix("layers.0.") if k.startswith("layers.0.") else k: t
           for k, t in sd.items() if k != "embed_tokens.weight"}  # the embedding: cospec shares the policy's
    return dict(fields, draft_vocab_size=Vd), out


def _block_part(fam, cfg: dict, sd: dict, P, path: str, bad, fields: dict) -> tuple:
    """A block draft's vocabulary (the policy's), slot convention, mask, block size and DSpark's heads."""
    Vd = _need(cfg, "draft_vocab_size", path)
    if Vd != P.vocab_size:
        bad("draft_vocab_size", Vd, f"the policy's vocab_size {P.vocab_size} (cospec's block drafts use the "
                                    "policy's LM head, the whole vocabulary)")
    anchor = fam == "dspark"
    if bool(cfg.get("sample_from_anchor", anchor)) != anchor:
        bad("sample_from_anchor", cfg["sample_from_anchor"], f"{anchor} (cospec's {fam}: slot k predicts "
                                                             + ("x_{a+k+1})" if anchor else "x_{a+k})"))
    mask, W = _need(cfg, "mask_token_id", path), _need(cfg, "block_size", path)
    if not isinstance(mask, int) or not 0 <= mask < P.vocab_size:
        bad("mask_token_id", mask, f"an id in [0, {P.vocab_size})")
    if not isinstance(W, int) or not 2 <= W <= 64:
        bad("block_size", W, "in [2, 64]")
    fields = dict(fields, mask_token_id=mask, block_size=W,
                  num_layers=cfg["transformer_layer_config"].get("num_hidden_layers", 1))
    if fam == "dspark":
        for k, v in DSPARK_FIXED.items():
            if cfg.get(k, v) != v:
                bad(k, cfg[k], f"{v!r} (cospec's DSpark)")
        r = _need(cfg, "markov_rank", path)
        if not isinstance(r, int) or r < 1:
            bad("markov_rank", r, ">= 1 (cospec's DSpark has a Markov head)")
        fields["markov_rank"] = r
    verifier = ("embed_tokens.weight", "lm_head.weight", "verifier_lm_head.weight", "verifier_norm.weight", "d2t",
                "t2d")
    return fields, {RENAMES.get(k, k): t for k, t in sd.items() if k not in verifier}
