"""HF checkpoint directories <-> model.Transformer: config.json + *.safetensors (sharded index supported).

Parameter names are already HF's (model.embed_tokens, model.layers.{i}.self_attn.q_proj, ..., lm_head), so loading is
a config translation plus a name filter; a pipeline-stage slice takes only its own layers. Every error names the file
(and the key) it is about: a truncated safetensors file, a config.json that is not JSON, a missing config key, a
tensor holding NaN or inf.

    python -m serving.hf_io PATH      # prints the translated config and the parameter count of a local HF checkpoint
"""
from __future__ import annotations

import json
import os
import sys
import tempfile

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from model import ARCHITECTURES, ModelConfig, Transformer
from parallel.cli import read_json, writing  # read_json: imported from here by the harness too

_MODEL_TYPE = {"LlamaForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2", "Qwen3ForCausalLM": "qwen3"}


class _Keys(dict):
    """config.json as a dict whose missing keys raise a ValueError naming the key and the file (not a bare KeyError)."""

    def __init__(self, d: dict, source: str):
        super().__init__(d)
        self.source = source

    def __missing__(self, key):
        raise ValueError(f"{self.source}: missing key {key!r} (an HF decoder config needs it)")


def config_from_hf(hf: dict, source: str = "config.json") -> ModelConfig:
    """Translate an HF config.json dict; anything this decoder does not implement is an error, not a silent drop.
    `source` (the file's path) prefixes the errors."""
    hf = _Keys(hf, source)
    try:
        return _translate(hf)
    except (TypeError, ValueError) as e:  # a wrong value type (e.g. "hidden_size": "64") or an unsupported setting
        msg = str(e)
        raise ValueError(msg if msg.startswith(source) else f"{source}: {msg}") from None


def _translate(hf: dict) -> ModelConfig:
    archs = hf.get("architectures") or []
    if len(archs) != 1 or archs[0] not in ARCHITECTURES:
        raise ValueError(f"architectures={archs}: expected exactly one of {ARCHITECTURES}")
    arch = archs[0]
    if hf.get("hidden_act", "silu") != "silu":
        raise ValueError(f"hidden_act={hf['hidden_act']!r}: only 'silu' (SwiGLU) is supported")
    if hf.get("mlp_bias", False):
        raise ValueError("mlp_bias=true is not supported")
    if hf.get("use_sliding_window", False):
        raise ValueError("use_sliding_window=true is not supported (full attention only)")
    rope = dict(hf.get("rope_parameters") or {})  # transformers >= 5
    scaling = hf.get("rope_scaling")  # transformers 4
    rope_type = rope.get("rope_type") or (scaling or {}).get("rope_type") or (scaling or {}).get("type") or "default"
    if rope_type != "default":
        raise ValueError(f"rope type {rope_type!r} is not supported (only plain RoPE, 'default')")
    theta = rope.get("rope_theta", hf.get("rope_theta", 10000.0))
    attn_bias = bool(hf.get("attention_bias", False))
    return ModelConfig(
        vocab_size=hf["vocab_size"], hidden_size=hf["hidden_size"], intermediate_size=hf["intermediate_size"],
        num_hidden_layers=hf["num_hidden_layers"], num_attention_heads=hf["num_attention_heads"],
        num_key_value_heads=hf.get("num_key_value_heads") or hf["num_attention_heads"],
        head_dim=hf.get("head_dim"), rms_norm_eps=hf.get("rms_norm_eps", 1e-6), rope_theta=float(theta),
        max_position_embeddings=hf.get("max_position_embeddings", 4096),
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
        qkv_bias=True if arch == "Qwen2ForCausalLM" else attn_bias,
        o_bias=attn_bias and arch != "Qwen2ForCausalLM",
        qk_norm=arch == "Qwen3ForCausalLM", architecture=arch)


def config_to_hf(cfg: ModelConfig) -> dict:
    hf = dict(architectures=[cfg.architecture], model_type=_MODEL_TYPE[cfg.architecture], vocab_size=cfg.vocab_size,
              hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size,
              num_hidden_layers=cfg.num_hidden_layers, num_attention_heads=cfg.num_attention_heads,
              num_key_value_heads=cfg.num_key_value_heads, head_dim=cfg.head_dim, rms_norm_eps=cfg.rms_norm_eps,
              rope_theta=cfg.rope_theta, rope_parameters={"rope_type": "default", "rope_theta": cfg.rope_theta},
              max_position_embeddings=cfg.max_position_embeddings, tie_word_embeddings=cfg.tie_word_embeddings,
              hidden_act="silu", attention_bias=cfg.o_bias, torch_dtype="float32")
    if cfg.architecture == "LlamaForCausalLM" and cfg.qkv_bias != cfg.o_bias:
        raise ValueError("Llama ties q/k/v and o biases (attention_bias); qkv_bias != o_bias cannot be saved as Llama")
    return hf


def read_hf_state_dict(path: str, dtype=None, device="cpu", keep=None) -> dict:
    """{name: tensor} of a checkpoint's safetensors files, each tensor read onto `device` and cast to `dtype` (None:
    as stored) one at a time: no full-precision copy of the model is built on the way. keep(name): which names to
    read (None: all)."""
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.exists(index):
        weight_map = read_json(index).get("weight_map")
        if not isinstance(weight_map, dict):
            raise ValueError(f"{index}: missing key 'weight_map' (a dict: tensor name -> shard file)")
        files = sorted(set(weight_map.values()))
    else:
        files = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))
    if not files:
        raise ValueError(f"path={path!r}: no *.safetensors weights found")
    sd = {}
    for f in files:
        shard = os.path.join(path, f)
        if not os.path.isfile(shard):
            raise ValueError(f"{shard}: missing (listed in {index})")
        try:
            part = _read_shard(shard, dtype, device, keep)
        except (SafetensorError, OSError) as e:  # e.g. a truncated download: "incomplete metadata", no path
            raise ValueError(f"{shard}: unreadable safetensors file ({e}); truncated or not a safetensors file?") \
                from None
        bad = next((k for k, v in part.items() if v.is_floating_point() and not bool(torch.isfinite(v).all())), None)
        if bad is not None:  # would load fine and fail much later, deep in sampling
            raise ValueError(f"{shard}: tensor {bad!r} holds NaN or inf; these weights cannot be used")
        sd.update(part)
    return sd


def _read_shard(shard: str, dtype, device, keep) -> dict:
    with safe_open(shard, framework="pt", device=str(device or "cpu")) as f:
        names = [k for k in f.keys() if keep is None or keep(k)]
        return {k: _cast(f.get_tensor(k), dtype) for k in names}


def _cast(t: torch.Tensor, dtype) -> torch.Tensor:
    return t.to(dtype) if dtype is not None and t.is_floating_point() else t


def from_pretrained(path: str, layers=None, dtype=torch.float32, device="cpu") -> Transformer:
    """Load a local HF directory (config.json + safetensors) in `dtype` on `device`. `layers=(a, b)` builds and fills a
    stage slice only. The model is built on the meta device and takes the checkpoint's tensors as its parameters
    (load_state_dict(assign=True)): no random initialisation first, no fp32 copy of a bf16 checkpoint, and only this
    slice's tensors are read."""
    cfg_path = os.path.join(path, "config.json")
    if not os.path.isfile(cfg_path):
        raise ValueError(f"path={path!r}: expected an HF checkpoint directory with config.json")
    cfg = config_from_hf(read_json(cfg_path), source=cfg_path)
    with torch.device("meta"):
        model = Transformer(cfg, layers=layers)
    own = set(model.state_dict())
    sd = read_hf_state_dict(path, dtype, device, keep=own.__contains__)
    missing = sorted(own - set(sd))
    try:
        if missing:
            raise ValueError(f"state dict lacks {len(missing)} keys this stage needs, e.g. {missing[:3]}")
        model.load_state_dict(sd, strict=True, assign=True)
    except (ValueError, RuntimeError) as e:  # missing tensors, or shapes that do not match config.json
        raise ValueError(f"{path}: the weights do not fit {cfg_path}: {e}") from None
    return model


def save_pretrained(model: Transformer, path: str):
    """Write config.json + model.safetensors; each file lands atomically (temporary name, then rename)."""
    if model.layer_range != (0, model.cfg.num_hidden_layers):
        raise ValueError("save_pretrained: needs the full model, not a pipeline-stage slice")
    os.makedirs(path, exist_ok=True)
    sd = {k: v.detach().contiguous() for k, v in model.state_dict().items()}
    _atomic(path, "model.safetensors", lambda tmp: save_file(sd, tmp, metadata={"format": "pt"}))
    _atomic(path, "config.json", lambda tmp: open(tmp, "w").write(json.dumps(config_to_hf(model.cfg), indent=2)))


def _atomic(folder, name, write):
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=f".{name}.")
    os.close(fd)
    try:
        with writing(os.path.join(folder, name)):  # a full disk: one error naming the file (SafetensorError too)
            write(tmp)
        os.replace(tmp, os.path.join(folder, name))
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        raise ValueError("usage: python -m serving.hf_io PATH")
    m = from_pretrained(argv[0])
    print(m.cfg, f"\n{sum(p.numel() for p in m.parameters()):,} parameters")


if __name__ == "__main__":
    from parallel.cli import answer_help, run_main
    answer_help(__doc__, __file__)  # -h / --help: usage and summary from the docstring, exit 0
    run_main(main, __file__)  # an error: one line naming the file and key, exit 1
