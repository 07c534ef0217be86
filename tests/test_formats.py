"""--draft PATH in every format the field publishes (harness/draft_formats.py, serving/formats.py): each family in each
of its formats loads back to the same draft and the same logits; a file that does not fit the policy is refused in
one line naming the field; a run starts from each cell with no warm-up, its control arms from the loaded draft.
~35 s on 2 cores (one SFT warm-up of the test preset, then 5 builds from its cache)."""
import json
import os

import pytest
import torch

from draft import Eagle3Draft
from harness.config import parse_args
from model import ModelConfig, Transformer
from serving import speculators_format as spec
from harness.draft_formats import load_draft
from serving.export import write_export
from serving.formats import detect, draft_fields
from format_cases import CELLS, FAMILIES

pytestmark = pytest.mark.usefixtures("one_thread")

SAVED = [("eagle3", "cospec", "."), ("dflash", "cospec", "."), ("dspark", "cospec", ".")]  # draft.save()


def _policy():
    torch.manual_seed(0)
    return Transformer(ModelConfig.preset("tiny", qk_norm=True)).eval()


def _draft(family, policy, seed=1):
    d = FAMILIES[family](policy)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():  # every weight off its init, so a swapped or dropped tensor shows
        for p in d.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=g, dtype=p.dtype))
    return d


def _logits(d, policy):
    """The draft's logits on fixed taps: EAGLE-3's first TTT pass; a block draft's slots on two anchors."""
    g = torch.Generator().manual_seed(3)
    T, H = 12, policy.cfg.hidden_size
    taps = {t: torch.randn(T, H, generator=g) for t in d.tap_layers}
    tokens = torch.randint(3, policy.cfg.vocab_size, (T,), generator=g)
    cu = torch.tensor([0, T])
    if isinstance(d, Eagle3Draft):
        return d.logits(d.ttt_forward(taps, tokens, cu, num_passes=2)[-1])
    h = d.block_forward(taps, tokens, cu, torch.tensor([3, 7]))[0]
    return d.logits(h)


@pytest.mark.parametrize("family,fmt,sub", CELLS + SAVED)
def test_every_cell_loads_back_the_same_draft(tmp_path, family, fmt, sub):
    policy = _policy()
    d = _draft(family, policy)
    d.save(str(tmp_path / "d")) if fmt == "cospec" else d.export(str(tmp_path / "d"), dtype=torch.float32)
    path = str(tmp_path / "d" / sub)
    assert detect(path) == (family, fmt)
    back = load_draft(path, policy, drafter=family)
    assert type(back) is type(d) and back.cfg == d.cfg
    want = d.state_dict()
    for k, v in back.state_dict().items():
        assert torch.equal(v, want[k]), k
    assert torch.equal(_logits(back, policy), _logits(d, policy))
    if fmt != "cospec":
        listing = json.loads((tmp_path / "d" / "formats.json").read_text())
        assert listing[fmt] == sub  # <out>/draft says which formats it holds, and where


def test_drafter_must_agree_with_the_file(tmp_path):
    policy = _policy()
    _draft("dflash", policy).export(str(tmp_path / "d"))
    with pytest.raises(ValueError, match=r"--drafter eagle3: .* holds a dflash draft \(vllm format\); pass "
                                         r"--drafter dflash or leave --drafter out"):
        load_draft(str(tmp_path / "d"), policy, drafter="eagle3")


def _speculators(tmp_path, family, policy):
    d = _draft(family, policy)
    cfg, sd = spec.from_cospec(d, family, dtype=torch.float32)
    return cfg, sd


def _edit(cfg, dotted, value):
    c = json.loads(json.dumps(cfg))
    *path, last = dotted.split(".")
    target = c
    for k in path:
        target = target[k]
    target[last] = value
    return c


# (family, field, value, what the error names): every field the draft takes from the policy, and the switches
MISFITS = [
    ("dflash", "transformer_layer_config.hidden_size", 48, "transformer_layer_config.hidden_size=48, expected the "
                                                           "policy's hidden_size 32"),
    ("dflash", "transformer_layer_config.vocab_size", 50, "vocab_size=50, expected the policy's vocab_size"),
    ("dflash", "draft_vocab_size", 50, "draft_vocab_size=50, expected the policy's vocab_size"),
    ("dflash", "aux_hidden_state_layer_ids", [0, 1], r"aux_hidden_state_layer_ids=\[0, 1\], expected ascending"),
    ("dflash", "aux_hidden_state_layer_ids", [1, 9], r"in \[1, 4\]"),
    ("dflash", "aux_hidden_state_layer_ids", [1, 2, 3], "fc.weight reads"),
    ("dflash", "mask_token_id", 10_000, r"mask_token_id=10000, expected an id in \[0,"),
    ("dflash", "block_size", 65, r"block_size=65, expected in \[2, 64\]"),
    ("dflash", "transformer_layer_config.num_attention_heads", 8, "num_attention_heads=8, expected heads x head_dim"),
    ("dflash", "transformer_layer_config.num_key_value_heads", 1, "num_key_value_heads=1, expected kv heads"),
    ("dflash", "sample_from_anchor", True, "sample_from_anchor=True, expected False"),
    ("dflash", "transformer_layer_config.model_type", "llama", "model_type='llama', expected 'qwen3'"),
    ("dflash", "transformer_layer_config.layer_types", ["sliding_attention", "full_attention"], "layer_types"),
    ("dspark", "markov_head_type", "rnn", "markov_head_type='rnn', expected 'vanilla'"),
    ("dspark", "confidence_head_with_markov", False, "confidence_head_with_markov=False"),
    ("dspark", "sample_from_anchor", False, "sample_from_anchor=False, expected True"),
    ("eagle3", "norm_before_residual", True, "norm_before_residual=True, expected False"),
    ("eagle3", "transformer_layer_config.model_type", "qwen3", "model_type='qwen3', expected 'llama'"),
    ("eagle3", "draft_vocab_size", 100, r"draft_vocab_size=100, expected in \[1, the policy's vocab_size"),
    ("eagle3", "eagle_aux_hidden_state_layer_ids", [1, 2, 2], "eagle_aux_hidden_state_layer_ids=.*ascending distinct"),
    ("eagle3", "speculators_model_type", "mtp", r"speculators_model_type='mtp': cospec trains"),
    ("eagle3", "eagle_aux_hidden_state_layer_ids", [2, 3, 4], "taps do not fit the 4-layer policy: .*last of 4"),
]


@pytest.mark.parametrize("family,field,value,match", MISFITS)
def test_a_misfit_is_refused_naming_the_field(tmp_path, family, field, value, match):
    policy = _policy()
    cfg, sd = _speculators(tmp_path, family, policy)
    write_export(str(tmp_path / "d"), _edit(cfg, field, value), sd)
    with pytest.raises(ValueError, match=match) as e:
        load_draft(str(tmp_path / "d"), policy)
    assert "\n" not in str(e.value)


def test_eagle3_reduced_vocab_needs_its_maps(tmp_path):
    policy = _policy()
    cfg, sd = _speculators(tmp_path, "eagle3", policy)
    write_export(str(tmp_path / "d"), cfg, {k: v for k, v in sd.items() if k != "d2t"})
    with pytest.raises(ValueError, match="draft_vocab_size=.*expected a full vocabulary, or d2t and t2d"):
        load_draft(str(tmp_path / "d"), policy)


def test_zlab_field_names_in_its_errors(tmp_path):
    policy = _policy()
    _draft("dflash", policy).export(str(tmp_path / "d"), dtype=torch.float32)
    c = json.loads((tmp_path / "d" / "config.json").read_text())
    c["dflash_config"]["target_layer_ids"] = [3, 1]
    (tmp_path / "d" / "config.json").write_text(json.dumps(c))
    with pytest.raises(ValueError, match=r"dflash_config.target_layer_ids \(\+ 1\)=\[4, 2\], expected ascending"):
        load_draft(str(tmp_path / "d"), policy)


def test_config_takes_the_block_fields_from_the_draft(tmp_path):
    policy = _policy()
    _draft("dspark", policy).export(str(tmp_path / "d"))
    assert draft_fields(str(tmp_path / "d"))["block_size"] == 4
    cfg = parse_args(["--preset=test", f"--draft={tmp_path / 'd'}", "--num_draft_tokens=3"])
    assert (cfg.drafter, cfg.block_size, cfg.mask_token_id, cfg.draft_layers, cfg.markov_rank) == \
        ("dspark", 4, 0, 2, 4)
    with pytest.raises(ValueError, match="--block_size=6: --draft .* has block_size=4; leave --block_size out"):
        parse_args(["--preset=test", f"--draft={tmp_path / 'd'}", "--block_size=6"])
    with pytest.raises(ValueError, match="--drafter dflash: --draft .* holds a dspark draft"):
        parse_args(["--preset=test", f"--draft={tmp_path / 'd'}", "--drafter=dflash"])


def test_a_run_starts_from_each_cell(tmp_path):
    """build() from every (family, format): no warm-up, every arm starts at the loaded weights."""
    from harness.experiment import build
    from harness.mesh import make_mesh
    quiet = lambda *a, **k: None  # noqa: E731
    base = ["--preset=test", f"--cache_dir={tmp_path / 'cache'}", "--draft_warmup_steps=0", "--num_draft_tokens=3"]
    cfg = parse_args(base + [f"--out={tmp_path / 'o'}"])
    policy = build(cfg, make_mesh(cfg), log=quiet).policy
    for family, fmt, sub in CELLS:
        d = _draft(family, policy)
        d.export(str(tmp_path / family), dtype=torch.float32)
        cfg = parse_args(base + [f"--out={tmp_path / 'o'}", f"--draft={tmp_path / family / sub}"])
        assert cfg.drafter == family
        s = build(cfg, make_mesh(cfg), log=quiet)
        assert s.warm_info["draft_cached"] is None
        want = d.state_dict()
        for arm, got in (("cotrained", s.drafts["cotrained"].draft), ("frozen", s.frozen),
                         ("offline", s.offline.draft if s.offline else None)):
            if got is not None:
                assert all(torch.equal(v, want[k].to(v.dtype)) for k, v in got.state_dict().items()), (family, arm)


def test_the_architecture_table_is_each_drafts_own(tmp_path):
    """serving/formats.COSPEC_ARCH (serving may not import the drafts) names what each family's save() writes."""
    from serving.formats import COSPEC_ARCH
    policy = _policy()
    for family, make in FAMILIES.items():
        make(policy).save(str(tmp_path / family))
        arch = json.loads((tmp_path / family / "config.json").read_text())["architectures"][0]
        assert COSPEC_ARCH[arch] == family and detect(str(tmp_path / family)) == (family, "cospec")


def test_an_unreadable_config_is_one_line(tmp_path):
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match=r"config.json: not a readable JSON file \(JSONDecodeError"):
        parse_args(["--preset=test", f"--draft={tmp_path}"])
