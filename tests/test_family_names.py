"""A draft family is one file (and its training helpers) plus one registry row: no other code names it.

The names are the registry's (harness/drafters.FAMILIES: eagle3, dflash, dspark) and their classes' (Eagle3Draft,
DFlashDraft, DSparkDraft). The scan reads every non-test Python file of the project (test_layout.project_modules:
the root and its folders; tests/ are checks that name families on purpose and bench/ measurement scripts that take
them as run arguments, both left out) and fails where code names a family outside

  - the registry, harness/drafters.py;
  - the family's own files (OWN): its class's file and the training it alone uses -- EAGLE-3: draft.py, draft_ttt.py,
    draft_loss.py; DFlash: draft_dflash.py, draft_block.py (the block training DSpark shares); DSpark: draft_dspark.py.
    A family's files may name the families its class is built on (DSparkDraft subclasses DFlashDraft);
  - serving/, the field's formats (FORMATS): a format file may use a name only as that format's own vocabulary --
    speculators' `speculators_model_type` values ("eagle3", "dflash", "dspark") and the fields and layer types that
    follow from them, vLLM's speculative `method` names, vLLM's / z-lab's `dflash_config`, and the format writers
    named after the format they write (export_dflash, eagle3_config). A serving line that keys cospec's OWN
    vocabulary on a family name (our save() names, our config.json's fields, a branch of the "cospec" format) is
    not a format's: each such line is in PENDING until the family is asked instead.

"Code" is what runs: string constants other than docstrings (f-strings' literal parts too), identifiers, attribute
and keyword names, and module paths of imports. Docstrings and comments are prose: they may cite the built-in
families (e.g. Config's field comments, which --help shows, say which flags the block families read).

PENDING is temporary: the places, in files other sessions own, that still name a family, as (file, the line's text).
The lead empties it as those files ask the family instead; an entry that no longer occurs fails the test, so the
list only shrinks. ~1 s (parsing ~150 files).
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

PENDING = {  # (file, text of the line) -> why it still names a family
    ("speculative.py", "from draft import Eagle3Draft"): "the __main__ demo builds an EAGLE-3 draft",
    ("speculative.py", "draft = Eagle3Draft.from_target(target)"): "the __main__ demo",
    ("harness/cache_keys.py", 'drafter: str = "eagle3"  # the draft family (harness/drafters.py)'):
        "the warm-up key's default family: drafters.DEFAULT",
    ("harness/flag_groups.py", '("block drafters (--drafter=dflash | dspark)", True,'):
        "the --help group's title: the block families' names from the registry",
    ("serving/formats.py", 'COSPEC_ARCH = {"Eagle3DraftModel": "eagle3", "CospecDFlashDraft": "dflash", '
                           '"CospecDSparkDraft": "dspark"}  # save()'):
        "cospec's own save() names: the registry's classes' architecture (drafters.by_architecture)",
    ("serving/export_checks.py", 'COSPEC_FIELDS = {"eagle3": {**_LAYER, "draft_vocab_size": None, **_TAIL},'):
        "cospec's own config.json fields by family: the family's config_class",
    ("serving/export_checks.py", '"dflash": {**_LAYER, "mask_token_id": ..., "block_size": 8, "num_layers": 1, '
                                 '**_TAIL}}'): "the same table",
    ("serving/export_checks.py", 'COSPEC_FIELDS["dspark"] = {**COSPEC_FIELDS["dflash"], "markov_rank": 16, '
                                 '"confidence_threshold": 0.0}'): "the same table",
    ("serving/export_checks.py", 'tolerated = () if fmt == "cospec" else IGNORED if family == "eagle3" else '
                                 'BLOCK_IGNORED'): "a cospec-format branch keyed on the family",
}


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
        for line, text in code_words(ast.parse(src)):
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
    pending = set(PENDING)
    bad = [f"{rel}:{line} {text}  ({', '.join(sorted(fams))})" for rel, line, text, fams in naming_lines()
           if (rel, text) not in pending and not rel.startswith(FORMATS)]
    assert not bad, "code that names a draft family (ask the family through drafter.FAMILY instead):\n" + "\n".join(bad)


def test_pending_only_shrinks():
    """Each PENDING entry still names a family where it says (a fixed one is taken off the list)."""
    seen = {(rel, text) for rel, _, text, _ in naming_lines()}
    gone = [k for k in PENDING if k not in seen]
    assert not gone, f"no longer naming a family (remove from PENDING): {gone}"
