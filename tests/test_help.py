"""Every entry point answers -h / --help and exits 0 without running: train.py's --help shows the paper's flags by
topic and names the rest, its --help_all lists every Config field, each in one group, with its default, its check and
its comment; each benchmark (bench/*.py) and each module with a `__main__` block prints a usage line and what it
does. The entry points run in ONE fresh interpreter (each file executed as `__main__` with
`--help`, so the imports are paid once and nothing leaks into this process): ~7 s in all on 2 shared cores.
"""
import ast
import dataclasses
import json
import os
import subprocess
import sys
from dataclasses import dataclass

import pytest

from harness.config import CHECKS, PRESETS, Config, help_text, parse_args
from harness.flag_groups import GROUPS
from parallel.cli import commands, field_docs, show_value, summary
from test_layout import ROOT, project_modules

def has_main(path: str) -> bool:
    """A top-level `if __name__ == "__main__":` statement (not the phrase in a docstring)."""
    return any(isinstance(n, ast.If) and ast.unparse(n.test) in ("__name__ == '__main__'", "'__main__' == __name__")
               for n in ast.parse(open(path, encoding="utf-8").read()).body)


def entry_points() -> list:
    """Paths (relative to the root) of every benchmark and every project file with a `__main__` block."""
    bench = [os.path.join("bench", f) for f in sorted(os.listdir(os.path.join(ROOT, "bench"))) if f.endswith(".py")]
    mods = [os.path.relpath(p, ROOT) for p in sorted(project_modules().values()) if has_main(p)]
    return ["train.py"] + [p for p in bench + mods if p != "train.py"]


ENTRY_POINTS = entry_points()


def test_train_help_all_lists_every_field_with_its_default_check_and_comment(capsys):
    with pytest.raises(SystemExit) as e:
        parse_args(["--steps=3", "--help_all"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert out == help_text() + "\n"
    lines = out.splitlines()
    defaults = dataclasses.asdict(Config())
    for name, default in defaults.items():
        i = next((i for i, ln in enumerate(lines) if ln.split()[:1] == [f"--{name}"]), None)
        assert i is not None, f"--{name} missing from --help"
        entry = " ".join(lines[i:i + 2])  # a long flag name puts its facts on the next line
        assert f"default: {show_value(default)}" in entry, (name, entry)
        assert f"expected: {CHECKS[name][1].format(**defaults)}" in entry, (name, entry)
    for name, comment in (f for _, fields in field_docs(Config) for f in fields):
        assert not comment or comment in out, name
    assert "one of auto, cpu, cuda" in out and "expected: >= 0 (0 = never)" in out  # a choice, a range
    assert all(f"  {p} " in out for p in PRESETS)


def test_every_flag_belongs_to_exactly_one_group_the_papers_first():
    """flag_groups.GROUPS against the Config fields: a new field not placed in a group fails here, by name."""
    named = [n for _, _, names in GROUPS for n in names]
    fields = [f.name for f in dataclasses.fields(Config)]
    assert not set(fields) - set(named), f"fields in no group (harness/flag_groups.py): {set(fields) - set(named)}"
    assert not set(named) - set(fields), f"groups name what Config lacks: {set(named) - set(fields)}"
    assert len(named) == len(set(named)), f"in two groups: {[n for n in set(named) if named.count(n) > 1]}"
    mains = [main for _, main, _ in GROUPS]
    assert mains == sorted(mains, reverse=True) and True in mains and False in mains  # the main groups lead
    assert {"drafter", "ttt_passes", "num_draft_tokens", "pp", "cp"} <= {n for _, m, ns in GROUPS if m for n in ns}


def test_train_help_is_brief_the_papers_knobs_with_defaults_the_rest_by_name(capsys):
    with pytest.raises(SystemExit) as e:
        parse_args(["--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert out == help_text(brief=True) + "\n" and "--help_all" in out
    lines, full = out.splitlines(), help_text().splitlines()
    assert len(lines) < len(full) / 2 and max(map(len, lines)) <= 120, (len(lines), len(full))
    shown = {ln.split()[0]: i for i, ln in reversed(list(enumerate(lines))) if ln.startswith("  --")}
    words = set(out.split())
    for title, main, names in GROUPS:
        assert title.split(":")[0].split("(")[0].strip() in out, title
        for name in names:  # every flag appears: a main group's with its default, the others by name
            default = show_value(getattr(Config(), name))
            assert (f"--{name}={default}" in shown) if main else (f"--{name}" in words), name
    order = [shown[f"--{n}={show_value(getattr(Config(), n))}"] for n in GROUPS[0][2]]
    assert order == sorted(order) and min(shown.values()) == order[0]  # the paper's group comes first


def test_dash_h_too_and_only_rank_0_prints(capsys, monkeypatch):
    with pytest.raises(SystemExit) as e:
        parse_args(["-h"])
    assert e.value.code == 0 and capsys.readouterr().out.startswith("usage")
    monkeypatch.setenv("RANK", "1")
    with pytest.raises(SystemExit) as e:
        parse_args(["--help"])
    assert e.value.code == 0 and capsys.readouterr().out == ""


@dataclass
class _Toy:
    a: int = 1  # the first
    b: str = "x # y"
    # section one,
    # on two lines
    c: float = 2.0  # the third: '#' in a comment

    def m(self):  # a method is not a field
        return self.a


def test_field_comments_come_from_the_source():
    assert field_docs(_Toy) == [("", [("a", "the first"), ("b", "")]),
                                ("section one, on two lines", [("c", "the third: '#' in a comment")])]


def test_commands_and_summary_come_from_the_docstring():
    doc = """What it does,
    on two lines.

    More.

        python -m pkg.demo ARG     # runs it
                                   # (slowly)
        python other.py            # not this file
        TRITON_INTERPRET=1 python -m pkg.demo
    """
    assert summary(doc) == "What it does,\n    on two lines."
    assert commands(doc, "/x/pkg/demo.py") == ["python -m pkg.demo ARG     # runs it",
                                               "                           # (slowly)",
                                               "TRITON_INTERPRET=1 python -m pkg.demo"]
    assert commands(doc, "/x/none.py") == ["python -m pkg.demo ARG     # runs it",
                                           "                           # (slowly)",
                                           "python other.py            # not this file",
                                           "TRITON_INTERPRET=1 python -m pkg.demo"]


_DRIVER = """
import contextlib, io, json, os, runpy, sys
sys.path.insert(0, os.getcwd())
res = {}
for path in sys.argv[1:]:
    out, code = io.StringIO(), "returned"
    sys.argv = [path, "--help"]
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
            runpy.run_path(path, run_name="__main__")
    except SystemExit as e:
        code = e.code
    except BaseException as e:
        code = f"{type(e).__name__}: {e}"
    res[path] = [code, out.getvalue()]
print(json.dumps(res))
"""


@pytest.fixture(scope="module")
def helped():
    """path -> (exit code, output) of `python PATH --help` for every entry point, in one interpreter."""
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")}
    r = subprocess.run([sys.executable, "-c", _DRIVER, *ENTRY_POINTS], cwd=ROOT, env=env, capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.splitlines()[-1])


@pytest.mark.parametrize("path", ENTRY_POINTS)
def test_every_entry_point_answers_help_without_running(helped, path):
    code, out = helped[path]
    assert code in (0, None), f"{path} --help: exit {code!r}\n{out[-2000:]}"
    assert out.startswith("usage"), f"{path} --help printed something before its usage:\n{out[:2000]}"
    doc = open(os.path.join(ROOT, path)).read()
    first = summary(ast.get_docstring(ast.parse(doc))).splitlines()[0]
    assert first.strip() in out, f"{path} --help: no summary"


def test_attn_backend_default_resolves_per_device():  # adds < 0.1 s
    """--attn_backend=auto (the default): the fused Triton kernel where the models run on CUDA, the torch reference on
    the CPU; an explicit choice is kept where the device can run it; --help says so."""
    import importlib.util
    cfg = Config()
    assert cfg.attn_backend == "auto" and cfg.attn_backend_on("cpu") == "torch"
    assert cfg.attn_backend_on("cuda:0") == ("triton" if importlib.util.find_spec("triton") else "torch")
    assert Config(attn_backend="torch").attn_backend_on("cuda") == "torch"
    with pytest.raises(ValueError, match="--attn_backend=flash with the models on cpu: needs a CUDA device"):
        Config(attn_backend="flash").attn_backend_on("cpu")  # tests/test_startup_checks.py: what each backend needs
    assert "CUDA: fused triton; CPU: torch" in help_text()
