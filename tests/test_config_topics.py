"""The paper's GRPO settings live in one place, rl_loop.GRPOKnobs: train.py's Config takes its fields (flags, types,
defaults, --help comments) from there, --help groups them, and the update's GRPOConfig reads them all. So a new GRPO
setting is a field of GRPOKnobs with its use in rl_loop.py, plus its range in harness/config.CHECKS: two files. ~1 s."""
import ast
import dataclasses
import inspect

from harness.config import CHECKS, Config, parse_args
from harness.flag_groups import GROUPS
from parallel.cli import field_docs
from rl_loop import GRPOConfig, GRPOKnobs

KNOBS = [f.name for f in dataclasses.fields(GRPOKnobs)]


def test_config_declares_no_grpo_knob_itself():
    own = {n.target.id for n in ast.parse(inspect.getsource(Config)).body[0].body if isinstance(n, ast.AnnAssign)}
    assert KNOBS and not own & set(KNOBS), own & set(KNOBS)
    assert set(KNOBS) <= {f.name for f in dataclasses.fields(Config)}


def test_every_knob_has_its_check_its_help_group_and_its_comment():
    comments = dict(c for _, fields in field_docs(Config) for c in fields)
    grouped = [n for _, _, names in GROUPS for n in names]
    for name in KNOBS:
        assert name in CHECKS, f"{name}: no row in config.CHECKS"
        assert grouped.count(name) == 1, f"{name}: in {grouped.count(name)} --help groups"
        assert comments[name], f"{name}: no comment in rl_loop.GRPOKnobs (--help shows it)"


def test_the_update_reads_every_knob_from_the_command_line():
    cfg = parse_args(["--eps_low=0.1", "--eps_high=0.3", "--beta=0.02", "--std_norm=false", "--loss_norm=seq-mean"])
    grpo = GRPOConfig.of(cfg, max_len=16, temperature=0.7)
    assert {k: getattr(grpo, k) for k in KNOBS} == {"eps_low": 0.1, "eps_high": 0.3, "beta": 0.02, "std_norm": False,
                                                    "loss_norm": "seq-mean"}
    assert (grpo.max_len, grpo.temperature) == (16, 0.7)
