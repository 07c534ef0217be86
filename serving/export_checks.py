"""A draft export read back as carefully as an HF checkpoint (--model) is: every error names the file, and the key or
the tensor, before anything is built from it.

    read_export_config(path, a)  config.json: valid JSON, architectures [a], every key a draft needs (each missing
                                 one named), its sizes checked by model.ModelConfig (heads >= 1, KV heads | heads)
    read_export_weights(path)    model.safetensors: readable (a truncated file named), every float tensor finite
    shape_problems(sd, cfg)      each tensor's shape against config.json: "<file>: tensor 'x' has shape (a, b),
                                 expected (c, d) (config.json: intermediate_size=64)"
    expected_tensors(family, f)  {name: shape} of a family's draft from its config fields alone (no draft built)
    check_folder(path)           one folder of any family in any format (serving/formats.detect), as its loader reads
                                 it: config.json's fields, every tensor's name and shape against expected_tensors, and
                                 the fields the draft takes from the policy, against find_policy's folder, else the
                                 file's own

serving/export.py's check_export runs the first three (so `--draft PATH`, harness/draft_formats.load_draft, gets them
too), then its engine-format checks; its check_exports runs check_folder on every format a run wrote, handing it those
engine checks (export.py imports this file, never the reverse; no draft family is imported either). A draft directory
is checked on its own: the pair check against a sibling policy/ applies only where that sibling is there (a draft
copied away from its run is a draft on its own).

Letters: H hidden, I intermediate, D head dim, V target vocab, Vd draft vocab, r Markov rank.
"""
from __future__ import annotations

import os
from types import SimpleNamespace

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

from model import EMBED_TAP, ModelConfig, check_tap_layers
from serving import speculators_format as spec
from serving.formats import COSPEC_ARCH, FORMATS_FILE, VLLM_ARCH, detect, from_vllm
from serving.hf_io import read_json

# what --draft's loader and the engines read from config.json
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
    """{tensor: shape} of an EAGLE-3 draft with this config (expected_tensors', fc reading 3 target states)."""
    out = expected_tensors("eagle3", dict(cfg, tap_layers=range(3)))
    out["fc.weight"] = (cfg["hidden_size"], 3 * cfg["target_hidden_size"])
    return out


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


# ------------------------------------------------------------------------------------ every family, every format
IGNORED = ("embed_tokens.weight",)  # the verifier's embedding in a speculators file: cospec shares the policy's
BLOCK_IGNORED = IGNORED + ("lm_head.weight", "verifier_lm_head.weight", "verifier_norm.weight", "d2t", "t2d")
# which config fields each tensor's shape comes from (the first pattern in its name that matches), for the errors
_SHAPE_FIELDS = (("markov", ("markov_rank", "vocab_size")), ("confidence", ("hidden_size", "markov_rank")),
                 ("fc.", ("hidden_size", "tap_layers")), ("q_norm.", ("head_dim",)), ("k_norm.", ("head_dim",)),
                 ("q_proj", ("num_attention_heads", "head_dim", "hidden_size")), ("o_proj", ("num_attention_heads",
                  "head_dim", "hidden_size")), ("k_proj", ("num_key_value_heads", "head_dim", "hidden_size")),
                 ("v_proj", ("num_key_value_heads", "head_dim", "hidden_size")),
                 ("mlp", ("intermediate_size", "hidden_size")), ("lm_head", ("draft_vocab_size", "hidden_size")),
                 ("d2t", ("draft_vocab_size",)), ("t2d", ("vocab_size",)))
# cospec's own checkpoint (draft.save): config.json holds the family's config dataclass as {field: value}; here
# {field: default}, ... where there is none (tests/test_export_check_all.py holds these to the dataclasses)
_LAYER = dict.fromkeys(("vocab_size", "hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads",
                        "head_dim", "tap_layers", "target_num_layers"), ...)
_TAIL = {"rms_norm_eps": 1e-6, "rope_theta": 10000.0, "max_position_embeddings": 4096}
COSPEC_FIELDS = {"eagle3": {**_LAYER, "draft_vocab_size": None, **_TAIL},
                 "dflash": {**_LAYER, "mask_token_id": ..., "block_size": 8, "num_layers": 1, **_TAIL}}
COSPEC_FIELDS["dspark"] = {**COSPEC_FIELDS["dflash"], "markov_rank": 16, "confidence_threshold": 0.0}


def expected_tensors(family: str, f: dict) -> dict:
    """{name: shape} of the cospec `family` draft with config fields `f` (speculators_format.to_cospec's, or a cospec
    checkpoint's), in cospec's names. EAGLE-3's one layer reads [e; h] (2H) in q, k, v; a block draft's layers read
    h (H) and norm q and k per head (D); DSpark adds W1, W2 (V, r) and the confidence head on [norm(h_k); W1[prev]]."""
    H, I, D, K = f["hidden_size"], f["intermediate_size"], f["head_dim"], len(f["tap_layers"])
    q, kv = f["num_attention_heads"] * D, f["num_key_value_heads"] * D

    def layer(p: str, width: int) -> dict:
        return {f"{p}input_layernorm.weight": (H,), f"{p}self_attn.q_proj.weight": (q, width),
                f"{p}self_attn.k_proj.weight": (kv, width), f"{p}self_attn.v_proj.weight": (kv, width),
                f"{p}self_attn.o_proj.weight": (H, q), f"{p}post_attention_layernorm.weight": (H,),
                f"{p}mlp.gate_proj.weight": (I, H), f"{p}mlp.up_proj.weight": (I, H),
                f"{p}mlp.down_proj.weight": (H, I)}

    if family == "eagle3":
        Vd = f.get("draft_vocab_size") or f["vocab_size"]
        return {"fc.weight": (H, K * H), **layer("midlayer.", 2 * H), "midlayer.hidden_norm.weight": (H,),
                "norm.weight": (H,), "lm_head.weight": (Vd, H), "d2t": (Vd,), "t2d": (f["vocab_size"],)}
    out = {"fc.weight": (H, K * H), "hidden_norm.weight": (H,), "norm.weight": (H,)}
    for i in range(f["num_layers"]):
        p = f"layers.{i}."
        out.update(layer(p, H), **{f"{p}self_attn.q_norm.weight": (D,), f"{p}self_attn.k_norm.weight": (D,)})
    if family == "dspark":
        V, r = f["vocab_size"], f["markov_rank"]
        out.update({"markov_in.weight": (V, r), "markov_out.weight": (V, r), "confidence.weight": (1, H + r),
                    "confidence.bias": (1,)})
    return out


def check_folder(path: str, listed: str | None = None, *, engine: dict) -> tuple:
    """Check the draft folder `path` (any format serving/formats.detect names) the way its loader reads it. listed:
    the format formats.json says the folder holds. engine: serving/export.py's check_export, check_exportable,
    check_pair and PAIR_FILE (export.check_exports passes them: export.py imports this file, never the reverse).
    -> (family, format, "PATH: <family>, <format> format (<arch>), H=..., ...: ok"); a fault is a ValueError naming
    the file and the field or tensor."""
    file, wfile = os.path.join(path, "config.json"), os.path.join(path, "model.safetensors")
    if not os.path.isfile(file):
        raise ValueError(f"{path}: expected an exported draft folder (config.json + model.safetensors, or a run's "
                         f"draft/ with {FORMATS_FILE}); {file} is missing")
    cfg = read_json(file)
    arch = (cfg.get("architectures") or [None])[0]
    if not spec.is_speculators(cfg) and arch not in VLLM_ARCH and arch not in (None, *COSPEC_ARCH):
        raise ValueError(f"{file}: architectures={cfg.get('architectures')}: expected a draft's ({', '.join(VLLM_ARCH)}"
                         f", a speculators config, or cospec's {', '.join(COSPEC_ARCH)}); a policy checkpoint is "
                         "--model's")
    family, fmt = _named(path, file, lambda: detect(path))
    if listed is not None and listed != fmt:
        raise ValueError(f"{os.path.join(draft_root(path), FORMATS_FILE)}: lists {path} as the {listed} format; its "
                         f"config.json is the {fmt} format")
    if (family, fmt) == ("eagle3", "vllm"):
        engine["check_export"](path)  # as vLLM and SGLang read it (ENGINE_FIXED, d2t / t2d, both aux-id conventions)
    sd = read_export_weights(path)  # readable, finite
    policy, how = find_policy(path, cfg)
    P = policy_fields(policy) if policy else None
    if fmt == "cospec":
        f, problems = _cospec_fields(path, file, family, cfg, P), []
    else:
        f, problems = _served_fields(path, file, family, fmt, cfg, sd, P, engine["check_exportable"])
    names = _file_names(family, fmt)
    expected = {names(k): v for k, v in expected_tensors(family, f).items()}
    if fmt == "speculators" and "embed_tokens.weight" in sd:  # the verifier's, where a file holds it: (V, H)
        expected["embed_tokens.weight"] = (f["vocab_size"], f["hidden_size"])
    maps_optional = family == "eagle3" and f["draft_vocab_size"] == f["vocab_size"]
    tolerated = () if fmt == "cospec" else IGNORED if family == "eagle3" else BLOCK_IGNORED
    missing = [k for k in expected if k not in sd and not (maps_optional and k in ("d2t", "t2d"))]
    extra = [k for k in sd if k not in expected and k not in tolerated]
    problems += [f"{wfile}: tensor(s) {missing} missing (config.json describes a {family} draft that has them)"] * bool(
        missing)
    problems += [f"{wfile}: tensor(s) {extra} are no {family} draft's (its loader would drop or refuse them)"] * bool(
        extra)
    problems += [f"{wfile}: tensor {k!r} has shape {tuple(sd[k].shape)}, expected {want} from config.json "
                 f"({_shape_fields(k, f)})" for k, want in expected.items() if k in sd and tuple(sd[k].shape) != want]
    if family == "eagle3" and not problems:
        problems += vocab_map_problems(wfile, sd, f["draft_vocab_size"], f["vocab_size"])
    if fmt != "cospec" and family != "eagle3":  # the slots a block draft trains: DFlash W - 1, DSpark W
        problems += _slot_problems(file, cfg, f["block_size"] - (family == "dflash"))
    sub = draft_root(path) != os.path.abspath(path)
    if fmt != "cospec" and ((how == "run" and (family, fmt) != ("eagle3", "vllm")) or sub):
        problems += pair_problems(path, engine)  # check_export did it for EAGLE-3's vLLM format; a checkpoint has none
    if problems:
        raise ValueError("; ".join(problems))
    known = policy is not None or (family, fmt) == ("dflash", "vllm")  # z-lab's file names the target's depth
    return family, fmt, summary(path, family, fmt, arch, f, policy, known)


def summary(path: str, family: str, fmt: str, arch: str, f: dict, policy: str | None, depth_known: bool = True
            ) -> str:
    """The line a folder that passes gets: what it holds, and what it was checked against."""
    parts = [f"{family}, {fmt} format ({arch})", f"H={f['hidden_size']}"]
    if family == "eagle3":
        parts.append(f"draft vocab {f['draft_vocab_size']} of {f['vocab_size']}")
    else:
        parts += [f"block {f['block_size']}", f"mask {f['mask_token_id']}", f"{f['num_layers']} layer(s)"]
    if family == "dspark":
        parts.append(f"markov rank {f['markov_rank']}")
    parts.append(f"taps {list(f['tap_layers'])}" + f" of {f['target_num_layers']} layers" * depth_known)
    parts.append(f"policy {policy}" if policy else "no policy found (checked against the file's own fields)")
    return f"{path}: {', '.join(parts)}: ok"


def draft_root(path: str) -> str:
    """<out>/draft for a format's sub-folder <out>/draft/<sub> (its formats.json lists <sub>), else `path`; absolute."""
    p = os.path.abspath(path)
    listing = os.path.join(os.path.dirname(p), FORMATS_FILE)
    if os.path.isfile(listing):
        subs = read_json(listing).values()
        if os.path.basename(p) in [os.path.normpath(s) for s in subs if isinstance(s, str) and s != "."]:
            return os.path.dirname(p)
    return p


def find_policy(path: str, cfg: dict) -> tuple:
    """(folder, how) of the policy the draft at `path` serves: a run's <out>/policy beside <out>/draft, also for a
    format's sub-folder <out>/draft/<sub> ("run"); else the local folder a speculators config names as its verifier
    ("verifier"); else (None, None): the file is checked against its own fields."""
    run = os.path.join(os.path.dirname(draft_root(path)), "policy")
    if os.path.isdir(run):
        return run, "run"
    verifier = (cfg.get("speculators_config") or {}).get("verifier") if isinstance(
        cfg.get("speculators_config"), dict) else None
    name = verifier.get("name_or_path") if isinstance(verifier, dict) else None
    if isinstance(name, str) and os.path.isfile(os.path.join(name, "config.json")):
        return name, "verifier"
    return None, None


def policy_fields(folder: str) -> SimpleNamespace:
    """What a draft takes from its policy, read from <folder>/config.json (any HF decoder's)."""
    file = os.path.join(folder, "config.json")
    hf = read_json(file)
    for k in ("hidden_size", "vocab_size", "num_hidden_layers"):
        if not (type(hf.get(k)) is int and hf[k] >= 1):
            raise ValueError(f"{file}: {k}={hf.get(k)!r}: expected an integer >= 1 (the policy the draft serves)")
    return SimpleNamespace(hidden_size=hf["hidden_size"], vocab_size=hf["vocab_size"],
                           num_hidden_layers=hf["num_hidden_layers"],
                           max_position_embeddings=hf.get("max_position_embeddings", 4096))


def _file_fields(family: str, fmt: str, cfg: dict, scfg: dict, file: str, names: dict) -> SimpleNamespace:
    """A policy stand-in from the draft's own fields, where no policy is found: hidden size and vocabulary from its
    layer config; the layer count z-lab's num_target_layers, else the least the aux ids allow (EAGLE-3 never taps the
    last layer)."""
    tl = scfg.get("transformer_layer_config") or {}
    for k in ("hidden_size", "vocab_size"):
        v = tl.get(k)
        if not (type(v) is int and v >= 1):
            key = f"transformer_layer_config.{k}"
            raise ValueError(f"{file}: {names.get(key, key)}={v!r}: expected an integer >= 1")
    if (family, fmt) == ("dflash", "vllm"):
        n = cfg.get("num_target_layers")
        if not (type(n) is int and n >= 1):
            raise ValueError(f"{file}: num_target_layers={n!r}: expected the target's layer count, an integer >= 1")
    else:
        aux = scfg.get("eagle_aux_hidden_state_layer_ids" if family == "eagle3" else "aux_hidden_state_layer_ids")
        n = max([i for i in aux or () if type(i) is int] + [0]) + (family == "eagle3")
    return SimpleNamespace(hidden_size=tl["hidden_size"], vocab_size=tl["vocab_size"], num_hidden_layers=max(n, 1),
                           max_position_embeddings=tl.get("max_position_embeddings", 4096))


def _served_fields(path: str, file: str, family: str, fmt: str, cfg: dict, sd: dict, P, check_exportable) -> tuple:
    """(the cospec config fields of a vllm / speculators file, checked against the policy P or the file's own fields,
    [problems of the fields to_cospec does not read])."""
    scfg, ssd, names = _named(path, file, lambda: from_vllm(family, cfg, sd)) if fmt == "vllm" else (cfg, sd, {})
    policy = P
    P = P or _file_fields(family, fmt, cfg, scfg, file, names)
    shown = (lambda k: "midlayer." + k.removeprefix("layers.0.") if k.startswith("layers.0.") else k) \
        if (family, fmt) == ("eagle3", "vllm") else (lambda k: k)
    gone = [shown(k) for k in ("fc.weight", "layers.0.self_attn.q_proj.weight", "layers.0.self_attn.k_proj.weight")
            if k not in ssd]
    if gone:  # to_cospec reads their widths
        raise ValueError(f"{os.path.join(path, 'model.safetensors')}: tensor(s) {gone} missing (a {family} draft "
                         "has them)")
    key = "eagle_aux_hidden_state_layer_ids" if family == "eagle3" else "aux_hidden_state_layer_ids"
    aux, zlab = scfg.get(key), (family, fmt) == ("dflash", "vllm")
    if policy is None and not zlab and not (isinstance(aux, list) and all(type(i) is int and i >= 1 for i in aux)
                                            and aux == sorted(set(aux))):
        raise ValueError(f"{file}: {names.get(key, key)}={aux!r}, expected ascending distinct hidden-state ids >= 1 "
                         "(layer i's output is i + 1; no policy found to bound them)")
    try:
        fam, fields, _ = _named(path, file, lambda: spec.to_cospec(scfg, ssd, P, path, names))
    except ValueError as e:
        if policy is not None or "the policy" not in str(e):
            raise
        own = f"num_target_layers={P.num_hidden_layers}" if zlab else "fields"
        raise ValueError(f"{e} [no policy found: 'the policy' is the file's own {own}]") from None
    fields = _checked(path, file, fam, fields)
    layer = cfg if fmt == "vllm" else cfg.get("transformer_layer_config") or {}
    where = "" if fmt == "vllm" else "transformer_layer_config."
    problems = [f"{file}: {where}{k}={layer[k]!r}, expected {v!r} (cospec's {family} layer)"
                for k, v in (("hidden_act", "silu"), ("attention_bias", False), ("mlp_bias", False))
                if layer.get(k, v) != v]
    if family == "eagle3":
        try:  # the engines feed fc exactly 3 states and capture no state after the last layer
            check_exportable(fields["tap_layers"], P.num_hidden_layers)
        except ValueError as e:
            problems.append(f"{file}: {key}={aux}: {e}")
    if (family, fmt) == ("dflash", "vllm"):  # z-lab's fields beyond the speculators ones
        d = cfg.get("dflash_config") or {}
        n = cfg.get("num_target_layers")
        if policy is not None and n is not None and n != policy.num_hidden_layers:
            problems.append(f"{file}: num_target_layers={n!r}, expected the policy's num_hidden_layers "
                            f"{policy.num_hidden_layers}")
        if "block_size" in cfg and "block_size" in d and cfg["block_size"] != d["block_size"]:
            problems.append(f"{file}: block_size={cfg['block_size']!r} but dflash_config.block_size="
                            f"{d['block_size']!r}: expected one block size")
        problems += [f"{file}: {k}={v!r}, expected false (cospec's DFlash block attends to all of itself)"
                     for k, v in (("is_causal", cfg.get("is_causal")), ("dflash_config.causal", d.get("causal")))
                     if v]
    return fields, problems


def _cospec_fields(path: str, file: str, family: str, cfg: dict, P) -> dict:
    """The config fields of cospec's own checkpoint (draft.save: the family's config dataclass, COSPEC_FIELDS), read
    as its load reads them, checked against the policy P where one is found."""
    raw, table = {k: v for k, v in cfg.items() if k != "architectures"}, COSPEC_FIELDS[family]
    missing, unknown = [k for k, v in table.items() if v is ... and k not in raw], [k for k in raw if k not in table]
    if missing or unknown:
        raise ValueError(f"{file}: " + "; ".join([f"missing key(s) {missing}"] * bool(missing) + [
            f"unknown key(s) {unknown}"] * bool(unknown)) + f" (a cospec {family} checkpoint's config holds "
            f"{', '.join(table)})")
    f = _checked(path, file, family, {**{k: v for k, v in table.items() if v is not ...}, **raw})
    if P is not None:
        for k, pk in (("hidden_size", "hidden_size"), ("vocab_size", "vocab_size"),
                      ("target_num_layers", "num_hidden_layers")):
            if f[k] != getattr(P, pk):
                raise ValueError(f"{file}: {k}={f[k]!r}, expected the policy's {pk} {getattr(P, pk)}")
    return f


def _checked(path: str, file: str, family: str, f: dict) -> dict:
    """Config fields `f` with the values the family's config accepts (what its dataclass checks: block, MASK id,
    depth, Markov rank, the layers' sizes as ModelConfig's, the taps, the draft vocabulary); EAGLE-3's
    draft_vocab_size filled in."""
    def check():
        V = f["vocab_size"]
        for k, ok, want in (("block_size", lambda v: v >= 2, ">= 2 (the anchor slot and one draft slot)"),
                            ("mask_token_id", lambda v: 0 <= v < V, f"an id in [0, {V})"),
                            ("num_layers", lambda v: v >= 1, ">= 1"), ("markov_rank", lambda v: v >= 1, ">= 1")):
            if family != "eagle3" and k in f and not (type(f[k]) is int and ok(f[k])):
                raise ValueError(f"{k}={f[k]!r}: expected {want}")
        t = f.get("confidence_threshold", 0.0)
        if not (type(t) in (int, float) and 0 <= t <= 1):
            raise ValueError(f"confidence_threshold={t!r}: expected in [0, 1] (0: off)")
        ModelConfig(vocab_size=V, hidden_size=f["hidden_size"], intermediate_size=f["intermediate_size"],
                    num_hidden_layers=f.get("num_layers", 1), head_dim=f["head_dim"],
                    num_attention_heads=f["num_attention_heads"], num_key_value_heads=f["num_key_value_heads"],
                    rms_norm_eps=f["rms_norm_eps"], rope_theta=f["rope_theta"],
                    max_position_embeddings=f["max_position_embeddings"])
        taps = check_tap_layers(f["tap_layers"], f["target_num_layers"])
        if not taps or EMBED_TAP in taps:
            raise ValueError(f"tap_layers={taps}: expected >= 1 policy layer id and not the embeddings ({EMBED_TAP})")
        if family != "eagle3":
            return dict(f, tap_layers=taps)
        Vd = V if f.get("draft_vocab_size") is None else f["draft_vocab_size"]
        if not (type(Vd) is int and 1 <= Vd <= V):
            raise ValueError(f"draft_vocab_size={Vd!r}: expected an integer in [1, vocab_size={V}]")
        return dict(f, tap_layers=taps, draft_vocab_size=Vd)
    return _named(path, file, check)


def _file_names(family: str, fmt: str):
    """cospec's parameter name -> the file's name for it (serving/speculators_format.py's RENAMES, layers.0.)."""
    if fmt != "speculators":
        return lambda k: k  # cospec's names are vLLM's EAGLE-3 and z-lab's DFlash names
    if family == "eagle3":
        return lambda k: "layers.0." + k.removeprefix("midlayer.") if k.startswith("midlayer.") else k
    back = {v: k for k, v in spec.RENAMES.items()}
    return lambda k: back.get(k, k)


def _shape_fields(name: str, f: dict) -> str:
    keys = next((ks for part, ks in _SHAPE_FIELDS if part in name), ("hidden_size",))
    return ", ".join(f"{len(f['tap_layers'])} taps" if k == "tap_layers" else f"{k}={f[k]}" for k in keys)


def _slot_problems(file: str, cfg: dict, k_max: int) -> list:
    """A speculators block draft's proposal methods propose no more tokens than the k_max slots the draft trained."""
    methods = (cfg.get("speculators_config") or {}).get("proposal_methods") or []
    return [f"{file}: speculators_config.proposal_methods[{i}].speculative_tokens={m.get('speculative_tokens')!r}, "
            f"expected an integer in [1, {k_max}] (the slots this block draft trained)"
            for i, m in enumerate(methods) if isinstance(m, dict) and "speculative_tokens" in m
            and not (type(m["speculative_tokens"]) is int and 1 <= m["speculative_tokens"] <= k_max)]


def vocab_map_problems(file: str, sd: dict, Vd: int, V: int) -> list:
    """d2t int64 offsets to Vd distinct target ids, t2d (V,) bool exactly their image; nothing where they are absent."""
    if "d2t" not in sd or "t2d" not in sd:
        return []
    ids = torch.arange(Vd) + sd["d2t"]
    if sd["d2t"].dtype != torch.int64 or int(ids.min()) < 0 or int(ids.max()) >= V or ids.unique().numel() != Vd:
        return [f"{file}: tensor 'd2t': expected int64 offsets to {Vd} distinct target ids in [0, {V})"]
    if not torch.equal(sd["t2d"], torch.zeros(V, dtype=torch.bool).index_fill(0, ids, True)):
        return [f"{file}: tensor 't2d': expected exactly the target ids d2t maps to"]
    return []


def pair_problems(path: str, engine: dict) -> list:
    """The run's pair check (serving/export.check_pair) on <out>/draft, and a format's sub-folder written by the same
    export as <out>/draft (the same PAIR_FILE). engine: check_folder's."""
    root = draft_root(path)
    out = engine["check_pair"](root)
    mine, top = os.path.join(path, engine["PAIR_FILE"]), os.path.join(root, engine["PAIR_FILE"])
    if root != os.path.abspath(path) and os.path.isfile(top) and (
            not os.path.isfile(mine) or read_json(mine) != read_json(top)):
        out.append(f"{mine}: missing or not {top}: the formats in {root} come from different exports")
    return out


def _named(path: str, file: str, call):
    """call(); its ValueError (serving/formats.py's and speculators_format.py's name the folder: "draft 'PATH': ")
    names `file` instead; a malformed value read as the wrong type is one line naming the file too."""
    try:
        return call()
    except ValueError as e:
        raise ValueError(f"{file}: {str(e).removeprefix(f'draft {path!r}: ')}") from None
    except (KeyError, TypeError, AttributeError, IndexError) as e:
        raise ValueError(f"{file}: malformed ({type(e).__name__}: {e})") from None
