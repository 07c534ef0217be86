"""Serve what was trained: the co-trained draft in the format vLLM and SGLang load, and the policy beside it.

Both engines load an EAGLE-3 draft as `LlamaForCausalLMEagle3`: a Llama config with one decoder layer and these
weights (cospec's parameter names already are them, so the export is a config translation and a dtype cast):

    fc.weight (H, 3H)            h^0 = fc([a_1; a_2; a_3])        the 3 aux states in ascending layer order
    midlayer.*                   x = [input_layernorm(e); hidden_norm(h^0)] (2H) -> attention (RoPE), residual h^0
                                 (norm after the residual: config norm_before_residual = false), then the MLP
    norm.weight, lm_head.weight  q = softmax(lm_head(norm(h)))    (Vd, H): the draft-vocabulary rows only
    d2t (Vd,) int64, t2d (V,) bool   target id = draft id + d2t[draft id]; t2d marks the target ids the draft can name
                                 -- written only for a reduced draft vocabulary (Vd < V): vLLM creates its
                                 draft_id_to_target_id parameter only then and refuses a d2t at Vd = V (t2d it skips)

No embedding: both engines share the target's. The aux ids are written twice because the engines count differently
(checked in vLLM's `model_executor/models/{llama,llama_eagle3}.py` and SGLang's `srt/models/{llama,llama_eagle3}.py`,
commits in docs/serving.md): vLLM's top-level `eagle_aux_hidden_state_layer_ids` = tap + 1 (it captures the state
*entering* layer i, so the last layer's output cannot be captured), SGLang's `eagle_config.
eagle_aux_hidden_state_layer_ids` = tap (it adds the one itself). cospec's tap t is the output of layer t (0-indexed).

    draft.export(path)                                    # the draft alone (Eagle3Draft.export calls export_draft)
    write_servables(out, policy, draft, tokenizer_dir, step=s)   # <out>/policy/ (HF checkpoint) + <out>/draft/ (export)
    python -m serving.export runs/default/draft                   # reads every format back, checks each as loaded

Each directory lands atomically: written under a temporary sibling name, then renamed into place (a reader sees the
old directory or the new one, never half of one; between the two renames the path is briefly absent, and a kill there
leaves <path>.old<pid> / <path>.tmp<pid>, which recover_swaps puts right at the next start).

The two servables are a pair: each holds servable.json (PAIR_FILE) with the step it comes from, and the draft's records
the sha256 of the policy's weights it was exported beside; check_export refuses a draft whose sibling policy/ is
another (a kill between the two exports, or an older run's draft). A policy whose draft cannot be exported removes
the old draft/ instead of leaving it beside the new policy.

Letters: H hidden, V target vocab, Vd draft vocab.
"""
from __future__ import annotations

import glob
import hashlib
import json
import os
import re
import shutil
import sys

import torch
from safetensors.torch import save_file

from parallel.cli import writing
from serving.formats import FORMATS_FILE

ARCHITECTURE = "LlamaForCausalLMEagle3"  # vLLM's registry name and SGLang's EntryClass
NUM_AUX = 3  # both engines hard-code fc to 3 target hidden states
WEIGHTS = ("fc.weight", "midlayer.input_layernorm.weight", "midlayer.hidden_norm.weight",
           "midlayer.self_attn.q_proj.weight", "midlayer.self_attn.k_proj.weight", "midlayer.self_attn.v_proj.weight",
           "midlayer.self_attn.o_proj.weight", "midlayer.post_attention_layernorm.weight",
           "midlayer.mlp.gate_proj.weight", "midlayer.mlp.up_proj.weight", "midlayer.mlp.down_proj.weight",
           "norm.weight", "lm_head.weight")  # exactly these: SGLang silently drops names it does not know
VOCAB_MAPS = ("d2t", "t2d")  # written (and required) only for a reduced draft vocabulary, Vd < V; never at Vd = V
# config fields vLLM's llama_eagle3.py reads that would change the computation cospec trained; the export writes
# each at the value here (or leaves it out, where absent means the same), and check_export refuses any other
ENGINE_FIXED = {"norm_before_residual": False, "norm_before_fc": False, "fc_norm": False, "norm_output": False,
                "attention_bias": False, "mlp_bias": False, "logit_scale": 1.0, "tie_word_embeddings": False}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json",
                   "chat_template.jinja", "chat_template.json", "tokenizer.model", "vocab.json", "merges.txt",
                   "added_tokens.json")
PAIR_FILE = "servable.json"  # {"step", "weights_sha256"} in policy/, {"step", "policy_sha256"} in draft/
_DTYPES = {torch.bfloat16: "bfloat16", torch.float16: "float16", torch.float32: "float32", torch.float64: "float64"}


def check_exportable(tap_layers, target_num_layers: int) -> tuple:
    """The taps an engine can feed: exactly 3, ascending, none on the last layer (vLLM captures states entering a
    layer). Returns them sorted."""
    taps = tuple(sorted(int(t) for t in tap_layers))
    if len(taps) != NUM_AUX:
        raise ValueError(f"tap_layers={tuple(tap_layers)}: vLLM and SGLang feed the draft's fc exactly {NUM_AUX} "
                         f"target hidden states; this draft reads {len(taps)} (a policy with >= 4 layers gets 3 by "
                         f"default)")
    if taps[0] < 0:
        raise ValueError(f"tap_layers={taps}: the embeddings (-1) cannot be exported as an aux state")
    if taps[-1] >= target_num_layers - 1:
        raise ValueError(f"tap_layers={taps}: layer {taps[-1]} is the last of {target_num_layers}; vLLM captures the "
                         "state entering a layer, so the last layer's output is never available to the draft")
    return taps


def vllm_aux_ids(taps) -> list:  # the state entering layer t + 1 = the output of layer t
    return [t + 1 for t in taps]


def eagle3_config(draft, *, dtype=torch.bfloat16, max_position_embeddings: int | None = None) -> dict:
    """The config.json both engines read (a transformers.LlamaConfig with the EAGLE-3 fields)."""
    c = draft.cfg
    taps = check_exportable(c.tap_layers, c.target_num_layers)
    if tuple(c.tap_layers) != taps:
        raise ValueError(f"tap_layers={c.tap_layers}: fc concatenates in this order; the engines use ascending order")
    if dtype not in _DTYPES:
        raise ValueError(f"dtype={dtype}: expected one of {list(_DTYPES)}")
    return dict(
        architectures=[ARCHITECTURE], model_type="llama", num_hidden_layers=1, hidden_size=c.hidden_size,
        intermediate_size=c.intermediate_size, num_attention_heads=c.num_attention_heads,
        num_key_value_heads=c.num_key_value_heads, head_dim=c.head_dim, hidden_act="silu",
        rms_norm_eps=c.rms_norm_eps, rope_theta=c.rope_theta, rope_scaling=None,
        max_position_embeddings=int(max_position_embeddings or c.max_position_embeddings),
        vocab_size=c.vocab_size, draft_vocab_size=int(c.draft_vocab_size), target_hidden_size=c.hidden_size,
        tie_word_embeddings=False, attention_bias=False, mlp_bias=False, norm_before_residual=False,
        torch_dtype=_DTYPES[dtype],
        eagle_aux_hidden_state_layer_ids=vllm_aux_ids(taps),  # vLLM: the state entering layer t + 1
        eagle_config={"eagle_aux_hidden_state_layer_ids": list(taps), "use_aux_hidden_state": True})  # SGLang: t


def exported_names(draft_vocab_size: int, vocab_size: int) -> tuple:
    """The tensors an export holds: WEIGHTS, plus d2t and t2d for a reduced draft vocabulary only."""
    return WEIGHTS + VOCAB_MAPS * (draft_vocab_size < vocab_size)


def eagle3_state_dict(draft, *, dtype=torch.bfloat16) -> dict:
    """{name: tensor} in exported_names order: floats cast to `dtype`, d2t int64, t2d bool, all on the CPU."""
    sd = draft.state_dict()
    if set(sd) != set(WEIGHTS + VOCAB_MAPS):
        raise ValueError(f"draft: parameters {sorted(set(sd) ^ set(WEIGHTS + VOCAB_MAPS))} differ from the EAGLE-3 "
                         "names")
    cast = {"d2t": torch.int64, "t2d": torch.bool}
    return {k: sd[k].detach().to(device="cpu", dtype=cast.get(k, dtype)).contiguous()
            for k in exported_names(draft.cfg.draft_vocab_size, draft.cfg.vocab_size)}


def export_state_dict(path: str) -> dict:
    """The export's tensors with d2t / t2d always present (identity maps at a full draft vocabulary, where the
    export leaves them out): what Eagle3Draft.load_state_dict takes."""
    from safetensors.torch import load_file
    from serving.draft_vocab import maps
    with open(os.path.join(path, "config.json")) as f:
        cfg = json.load(f)
    sd = load_file(os.path.join(path, "model.safetensors"))
    Vd, V = cfg["draft_vocab_size"], cfg["vocab_size"]
    ids = torch.arange(Vd) + sd["d2t"] if "d2t" in sd else torch.arange(Vd)
    sd["d2t"], sd["t2d"] = maps(ids, V)
    return sd


def export_draft(draft, path: str, *, dtype=torch.bfloat16, max_position_embeddings: int | None = None,
                 pair: dict | None = None, verifier: str | None = None):
    """config.json + model.safetensors that vLLM's and SGLang's LlamaForCausalLMEagle3 load, written atomically;
    pair ({"step", "policy_sha256"}, from write_servables): also PAIR_FILE. The same draft in the speculators format
    goes into `path`/speculators (verifier: the policy's folder or hub id it names)."""
    from serving.speculators_format import beside
    write_export(path, eagle3_config(draft, dtype=dtype, max_position_embeddings=max_position_embeddings),
                 eagle3_state_dict(draft, dtype=dtype), pair,
                 also=beside(draft, "eagle3", verifier=verifier, dtype=dtype))


def write_export(path: str, cfg: dict, sd: dict, pair: dict | None = None, *, top: str = "vllm",
                 also: dict | None = None):
    """Any family's export: config.json + model.safetensors (+ PAIR_FILE with `pair`), written atomically. top: the
    format of those; also: {format: (config, state dict)} each written into the sub-folder of that name. With
    `also`, formats.json lists {format: sub-folder} ("." for the top one): what the folder holds."""
    def put(folder, c, tensors):
        os.makedirs(folder, exist_ok=True)
        save_file(tensors, os.path.join(folder, "model.safetensors"), metadata={"format": "pt"})
        with open(os.path.join(folder, "config.json"), "w") as f:
            json.dump(c, f, indent=2)
        if pair is not None:
            _write_json(os.path.join(folder, PAIR_FILE), pair)

    def write(tmp):
        put(tmp, cfg, sd)
        for name, (c, tensors) in (also or {}).items():
            put(os.path.join(tmp, name), c, tensors)
        if also is not None:
            _write_json(os.path.join(tmp, FORMATS_FILE), {top: ".", **{name: name for name in also}})
    atomic_dir(path, write)


def _write_json(path: str, obj: dict):
    with open(path, "w") as f:
        json.dump(obj, f, indent=2)


def weights_sha256(folder: str) -> str:
    """sha256 over the *.safetensors files of `folder`, by name order: what identifies a policy export."""
    h = hashlib.sha256()
    for name in sorted(f for f in os.listdir(folder) if f.endswith(".safetensors")):
        h.update(name.encode() + b"\0")
        with open(os.path.join(folder, name), "rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                h.update(block)
    return h.hexdigest()


def remove_dir(path: str):
    """Delete a directory so that no reader sees half of it: renamed away first, then removed."""
    if os.path.exists(path):
        trash = f"{os.path.abspath(path)}.old{os.getpid()}"
        os.rename(path, trash)
        shutil.rmtree(trash)


def write_servables(out_dir: str, policy, draft, tokenizer_dir: str | None = None, *, dtype=torch.bfloat16,
                    require_draft: bool = True, step: int | None = None) -> dict:
    """<out_dir>/policy/: the policy as an HF checkpoint (hf_io.save_pretrained, the policy's own dtype) plus, in HF
    mode, the tokenizer files of `tokenizer_dir` (the checkpoint the run started from); <out_dir>/draft/: the export.
    `policy` must be whole (re-assembled from the pipeline stages) and `draft` the rollout draft. Call on one rank.
    A draft the engines cannot load (a policy under 4 layers: fewer than 3 taps) is an error, or with
    require_draft=False is skipped: an earlier draft/ is removed, so no draft of another policy stays beside this one.
    Both directories record `step` and the pair (PAIR_FILE). Returns {"policy": path, "draft": path or None,
    "skipped": None or why}."""
    from serving.hf_io import save_pretrained  # here, not at the top: the draft export needs no policy code
    try:
        if draft is None:  # a run without a draft (plain GRPO)
            raise ValueError("the run has no draft")
        draft.check_exportable()  # drafter.py: a ValueError says why its family's format cannot hold it
        skipped = None
    except ValueError as e:
        if require_draft:
            raise
        skipped = str(e)
    if policy.layer_range != (0, policy.cfg.num_hidden_layers):
        raise ValueError("policy: needs the whole model (re-assemble the pipeline stages first), got layers "
                         f"{policy.layer_range} of {policy.cfg.num_hidden_layers}")
    if draft is not None and (draft.cfg.target_num_layers != policy.cfg.num_hidden_layers
                              or draft.cfg.vocab_size != policy.cfg.vocab_size):
        raise ValueError(f"draft: built for a {draft.cfg.target_num_layers}-layer, V={draft.cfg.vocab_size} target; "
                         f"the policy has {policy.cfg.num_hidden_layers} layers, V={policy.cfg.vocab_size}")
    if tokenizer_dir is not None and not os.path.isfile(os.path.join(tokenizer_dir, "tokenizer.json")):
        raise ValueError(f"tokenizer_dir={tokenizer_dir!r}: no tokenizer.json there (expected the HF checkpoint)")
    os.makedirs(out_dir, exist_ok=True)
    pair = {}

    def write_policy(tmp):
        save_pretrained(policy, tmp)
        for name in TOKENIZER_FILES if tokenizer_dir else ():
            if os.path.isfile(os.path.join(tokenizer_dir, name)):
                shutil.copy2(os.path.join(tokenizer_dir, name), os.path.join(tmp, name))
        pair.update(step=step, policy_sha256=weights_sha256(tmp))
        _write_json(os.path.join(tmp, PAIR_FILE), {"step": step, "weights_sha256": pair["policy_sha256"]})
    if skipped:  # first, so that no moment sees the new policy beside the old draft
        remove_dir(os.path.join(out_dir, "draft"))
    atomic_dir(os.path.join(out_dir, "policy"), write_policy)
    if skipped:
        return {"policy": os.path.join(out_dir, "policy"), "draft": None, "skipped": skipped}
    draft.export(os.path.join(out_dir, "draft"), dtype=dtype,  # its family's serving formats (drafter.py)
                 max_position_embeddings=policy.cfg.max_position_embeddings, pair=pair,
                 verifier=os.path.abspath(os.path.join(out_dir, "policy")))
    return {"policy": os.path.join(out_dir, "policy"), "draft": os.path.join(out_dir, "draft"), "skipped": None}


def atomic_dir(path: str, write):
    """write(tmp) fills a fresh sibling directory, which then replaces `path` (rename; the old one is removed)."""
    path = os.path.abspath(path)
    tmp, old = f"{path}.tmp{os.getpid()}", f"{path}.old{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    try:
        with writing(path):  # a full disk: one error naming the directory (safetensors' SafetensorError too)
            write(tmp)
    except BaseException:  # Ctrl-C too: no half-written directory is left
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if os.path.exists(path):
        os.rename(path, old)
    os.rename(tmp, path)
    shutil.rmtree(old, ignore_errors=True)


def pid_alive(pid: int) -> bool:  # the writer of a *.tmp<pid> / *.old<pid> still runs
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def recover_swaps(out_dir: str, names=("policy", "draft")) -> list[str]:
    """Finish what a kill inside atomic_dir left, for each servable directory: <name> absent beside <name>.old<pid>
    (killed between the two renames: <name>.tmp<pid> is the complete new export, else the old one is put back); any
    other .old / .tmp of a process that is gone is a leftover and is deleted. -> one note per action."""
    notes = []
    for name in names:
        path = os.path.abspath(os.path.join(out_dir, name))
        left = {kind: sorted(p for p in glob.glob(f"{glob.escape(path)}.{kind}*")
                             if (m := re.fullmatch(rf"{re.escape(path)}\.{kind}(\d+)", p)) and not pid_alive(int(m[1])))
                for kind in ("old", "tmp")}
        if not os.path.exists(path) and left["old"]:
            src = left["tmp"][-1] if left["tmp"] else left["old"][-1]
            os.rename(src, path)
            notes.append(f"recovered {path} from {src}, left by an interrupted export")
        for p in left["old"] + left["tmp"]:
            if os.path.exists(p):
                shutil.rmtree(p)
                notes.append(f"deleted {p}, left by an interrupted export")
    return notes


def check_pair(path: str, cfg: dict | None = None) -> list[str]:
    """Problems of the draft export at `path` (config `cfg`) as one half of a servable pair with the policy/ beside
    it: the same write, and a draft that fits the policy (vocab_size, target_hidden_size, aux ids below its layers)."""
    policy = os.path.join(os.path.dirname(os.path.abspath(path)), "policy")
    mine, theirs = os.path.join(path, PAIR_FILE), os.path.join(policy, PAIR_FILE)
    if not os.path.isdir(policy):
        return []  # a draft on its own (exported alone, or copied away from its run): no pair to check
    if not os.path.isfile(mine) or not os.path.isfile(theirs):
        missing = mine if not os.path.isfile(mine) else theirs
        return [f"{missing} is missing: {path} and {policy} do not come from one export (write_servables)"]
    from serving.hf_io import read_json
    d, p = read_json(mine), read_json(theirs)
    if d.get("policy_sha256") != weights_sha256(policy):
        return [f"the draft (step {d.get('step')}) was exported beside another policy than {policy} (step "
                f"{p.get('step')}): the pair does not match (an interrupted export, or another run's draft)"]
    with open(os.path.join(policy, "config.json")) as f:
        pc = json.load(f)
    n, aux = pc.get("num_hidden_layers", 0), (cfg or {}).get("eagle_aux_hidden_state_layer_ids") or []
    bad = [f"{k}={cfg[k]} but the policy's {pk}={pc.get(pk)}" for k, pk in (("vocab_size", "vocab_size"),
           ("target_hidden_size", "hidden_size")) if cfg and cfg.get(k) != pc.get(pk)]
    return bad + [f"vLLM aux ids {aux}: the policy has {n} layers"] * any(not 0 < a < n for a in aux)


def check_export(path: str) -> dict:
    """Read an exported draft back and check it the way the engines will load it (vLLM 0.32's llama_eagle3.py read
    for every name and field): the architecture, every config key named when missing, the sizes; readable, finite
    weights; exactly the exported_names tensors with their shapes against config.json (d2t / t2d only at a reduced
    draft vocabulary: vLLM refuses a d2t at Vd = V, and without one at Vd < V it would propose draft ids as target
    ids); int64 d2t mapping into the target vocabulary, t2d its image; 3 aux ids in both conventions; ENGINE_FIXED
    fields at cospec's values; and beside a policy/ (write_servables), that the two are one pair fitting each other
    (check_pair). Returns the config."""
    from serving.export_checks import read_export_config, read_export_weights, shape_problems
    cfg = read_export_config(path, ARCHITECTURE)  # JSON, architecture, every key named when missing, the sizes
    sd = read_export_weights(path)  # readable and finite
    V, Vd = cfg["vocab_size"], cfg["draft_vocab_size"]
    problems = []
    if Vd == V and set(VOCAB_MAPS) & set(sd):
        problems.append(f"{sorted(set(VOCAB_MAPS) & set(sd))} at the full draft vocabulary ({Vd} = vocab_size): vLLM "
                        "has no draft_id_to_target_id parameter then and refuses the checkpoint; leave them out")
    elif set(sd) != set(exported_names(Vd, V)):
        problems.append(f"weights {sorted(set(sd) ^ set(exported_names(Vd, V)))} differ from {ARCHITECTURE}'s")
    problems += shape_problems(path, sd, cfg)
    if "d2t" in sd and "t2d" in sd and not problems:
        ids = torch.arange(Vd) + sd["d2t"]
        if sd["d2t"].dtype != torch.int64 or int(ids.min()) < 0 or int(ids.max()) >= V or ids.unique().numel() != Vd:
            problems.append("d2t: expected int64 offsets to distinct target ids")
        elif not torch.equal(sd["t2d"], torch.zeros(V, dtype=torch.bool).index_fill(0, ids, True)):
            problems.append("t2d: expected exactly the target ids d2t maps to")
    v_ids, eagle = cfg.get("eagle_aux_hidden_state_layer_ids"), cfg.get("eagle_config", {})
    s_ids = eagle.get("eagle_aux_hidden_state_layer_ids")
    if not (isinstance(s_ids, list) and len(s_ids) == NUM_AUX and v_ids == vllm_aux_ids(s_ids)):
        problems.append(f"aux ids: vLLM {v_ids} must be SGLang's {s_ids} + 1, {NUM_AUX} of them")
    if eagle.get("use_aux_hidden_state", True) is not True or cfg.get("num_aux_hidden_states", NUM_AUX) != NUM_AUX:
        problems.append(f"eagle_config.use_aux_hidden_state / num_aux_hidden_states: the draft's fc reads {NUM_AUX} "
                        "aux states")
    problems += [f"{k}={cfg[k]!r}: the trained draft has {v!r}" for k, v in ENGINE_FIXED.items()
                 if cfg.get(k, v) != v or eagle.get(k, v) != v]
    problems += check_pair(path, cfg)
    if problems:
        raise ValueError(f"{path}: not a servable EAGLE-3 draft: " + "; ".join(problems))
    return cfg


def check_exports(path: str):
    """Every format of the draft export at `path`: a folder of any format (serving/formats.detect), or a run's
    <out>/draft whose FORMATS_FILE lists {format: sub-folder}, each folder checked by export_checks.check_folder
    with this file's engine checks. Yields one line per format that passes; then a fault in any is one ValueError
    naming its file and field or tensor (the faults of several formats joined by "; ")."""
    from serving.export_checks import check_folder
    from serving.hf_io import read_json
    engine = {"check_export": check_export, "check_exportable": check_exportable, "check_pair": check_pair,
              "PAIR_FILE": PAIR_FILE}  # export_checks imports nothing of this file's: it is handed them
    listing = os.path.join(path, FORMATS_FILE)
    if not os.path.isfile(listing):
        yield check_folder(path, engine=engine)[2]
        return
    formats = read_json(listing)
    if not formats or not all(isinstance(v, str) for v in formats.values()):
        raise ValueError(f"{listing}: expected {{format: sub-folder}} of the formats the export holds, got {formats}")
    faults, families = [], {}
    for fmt, sub in formats.items():
        try:
            families[fmt], _, line = check_folder(os.path.normpath(os.path.join(path, sub)), fmt, engine=engine)
        except ValueError as e:
            faults.append(str(e))
            continue
        yield line
    if len(set(families.values())) > 1:
        faults.append(f"{listing}: its formats hold different draft families {families}")
    if faults:
        raise ValueError("; ".join(faults))


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        raise ValueError("usage: python -m serving.export PATH     # checks an exported draft: a run's <out>/draft "
                         "(every format its formats.json lists) or one folder of any format")
    for line in check_exports(argv[0]):
        print(line, flush=True)
    return 0


if __name__ == "__main__":
    from parallel.cli import answer_help, run_main
    answer_help(__doc__, __file__)  # -h / --help: usage and summary from the docstring, exit 0
    run_main(main, __file__)  # an error: one line naming the file, key or tensor, exit 1
