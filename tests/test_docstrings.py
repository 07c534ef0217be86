"""Docstring examples that still run: every import a module docstring shows resolves, and every command it shows names
a file or module that exists. A docstring is the first thing a reader runs; an example that fails teaches them that
the text is stale. Checked over the root files and every folder of the machinery (not tests/, bench/, docs/).
~2 s (one import per distinct example).

Checked forms, anywhere in a module docstring:
    from M import a, b          (alone, or inside python -c "...")  -> M imports and has a, b
    import M                                                         -> M imports
    python path.py / torchrun ... path.py / pytest ... tests/x.py     -> the file exists
    python -m M                                                      -> M is a module of the checkout
Examples of other packages (`python -m pytest`, `from vllm import LLM`) are theirs to keep, and not checked here.
"""
import ast
import importlib
import os
import re

import pytest

from test_layout import ROOT, project_modules

FROM = re.compile(r"\bfrom\s+([\w.]+)\s+import\s+([\w, ]+)")
IMPORT = re.compile(r"(?:^|;|\")\s*import\s+([\w.]+)")
FILE = re.compile(r"(?:\bpython3?|\btorchrun\b[^#\n]*?|\bpytest\b[^#\n]*?)\s+((?:[\w./-]+/)?[\w-]+\.py)\b")
MODULE = re.compile(r"\bpython3?\s+-m\s+([\w.]+)")
OURS = {name.split(".")[0] for name in project_modules()}  # examples of other packages (torch, vllm, venv) are theirs


def docstrings():
    """(module name, docstring) of every project module that has one."""
    for name, path in sorted(project_modules().items()):
        with open(path) as f:
            doc = ast.get_docstring(ast.parse(f.read()))
        if doc:
            yield name, doc


def examples():
    """(module, kind, target) for every example the docstrings show."""
    out = []
    for name, doc in docstrings():
        for line in doc.splitlines():
            for mod, names in FROM.findall(line):
                if mod.split(".")[0] in OURS:
                    out.append((name, "from", (mod, tuple(n.strip() for n in names.split(",") if n.strip()))))
            for mod in IMPORT.findall(line):
                if mod.split(".")[0] in OURS:
                    out.append((name, "import", (mod, ())))
            for path in FILE.findall(line):
                out.append((name, "file", path))
            for mod in MODULE.findall(line):
                if mod.split(".")[0] in OURS:
                    out.append((name, "module", mod))
    return out


def test_some_examples_are_found():
    kinds = {kind for _, kind, _ in examples()}
    assert {"from", "file", "module"} <= kinds, kinds  # the patterns still match the house's docstrings


@pytest.mark.parametrize("where,kind,target", examples(), ids=lambda x: str(x)[:60])
def test_docstring_example(where, kind, target):
    if kind in ("from", "import"):
        mod, names = target
        m = importlib.import_module(mod)
        missing = [n for n in names if not hasattr(m, n)]
        assert not missing, f"{where}'s docstring imports {missing} from {mod}, which has no such name"
    elif kind == "file":
        assert os.path.isfile(os.path.join(ROOT, target)), f"{where}'s docstring runs {target}, which does not exist"
    else:
        assert target in project_modules(), f"{where}'s docstring runs `python -m {target}`, no such module here"
