"""A draft family is one file (and its training helpers) plus one registry row: no other code names it.

The names are the registry's (harness/drafters.FAMILIES: eagle3, dflash, dspark) and their classes' (Eagle3Draft,
DFlashDraft, DSparkDraft). The scan reads every non-test Python file of the project (test_layout.project_modules:
the root and its folders; tests/ are checks that name families on purpose and bench/ measurement scripts that take
them as run arguments, both left out) and fails where code names a family outside

  - the registry, harness/drafters.py;
  - the family's own files (OWN): its class's file and the training it alone uses -- EAGLE-3: draft.py, draft_ttt.py,
    draft_loss.py; DFlash: draft_dflash.py, draft_block.py (the block training DSpark shares); DSpark: draft_dspark.py.
    A family's files may name the families its class is built on (DSparkDraft subclasses DFlashDraft);
  - serving/, the formats (FORMATS): the field's (vLLM's, z-lab's, speculators') and cospec's own checkpoint. A
    format's vocabulary names the families -- speculators' `speculators_model_type` values, vLLM's speculative
    `method` names, `dflash_config`, the built-in families' save() architectures and config fields -- so a family
    that is to be exported in those formats adds its entries there. --draft reloads any registered family's own
    checkpoint through the registry (docs/EXTENDING.md's fourth family needs no entry).
  - a file's demo (its `if __name__ == "__main__":` block) may pick one family to show: no code path runs it.

"Code" is what runs: string constants other than docstrings (f-strings' literal parts too), identifiers, attribute
and keyword names, and module paths of imports. Docstrings and comments are prose: they may cite the built-in
families (e.g. Config's field comments, which --help shows, say which flags the block families read). ~1 s (parsing
~150 files).
"""
import ast
import inspect
import os
import re

from harness.drafters import FAMILIES
from test_layout import ROOT, project_modules

OWN = {"eagle3": ("draft.py", "draft_ttt.py", "draft_loss.py"), "dflash": ("draft_dflash.py", "draft_block.py"),
       "dspark": ("draft_dspark.py",)}
REGISTRY = "harness/drafters.py"
FORMATS = "serving/"

def family_names() -> dict:
    """name -> the words that name it: the registry's name and its class's name."""
    return {name: (name, f.cls.__name__) for name, f in FAMILIES.items()}


def pattern(words) -> re.Pattern:
    """A family word inside a string or identifier: a lowercase registry name between non-alphanumerics ('_' splits:
    draft_dflash, dflash_config), a class name as a whole word (not the format name Eagle3DraftModel)."""
    lower = "|".join(w for w in words if w.islower())
    cls = "|".join(w for w in words if not w.islower())
    return re.compile(rf"(?<![A-Za-z0-9])(?:{lower})(?![A-Za-z0-9])|(?<![A-Za-z0-9_])(?:{cls})(?![A-Za-z0-9_])")


def code_words(tree) -> list:
    """(line, text) of every string constant but docstrings, identifier, attribute, keyword and module path."""
    docs = {id(n.body[0].value) for n in ast.walk(tree)
            if isinstance(n, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and n.body
            and isinstance(n.body[0], ast.Expr) and isinstance(n.body[0].value, ast.Constant)}
    out = []
    for n in ast.walk(tree):
        if isinstance(n, ast.Constant) and isinstance(n.value, str) and id(n) not in docs:
            out.append((n.lineno, n.value))
        elif isinstance(n, ast.Name):
            out.append((n.lineno, n.id))
        elif isinstance(n, ast.Attribute):
            out.append((n.lineno, n.attr))
        elif isinstance(n, ast.alias):
            out.append((n.lineno, f"{n.name} {n.asname or ''}"))
        elif isinstance(n, ast.ImportFrom):
            out.append((n.lineno, n.module or ""))
        elif isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            out.append((n.lineno, n.name))
        elif isinstance(n, ast.arg):
            out.append((n.lineno, n.arg))
        elif isinstance(n, ast.keyword) and n.arg:
            out.append((n.lineno, n.arg))
    return out


def allowed(rel: str) -> set:
    """The families file `rel` may name: all in the registry; a family's own files its own and its bases'."""
    if rel == REGISTRY:
        return set(FAMILIES)
    mine = {name for name, files in OWN.items() if rel in files}
    return {base for name in mine for base, f in FAMILIES.items() if issubclass(FAMILIES[name].cls, f.cls)}


def _is_main(node) -> bool:
    """`if __name__ == "__main__":` at a module's top level."""
    return (isinstance(node, ast.If) and isinstance(node.test, ast.Compare) and isinstance(node.test.left, ast.Name)
            and node.test.left.id == "__name__")


def naming_lines() -> list:
    """(file, line number, the line's text, the families it names) outside where they may be named."""
    names = family_names()
    found = []
    for path in sorted(project_modules().values()):
        rel = os.path.relpath(path, ROOT).replace(os.sep, "/")
        ok = allowed(rel)
        pats = {name: pattern(words) for name, words in names.items() if name not in ok}
        if not pats:
            continue
        src = open(path, encoding="utf-8").read()
        lines = src.splitlines()
        hits = {}
        tree = ast.parse(src)
        demo = {n for node in tree.body if _is_main(node) for n in range(node.lineno, node.end_lineno + 1)}
        for line, text in code_words(tree):
            if line in demo:
                continue
            for name, pat in pats.items():
                if pat.search(text):
                    hits.setdefault(line, set()).add(name)
        found += [(rel, line, lines[line - 1].strip(), fams) for line, fams in sorted(hits.items())]
    return found


def test_every_family_has_its_files_and_its_class_is_in_them():
    assert set(OWN) == set(FAMILIES), "a registered family needs its files in OWN"
    for name, files in OWN.items():
        assert os.path.relpath(inspect.getfile(FAMILIES[name].cls), ROOT) in files, name
        assert all(os.path.isfile(os.path.join(ROOT, f)) for f in files), files


def test_no_code_names_a_family_outside_its_files_and_the_registry():
    bad = [f"{rel}:{line} {text}  ({', '.join(sorted(fams))})" for rel, line, text, fams in naming_lines()
           if not rel.startswith(FORMATS)]
    assert not bad, "code that names a draft family (ask the family through drafter.FAMILY instead):\n" + "\n".join(bad)


def test_the_scan_finds_a_name(tmp_path, monkeypatch):
    """The control: a line that names a family in code, outside its files, is found (a demo block's is not)."""
    import test_family_names as me
    bad = tmp_path / "stray.py"
    bad.write_text('"""Doc: eagle3 here is prose."""\nX = "dflash"\nif __name__ == "__main__":\n    Y = "dspark"\n')
    monkeypatch.setattr(me, "project_modules", lambda: {"stray": str(bad)})
    monkeypatch.setattr(me, "ROOT", str(tmp_path))
    assert [(rel, line, fams) for rel, line, _, fams in me.naming_lines()] == [("stray.py", 2, {"dflash"})]
