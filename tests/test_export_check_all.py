"""`python -m serving.export PATH` (serving/export.check_exports, serving/export_checks.check_folder) on every family in
every format: each valid export passes with one line per format, a run's <out>/draft has each format in formats.json
checked, and a damaged copy is refused in one line naming the file and the fault (a truncated or NaN weights file,
tap ids out of the policy's range, out of order or not matching fc, a MASK id out of range, a missing or misshapen
tensor, DSpark's Markov and confidence heads, a switch at a value cospec does not compute); export_checks'
expected_tensors is held to each family's real draft. Adds ~1 s to the suite on a 2-core CPU (0.4-0.6 s measured:
every export is a tiny policy's, the checker computes every expected shape from config fields)."""
import dataclasses
import json
import os
import re
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from draft import DraftConfig, Eagle3Draft
from draft_dflash import DFlashConfig, DFlashDraft
from draft_dspark import DSparkConfig, DSparkDraft
from model import ModelConfig, Transformer
from parallel.cli import run_main
from serving import export
from serving.export_checks import COSPEC_FIELDS, expected_tensors
from serving.hf_io import save_pretrained
from format_cases import CELLS, FAMILIES

pytestmark = pytest.mark.usefixtures("one_thread")

ARCH = {("eagle3", "vllm"): "LlamaForCausalLMEagle3", ("eagle3", "speculators"): "Eagle3DraftModel",
        ("dflash", "vllm"): "DFlashDraftModel", ("dflash", "speculators"): "DFlashDraftModel",
        ("dspark", "speculators"): "DSparkDraftModel"}
# the tiny preset: H = 32, V = 97, 4 layers; EAGLE-3's taps (0, 1, 2), the block drafts' (1, 2); I = 64
H, V, N = 32, 97, 4


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    """<root>/<family>: draft.export alone; <root>/run_<family>: write_servables (policy/ + draft/)."""
    torch.manual_seed(0)
    policy = Transformer(ModelConfig.preset("tiny", qk_norm=True)).eval()
    assert (policy.cfg.hidden_size, policy.cfg.vocab_size, policy.cfg.num_hidden_layers) == (H, V, N)
    root = tmp_path_factory.mktemp("exports")
    for family, make in FAMILIES.items():
        draft = make(policy)
        draft.export(str(root / family), dtype=torch.float32)
        export.write_servables(str(root / f"run_{family}"), policy, draft, step=3)
        draft.save(str(root / f"cospec_{family}"))
    return root, policy


def _copy(made, tmp_path, name):
    shutil.copytree(made[0] / name, tmp_path / name)
    return tmp_path / name


def _config(folder, edit):
    c = json.loads((folder / "config.json").read_text())
    edit(c)
    (folder / "config.json").write_text(json.dumps(c))


def _weights(folder, edit):
    sd = load_file(str(folder / "model.safetensors"))
    edit(sd)
    save_file(sd, str(folder / "model.safetensors"))


def _refused(path, match):
    with pytest.raises(ValueError, match=match) as e:
        export.main([str(path)])
    assert "\n" not in str(e.value)
    return str(e.value)


@pytest.mark.parametrize("family,fmt,sub", CELLS)
def test_every_valid_export_passes_with_its_line(made, capsys, family, fmt, sub):
    root, _ = made
    path = root / family / sub
    assert export.main([str(path)]) == 0
    line = capsys.readouterr().out.strip()
    assert line.startswith(f"{path}: {family}, {fmt} format ({ARCH[family, fmt]}), H={H}, ") and line.endswith(": ok")
    if family == "eagle3":
        assert "draft vocab 49 of 97, taps [0, 1, 2]" in line
    else:
        assert "block 4, mask 0, 2 layer(s), " in line and "taps [1, 2]" in line
    assert ("markov rank 4" in line) == (family == "dspark")
    # z-lab's config names the target's depth; elsewhere, with no policy beside it, the file's own fields are all
    assert ("of 4 layers" in line) == ((family, fmt) == ("dflash", "vllm"))
    assert "no policy found" in line


@pytest.mark.parametrize("family", list(FAMILIES))
def test_a_run_checks_every_format_formats_json_lists(made, capsys, family):
    root, _ = made
    out = root / f"run_{family}"
    assert export.main([str(out / "draft")]) == 0
    lines = capsys.readouterr().out.strip().split("\n")
    listing = json.loads((out / "draft" / "formats.json").read_text())
    assert len(lines) == len(listing) == (1 if family == "dspark" else 2)
    for line, (fmt, sub) in zip(lines, listing.items()):
        folder = out / "draft" if sub == "." else out / "draft" / sub
        assert line.startswith(f"{folder}: {family}, {fmt} format") and line.endswith(f"of {N} layers, policy "
                                                                                        f"{out / 'policy'}: ok")
    assert export.main([str(out / "draft" / "speculators" if family != "dspark" else out / "draft")]) == 0


def _truncate(d):
    (d / "model.safetensors").write_bytes((d / "model.safetensors").read_bytes()[:-64])


def _nan(d):
    _weights(d, lambda sd: sd["norm.weight"].__setitem__(0, float("nan")))


def _drop(name):
    return lambda d: _weights(d, lambda sd: sd.pop(name))


def _reshape(name, shape):
    return lambda d: _weights(d, lambda sd: sd.__setitem__(name, torch.zeros(shape)))


def _set(key, value):
    def edit(c):
        *path, last = key.split(".")
        for k in path:
            c = c[k]
        c[last] = value
    return lambda d: _config(d, edit)


def _eagle3_vllm_ids(vllm):
    def edit(c):
        c["eagle_aux_hidden_state_layer_ids"] = vllm
        c["eagle_config"]["eagle_aux_hidden_state_layer_ids"] = [i - 1 for i in vllm]
    return lambda d: _config(d, edit)


E, ES, D, DS, S = "eagle3/.", "eagle3/speculators", "dflash/.", "dflash/speculators", "dspark/."
RE, RES, RD, RDS, RS = ("run_eagle3/draft/.", "run_eagle3/draft/speculators", "run_dflash/draft/.",
                        "run_dflash/draft/speculators", "run_dspark/draft/.")
# (folder, damage, the file it names, what the line says)
FAULTS = [
    *[(c, _truncate, "model.safetensors", "unreadable safetensors file") for c in (E, ES, D, DS, S)],
    *[(c, _nan, "model.safetensors", r"tensor\(s\) \['norm.weight'\] hold NaN or inf") for c in (E, ES, D, DS, S)],
    # tap ids: out of the policy's range (the run's policy/, or z-lab's num_target_layers), out of order, not fc's
    (RE, _eagle3_vllm_ids([2, 3, 5]), "", r"vLLM aux ids \[2, 3, 5\]: the policy has 4 layers"),
    (E, _eagle3_vllm_ids([3, 2, 1]), "config.json", r"eagle_aux_hidden_state_layer_ids=\[3, 2, 1\], expected "
                                                    "ascending distinct hidden-state ids"),
    (RES, _set("eagle_aux_hidden_state_layer_ids", [1, 2, 9]), "config.json", r"in \[1, 4\] .*the policy has 4"),
    (RES, _set("eagle_aux_hidden_state_layer_ids", [2, 3, 4]), "config.json", "layer 3 is the last of 4"),
    (D, _set("dflash_config.target_layer_ids", [1, 9]), "config.json",
     r"dflash_config.target_layer_ids \(\+ 1\)=\[2, 10\], expected ascending distinct hidden-state ids in \[1, 4\]"),
    (D, _set("dflash_config.target_layer_ids", [2, 1]), "config.json", r"target_layer_ids \(\+ 1\)=\[3, 2\], "
                                                                        "expected ascending"),
    (D, _set("dflash_config.target_layer_ids", [0, 1, 2]), "config.json", r"fc.weight reads 64 = ids x hidden_size"),
    (RDS, _set("aux_hidden_state_layer_ids", [2, 9]), "config.json", r"aux_hidden_state_layer_ids=\[2, 9\], "
                                                                     r"expected ascending distinct .* in \[1, 4\]"),
    (DS, _set("aux_hidden_state_layer_ids", [3, 2]), "config.json", r"aux_hidden_state_layer_ids=\[3, 2\]"),
    (S, _set("aux_hidden_state_layer_ids", [1, 2, 3]), "config.json", "fc.weight reads 64"),
    (RD, _set("num_target_layers", 6), "config.json", "num_target_layers=6, expected the policy's num_hidden_layers 4"),
    # the MASK id
    (D, _set("dflash_config.mask_token_id", V), "config.json", r"dflash_config.mask_token_id=97, expected an id in "
                                                               r"\[0, 97\)"),
    (DS, _set("mask_token_id", -1), "config.json", r"mask_token_id=-1, expected an id in \[0, 97\)"),
    (S, _set("mask_token_id", V), "config.json", r"mask_token_id=97, expected an id in \[0, 97\)"),
    # a missing tensor, a tensor of the wrong shape
    (E, _drop("midlayer.mlp.down_proj.weight"), "", r"weights \['midlayer.mlp.down_proj.weight'\] differ"),
    (ES, _drop("layers.0.mlp.down_proj.weight"), "model.safetensors",
     r"tensor\(s\) \['layers.0.mlp.down_proj.weight'\] missing"),
    (D, _drop("layers.1.self_attn.k_norm.weight"), "model.safetensors",
     r"tensor\(s\) \['layers.1.self_attn.k_norm.weight'\] missing"),
    (S, _drop("hidden_norm.weight"), "model.safetensors", r"tensor\(s\) \['hidden_norm.weight'\] missing"),
    (D, lambda d: _weights(d, lambda sd: sd.update(extra=torch.zeros(2))), "model.safetensors",
     r"tensor\(s\) \['extra'\] are no dflash draft's"),
    (E, _reshape("midlayer.mlp.up_proj.weight", (65, H)), "model.safetensors",
     r"tensor 'midlayer.mlp.up_proj.weight' has shape \(65, 32\), expected \(64, 32\)"),
    (ES, _reshape("layers.0.mlp.up_proj.weight", (65, H)), "model.safetensors",
     r"tensor 'layers.0.mlp.up_proj.weight' has shape \(65, 32\), expected \(64, 32\) from config.json "
     r"\(intermediate_size=64, hidden_size=32\)"),
    (DS, _reshape("layers.1.self_attn.q_norm.weight", (4,)), "model.safetensors",
     r"tensor 'layers.1.self_attn.q_norm.weight' has shape \(4,\), expected \(8,\) from config.json \(head_dim=8\)"),
    (D, _reshape("fc.weight", (H + 1, 2 * H)), "model.safetensors", r"tensor 'fc.weight' has shape \(33, 64\), "
                                                                    r"expected \(32, 64\) from config.json "
                                                                    r"\(hidden_size=32, 2 taps\)"),
    (D, _reshape("fc.weight", (H, 3 * H)), "config.json", r"target_layer_ids \(\+ 1\)=\[2, 3\], expected 3 ids: "
                                                          "fc.weight reads 96"),
    # DSpark's heads
    (S, _reshape("markov_head.markov_w1.weight", (V, 8)), "model.safetensors",
     r"tensor 'markov_head.markov_w1.weight' has shape \(97, 8\), expected \(97, 4\) from config.json "
     r"\(markov_rank=4, vocab_size=97\)"),
    (S, _reshape("markov_head.markov_w2.weight", (V - 1, 4)), "model.safetensors",
     r"tensor 'markov_head.markov_w2.weight' has shape \(96, 4\), expected \(97, 4\)"),
    (S, _reshape("confidence_head.proj.weight", (1, H)), "model.safetensors",
     r"tensor 'confidence_head.proj.weight' has shape \(1, 32\), expected \(1, 36\) from config.json "
     r"\(hidden_size=32, markov_rank=4\)"),
    (S, _set("markov_rank", 8), "model.safetensors", r"'markov_head.markov_w1.weight' has shape \(97, 4\), expected "
                                                     r"\(97, 8\)"),
    # switches at a value cospec does not compute
    (ES, _set("norm_before_residual", True), "config.json", "norm_before_residual=True, expected False"),
    (E, _set("norm_before_residual", True), "", "norm_before_residual=True: the trained draft has False"),
    (S, _set("markov_head_type", "rnn"), "config.json", "markov_head_type='rnn', expected 'vanilla'"),
    (S, _set("enable_confidence_head", False), "config.json", "enable_confidence_head=False, expected True"),
    (DS, _set("sample_from_anchor", True), "config.json", "sample_from_anchor=True, expected False"),
    (DS, _set("transformer_layer_config.hidden_act", "gelu"), "config.json",
     "transformer_layer_config.hidden_act='gelu', expected 'silu'"),
    (D, _set("dflash_config.causal", True), "config.json", "dflash_config.causal=True, expected false"),
    (S, _set("speculators_config.proposal_methods", [{"speculative_tokens": 5}]), "config.json",
     r"proposal_methods\[0\].speculative_tokens=5, expected an integer in \[1, 4\]"),
    (DS, _set("speculators_config.proposal_methods", [{"speculative_tokens": 4}]), "config.json",
     r"speculative_tokens=4, expected an integer in \[1, 3\]"),
]


@pytest.mark.parametrize("cell,damage,file,match", FAULTS,
                         ids=[f"{c}-{m[:40]}" for c, _, _, m in FAULTS])
def test_each_fault_is_named(made, tmp_path, cell, damage, file, match):
    name, sub = cell.split("/", 1)
    folder = Path(os.path.normpath(_copy(made, tmp_path, name) / sub))
    damage(folder)
    message = _refused(folder, match)
    if file:
        assert f"{folder / file}: " in message, message  # check_export (EAGLE-3, vLLM) first names the folder


def test_every_folder_of_the_run_names_its_own_fault(made, tmp_path, capsys):
    """<out>/draft: the formats that pass print their line, the damaged one ends it naming its file."""
    out = _copy(made, tmp_path, "run_dflash")
    spec = out / "draft" / "speculators"
    _set("mask_token_id", V)(spec)
    message = _refused(out / "draft", "mask_token_id=97")
    assert message.startswith(f"{spec / 'config.json'}: ")
    assert capsys.readouterr().out.strip() == (f"{out / 'draft'}: dflash, vllm format (DFlashDraftModel), H=32, block 4"
                                               f", mask 0, 2 layer(s), taps [1, 2] of 4 layers, policy "
                                               f"{out / 'policy'}: ok")
    with pytest.raises(SystemExit) as e:  # through `python -m serving.export`: one line, exit 1
        run_main(export.main, export.__file__, [str(out / "draft")])
    err = capsys.readouterr().err
    assert e.value.code == 1 and err.count("\n") == 1 and err.startswith(f"serving.export: {spec / 'config.json'}")


def test_the_formats_of_a_run_are_one_pair(made, tmp_path):
    out = _copy(made, tmp_path, "run_dflash")
    pair = json.loads((out / "draft" / "speculators" / "servable.json").read_text())
    (out / "draft" / "speculators" / "servable.json").write_text(json.dumps({**pair, "step": 2}))
    _refused(out / "draft" / "speculators", re.escape(f"{out / 'draft' / 'speculators' / 'servable.json'}: missing "
                                                      f"or not {out / 'draft' / 'servable.json'}"))
    out = _copy(made, tmp_path, "run_dspark")
    sd = load_file(str(out / "policy" / "model.safetensors"))
    save_file({k: v + 1 for k, v in sd.items()}, str(out / "policy" / "model.safetensors"))
    _refused(out / "draft", "the draft .step 3. was exported beside another policy")


def test_a_speculators_verifier_folder_is_the_policy(made, tmp_path, capsys):
    """A speculators folder away from its run is checked against the local verifier its config names."""
    _, policy = made
    save_pretrained(policy, str(tmp_path / "base"))
    DFlashDraft.from_target(policy, mask_token_id=0, block_size=4).export(
        str(tmp_path / "d"), dtype=torch.float32, verifier=str(tmp_path / "base"))
    spec = tmp_path / "d" / "speculators"
    assert export.main([str(spec)]) == 0
    assert capsys.readouterr().out.strip().endswith(f"of 4 layers, policy {tmp_path / 'base'}: ok")
    _set("aux_hidden_state_layer_ids", [4, 5])(spec)  # one tap, on layers 3 and 4 of a 4-layer verifier
    _refused(spec, r"aux_hidden_state_layer_ids=\[4, 5\], expected ascending distinct hidden-state ids in \[1, 4\]")


@pytest.mark.parametrize("family", list(FAMILIES))
def test_cospec_checkpoints_are_checked_too(made, tmp_path, capsys, family):
    root, _ = made
    assert export.main([str(root / f"cospec_{family}")]) == 0
    assert f"{family}, cospec format (" in capsys.readouterr().out
    d = _copy(made, tmp_path, f"cospec_{family}")
    _reshape("norm.weight", (H + 1,))(d)
    _refused(d, re.escape(f"{d / 'model.safetensors'}: tensor 'norm.weight' has shape (33,), expected (32,)"))


@pytest.mark.parametrize("target,match", [
    ("missing", "{d}/missing: expected an exported draft folder"),
    ("run_dflash/policy", "{d}/run_dflash/policy/config.json: architectures=['LlamaForCausalLM']: expected a draft's"),
])
def test_not_a_draft(made, target, match):
    _refused(made[0] / target, re.escape(match.format(d=made[0])))


@pytest.mark.parametrize("cospec_fault,match", [
    (_set("num_layers", 0), "num_layers=0: expected >= 1"),
    (_set("tap_layers", [1, 7]), r"tap_layers=\(1, 7\): ids \[7\] out of range"),
    (_set("head_dim", "8"), "head_dim='8': expected an even integer"),
    (lambda d: _config(d, lambda c: c.pop("tap_layers")), r"missing key\(s\) \['tap_layers'\]"),
    (_set("extra", 1), r"unknown key\(s\) \['extra'\]"),
])
def test_a_cospec_checkpoints_fields_are_its_configs(made, tmp_path, cospec_fault, match):
    """cospec's own checkpoint is read as its load reads it: its config dataclass's keys, each value in range."""
    d = _copy(made, tmp_path, "cospec_dspark")
    cospec_fault(d)
    assert f"{d / 'config.json'}: " in _refused(d, match)


# a second policy, so that the table is held to sizes that differ: GQA, head_dim != H / heads, 6 layers, V = 53
ODD = dict(vocab_size=53, hidden_size=24, intermediate_size=40, num_hidden_layers=6, num_attention_heads=3,
           num_key_value_heads=1, head_dim=10, qk_norm=True)
SHAPED = {
    "eagle3": lambda p: Eagle3Draft.from_target(p, tap_layers=(0, 2, 3), intermediate_size=56,
                                                draft_vocab=torch.arange(0, p.cfg.vocab_size, 3)),
    "dflash": lambda p: DFlashDraft.from_target(p, mask_token_id=5, block_size=5, num_layers=3, tap_layers=(1, 3),
                                                intermediate_size=48),
    "dspark": lambda p: DSparkDraft.from_target(p, mask_token_id=1, block_size=3, num_layers=1, markov_rank=3),
}


@pytest.mark.parametrize("family", list(FAMILIES))
@pytest.mark.parametrize("preset", [{}, ODD])
def test_the_shape_table_is_each_drafts_own(made, family, preset):
    """export_checks.expected_tensors, from the config fields alone, gives every tensor of the family's draft with its
    shape; COSPEC_FIELDS is the family's config dataclass ({field: default}, ... for none)."""
    policy = made[1] if not preset else Transformer(ModelConfig.preset("tiny", **preset))
    for make in (FAMILIES[family], SHAPED[family]):
        draft = make(policy)
        want = {k: tuple(v.shape) for k, v in draft.state_dict().items()}
        assert expected_tensors(family, dataclasses.asdict(draft.cfg)) == want
    cls = {"eagle3": DraftConfig, "dflash": DFlashConfig, "dspark": DSparkConfig}[family]
    assert COSPEC_FIELDS[family] == {f.name: ... if f.default is dataclasses.MISSING else f.default
                                     for f in dataclasses.fields(cls)}
