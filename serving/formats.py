"""Which draft format a folder holds, what a run's config takes from it, and which formats a run writes.

    format        family            config.json names it by                      written by
    cospec        all three         architectures Cospec*Draft                   draft.save (checkpoints)
    vllm          EAGLE-3           architectures LlamaForCausalLMEagle3         serving/export.py (EAGLE's format)
    vllm          DFlash            architectures DFlashDraftModel + dflash_config   serving/export_dflash.py (z-lab's)
    speculators   all three         speculators_model_type eagle3|dflash|dspark  serving/speculators_format.py

The family is read from the file. A vLLM-native config reads as the speculators format states it (`from_vllm`), so
one set of checks (speculators_format.to_cospec) serves every format; harness/draft_formats.py builds the draft.

    detect("runs/default/draft")          # ("eagle3", "vllm")
    draft_fields(path)                    # {family, format, block_size, mask_token_id, ...}: what the config takes
"""
from __future__ import annotations

import json
import os

from serving import speculators_format as spec

VLLM_ARCH = {"LlamaForCausalLMEagle3": "eagle3", "DFlashDraftModel": "dflash"}
COSPEC_ARCH = {"Eagle3DraftModel": "eagle3", "CospecDFlashDraft": "dflash", "CospecDSparkDraft": "dspark"}  # save()
FORMATS_FILE = "formats.json"  # <out>/draft/formats.json: {format: sub-folder} of what the run wrote


def detect(path: str, cospec: dict | None = None) -> tuple:
    """(family, format) of the draft folder `path`, from its config.json. cospec: {save() architecture: family} of
    cospec's own checkpoints (the harness passes its registry's, every registered family; None: COSPEC_ARCH)."""
    cfg_path = os.path.join(path, "config.json")
    if not os.path.isfile(cfg_path):
        hint = f" (its {FORMATS_FILE} lists the formats' sub-folders)" \
            if os.path.isfile(os.path.join(path, FORMATS_FILE)) else ""
        raise ValueError(f"--draft {path!r}: expected a draft folder with config.json{hint}")
    cfg = read_config(cfg_path)
    if spec.is_speculators(cfg):
        return spec.family_of(cfg, path), "speculators"
    arch = (cfg.get("architectures") or [None])[0]
    if arch in VLLM_ARCH:
        return VLLM_ARCH[arch], "vllm"
    arch, cospec = arch or "Eagle3DraftModel", cospec or COSPEC_ARCH  # none: EAGLE-3 (drafters.architecture's rule)
    if arch not in cospec:
        raise ValueError(f"draft {path!r}: architectures={cfg.get('architectures')!r}: expected one of "
                         f"{sorted(VLLM_ARCH) + sorted(cospec)}, or a speculators config")
    return cospec[arch], "cospec"


def read_config(cfg_path: str) -> dict:
    """config.json as a dict, or a ValueError naming the file."""
    try:
        with open(cfg_path) as f:
            cfg = json.load(f)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"draft {cfg_path}: not a readable JSON file ({type(e).__name__}: {e})") from None
    if not isinstance(cfg, dict):
        raise ValueError(f"draft {cfg_path}: expected a JSON object, got {type(cfg).__name__}")
    return cfg


def draft_fields(path: str, cospec: dict | None = None) -> dict:
    """What a run's config takes from the draft at `path` before any model exists: {family, format, and for a block
    draft block_size, mask_token_id, num_layers (and markov_rank)}. cospec: as detect's."""
    path = resolve(path)
    family, fmt = detect(path, cospec)
    cfg = read_config(os.path.join(path, "config.json"))
    out = {"family": family, "format": fmt}
    if family == "eagle3":
        return out
    if fmt == "speculators":
        tl = cfg.get("transformer_layer_config") or {}
        out.update(block_size=cfg.get("block_size"), mask_token_id=cfg.get("mask_token_id"),
                   num_layers=tl.get("num_hidden_layers"))
    elif fmt == "vllm":
        out.update(block_size=cfg.get("block_size"), num_layers=cfg.get("num_hidden_layers"),
                   mask_token_id=(cfg.get("dflash_config") or {}).get("mask_token_id"))
    else:  # cospec's own: the fields its family's config has (a chain family other than EAGLE-3: none of them)
        out.update({k: cfg[k] for k in ("block_size", "mask_token_id", "num_layers") if k in cfg})
    if family == "dspark":
        out["markov_rank"] = cfg.get("markov_rank")
    return out


def resolve(path: str) -> str:
    """A run's <out>/draft names its formats' sub-folders in formats.json; --draft <out>/draft reads the first."""
    listing = os.path.join(path, FORMATS_FILE)
    if not os.path.isfile(os.path.join(path, "config.json")) and os.path.isfile(listing):
        with open(listing) as f:
            first = next(iter(json.load(f).values()), ".")
        return os.path.normpath(os.path.join(path, first))
    return path


LAYER_KEYS = ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim",
              "rms_norm_eps", "rope_theta", "rope_parameters", "max_position_embeddings", "vocab_size",
              "num_hidden_layers", "layer_types", "use_sliding_window")


def from_vllm(family: str, cfg: dict, sd: dict) -> tuple:
    """A vLLM-native config and weights as the speculators format states them, and the file's own field names (for
    the errors): EAGLE-3's aux ids are vLLM's (tap + 1) already, z-lab's DFlash target_layer_ids are taps."""
    layer = {k: cfg[k] for k in LAYER_KEYS if k in cfg}
    if family == "eagle3":
        out = dict(speculators_model_type="eagle3", transformer_layer_config=dict(layer, model_type="llama"),
                   eagle_aux_hidden_state_layer_ids=cfg.get("eagle_aux_hidden_state_layer_ids"),
                   draft_vocab_size=cfg.get("draft_vocab_size", cfg.get("vocab_size")),
                   target_hidden_size=cfg.get("target_hidden_size"),
                   **{k: cfg[k] for k in spec.EAGLE3_FIXED if k in cfg})
        sd = {"layers.0." + k.removeprefix("midlayer.") if k.startswith("midlayer.") else k: v for k, v in sd.items()}
        return out, sd, {f"transformer_layer_config.{k}": k for k in LAYER_KEYS}
    d = cfg.get("dflash_config") or {}
    taps = d.get("target_layer_ids")
    out = dict(speculators_model_type="dflash", transformer_layer_config=dict(layer, model_type="qwen3"),
               aux_hidden_state_layer_ids=None if taps is None else [t + 1 if isinstance(t, int) else t for t in taps],
               draft_vocab_size=cfg.get("vocab_size"), target_hidden_size=cfg.get("target_hidden_size"),
               block_size=cfg.get("block_size", d.get("block_size")), mask_token_id=d.get("mask_token_id"),
               sample_from_anchor=False)
    return out, sd, {**{f"transformer_layer_config.{k}": k for k in LAYER_KEYS},
                     "aux_hidden_state_layer_ids": "dflash_config.target_layer_ids (+ 1)",
                     "mask_token_id": "dflash_config.mask_token_id", "draft_vocab_size": "vocab_size"}
