"""An exported EAGLE-3 draft read back as carefully as an HF checkpoint (--model) is: every error names the file, and
the key or the tensor, before anything is built from it.

    read_export_config(path, a)  config.json: valid JSON, architectures [a], every key a draft needs (each missing
                                 one named), its sizes checked by model.ModelConfig (heads >= 1, KV heads | heads)
    read_export_weights(path)    model.safetensors: readable (a truncated file named), every float tensor finite
    shape_problems(sd, cfg)      each tensor's shape against config.json: "<file>: tensor 'x' has shape (a, b),
                                 expected (c, d) (config.json: intermediate_size=64)"

serving/export.py's check_export runs these first (so Eagle3Draft.from_export, `--draft PATH`, gets them too), then its
engine-format checks. A draft directory is checked on its own: the pair check against a sibling policy/ applies only
where that sibling is there (a draft copied away from its run is a draft on its own).

Letters: H hidden, I intermediate, D head dim, V target vocab, Vd draft vocab.
"""
from __future__ import annotations

import os

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

from model import ModelConfig
from serving.hf_io import read_json

# what Eagle3Draft.from_export and the engines read from config.json
REQUIRED = ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim",
            "vocab_size", "draft_vocab_size", "target_hidden_size", "rms_norm_eps", "rope_theta",
            "max_position_embeddings", "eagle_aux_hidden_state_layer_ids", "eagle_config")


def read_export_config(path: str, architecture: str) -> dict:
    """<path>/config.json of `architecture`, with every required key present and the sizes a decoder layer can
    have."""
    file = os.path.join(path, "config.json")
    if not os.path.isfile(file):
        raise ValueError(f"{path}: expected an exported EAGLE-3 draft directory (config.json + model.safetensors); "
                         f"{file} is missing")
    cfg = read_json(file)
    if cfg.get("architectures") != [architecture]:
        raise ValueError(f"{file}: architectures={cfg.get('architectures')}: expected [{architecture!r}] (an "
                         "exported EAGLE-3 draft; a policy checkpoint is --model's)")
    missing = [k for k in REQUIRED if k not in cfg]
    if missing:
        raise ValueError(f"{file}: missing key(s) {missing} (an EAGLE-3 draft config needs {', '.join(REQUIRED)})")
    try:  # the one decoder layer's sizes: the same checks as every policy config
        ModelConfig(vocab_size=cfg["vocab_size"], hidden_size=cfg["hidden_size"], num_hidden_layers=1,
                    intermediate_size=cfg["intermediate_size"], num_attention_heads=cfg["num_attention_heads"],
                    num_key_value_heads=cfg["num_key_value_heads"], head_dim=cfg["head_dim"],
                    rms_norm_eps=cfg["rms_norm_eps"], rope_theta=cfg["rope_theta"],
                    max_position_embeddings=cfg["max_position_embeddings"])
    except (TypeError, ValueError) as e:
        raise ValueError(f"{file}: {e}") from None
    vd, v, th = cfg["draft_vocab_size"], cfg["vocab_size"], cfg["target_hidden_size"]
    if not (type(vd) is int and 1 <= vd <= v):
        raise ValueError(f"{file}: draft_vocab_size={vd!r}: expected an integer in [1, vocab_size={v}]")
    if not (type(th) is int and th >= 1):
        raise ValueError(f"{file}: target_hidden_size={th!r}: expected an integer >= 1")
    return cfg


def read_export_weights(path: str) -> dict:
    """<path>/model.safetensors as {name: tensor}; unreadable or non-finite weights are an error naming the file."""
    file = os.path.join(path, "model.safetensors")
    try:
        sd = load_file(file)
    except (SafetensorError, OSError) as e:
        raise ValueError(f"{file}: unreadable safetensors file ({' '.join(str(e).split())}); truncated, missing or "
                         "not a safetensors file?") from None
    bad = [k for k, t in sd.items() if t.is_floating_point() and not bool(torch.isfinite(t).all())]
    if bad:  # would load fine and fail much later, deep in drafting (an index out of range)
        raise ValueError(f"{file}: tensor(s) {bad} hold NaN or inf; these weights cannot be used")
    return sd


def expected_shapes(cfg: dict) -> dict:
    """{tensor: shape} of an EAGLE-3 draft with this config (the layer's q, k, v read [e; h], 2H wide)."""
    H, I, D, V, Vd = (cfg[k] for k in ("hidden_size", "intermediate_size", "head_dim", "vocab_size",
                                        "draft_vocab_size"))
    q, kv, m = cfg["num_attention_heads"] * D, cfg["num_key_value_heads"] * D, "midlayer."
    return {"fc.weight": (H, 3 * cfg["target_hidden_size"]), f"{m}input_layernorm.weight": (H,),
            f"{m}hidden_norm.weight": (H,), f"{m}self_attn.q_proj.weight": (q, 2 * H),
            f"{m}self_attn.k_proj.weight": (kv, 2 * H), f"{m}self_attn.v_proj.weight": (kv, 2 * H),
            f"{m}self_attn.o_proj.weight": (H, q), f"{m}post_attention_layernorm.weight": (H,),
            f"{m}mlp.gate_proj.weight": (I, H), f"{m}mlp.up_proj.weight": (I, H), f"{m}mlp.down_proj.weight": (H, I),
            "norm.weight": (H,), "lm_head.weight": (Vd, H), "d2t": (Vd,), "t2d": (V,)}


_SIZES = {"fc.weight": "hidden_size, target_hidden_size", "lm_head.weight": "draft_vocab_size, hidden_size",
          "d2t": "draft_vocab_size", "t2d": "vocab_size", "mlp": "intermediate_size, hidden_size",
          "self_attn": "num_attention_heads, num_key_value_heads, head_dim, hidden_size"}


def shape_problems(path: str, sd: dict, cfg: dict) -> list:
    """One line per tensor present whose shape is not what config.json says (which tensors must exist is
    check_export's business)."""
    out, file = [], os.path.join(path, "model.safetensors")
    for k, want in expected_shapes(cfg).items():
        if k in sd and tuple(sd[k].shape) != want:
            keys = next((v for part, v in _SIZES.items() if part in k), "hidden_size")
            out.append(f"{file}: tensor {k!r} has shape {tuple(sd[k].shape)}, expected {want} from config.json "
                       f"({', '.join(f'{n}={cfg[n]}' for n in keys.split(', '))})")
    return out
