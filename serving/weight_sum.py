"""A checksum of a draft's weights that the trainer and the engine compute alike: what proves a refit landed.

The engine holds the EAGLE-3 export under its own names and layout (vLLM 0.32: `model.` prefix, `midlayer.` ->
`layers.0.`, q / k / v stacked row-wise into `qkv_proj`, gate / up into `gate_up_proj`, `d2t` ->
`draft_id_to_target_id`, the LM head padded past the draft vocabulary). `weight_sum` maps the export's names onto that
layout (stacking, never splitting, so it needs no config), casts every float to fp32 and hashes the bytes in name
order. The embedding is left out: both engines share the target's. A float cast up from bf16 is exact, so a bf16
export and the fp32 engine that loaded it give the same sum.

    weight_sum(eagle3_state_dict(draft).items())                 # the trainer's side (serving/export.py's names)
    weight_sum(drafter.named_parameters(), engine_names=True)    # the engine's side (serving/vllm_worker.py)
    weight_sum(policy.state_dict().items(), embedding=True)      # a policy (HF names), embedding included

Plain torch: this file runs in vLLM's environment too.
"""
from __future__ import annotations

import hashlib

import torch

STACKED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}


def engine_layout(named, prefix: str = "model.") -> dict:
    """{export name: tensor} -> {vLLM name: tensor}: the renames and the row-wise stacks of vLLM's loader. A policy's
    HF names (already `model.`-prefixed) take prefix="": only the stacks apply."""
    sd = {k: v for k, v in named}
    out = {}
    for stacked, parts in STACKED.items():
        for mod in sorted({k.rsplit(".", 2)[0] for k in sd if k.count(".") >= 2 and k.split(".")[-2] in parts}):
            names = [f"{mod}.{p}.weight" for p in parts]
            out[f"{mod}.{stacked}.weight"] = torch.cat([sd.pop(n) for n in names])
    for k, v in sd.items():
        out[k] = v
    ren = {}
    for k, v in out.items():
        k = "draft_id_to_target_id" if k == "d2t" else k
        k = k if k.startswith("lm_head") or k == "draft_id_to_target_id" else prefix + k
        ren[k.replace("model.midlayer.", "model.layers.0.")] = v
    return {k: v for k, v in ren.items() if not k.endswith("t2d")}  # vLLM skips t2d


def weight_sum(named, *, engine_names: bool = False, embedding: bool = False) -> str:
    """sha256 (hex, first 16) over the fp32 bytes of the draft's tensors in vLLM's layout, embedding excluded (a
    policy's: embedding=True, its names already HF's, so only the stacks apply)."""
    sd = {k: v for k, v in named} if engine_names else engine_layout(named, prefix="" if embedding else "model.")
    h = hashlib.sha256()
    for k in sorted(sd):
        if "embed_tokens" in k and not embedding:
            continue
        v = sd[k].detach().cpu()
        v = v.to(torch.float32) if v.is_floating_point() else v.to(torch.int64)
        h.update(k.encode() + b"\0" + str(tuple(v.shape)).encode() + v.contiguous().numpy().tobytes())
    return h.hexdigest()[:16]
