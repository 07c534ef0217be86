"""`--help` for every entry point, generated from what the code already says: a module's docstring (what it does and
its commands) and a config dataclass's field comments (what each flag means), so the help text cannot drift.

    answer_help(__doc__, __file__)         a demo without flags: on -h / --help print usage + summary, exit 0
    parser(__doc__, __file__)              an argparse.ArgumentParser whose --help shows the same summary and commands
    flags_help(Config, expect)             one entry per dataclass field: default, what is expected, its comment
    grouped_help(Config, groups, expect)   the same by topic; brief=True: the main groups' flags in one line each,
                                           the rest by name (--help; --help_all is the full form)
    show_value(v)                          a value as it is typed on the command line: true, '', 2,2,1
    print_help(text)                       print on rank 0 only (under torchrun every rank parses the same argv)
    run_main(main, __file__, argv)         an entry point's end: an error is one line naming what was wrong, exit 1
    writing(path)                          a storage error inside (a full disk, SafetensorError too) names `path`
    read_json(path)                        a JSON object from a file; a bad file is a ValueError naming it

The docstring's commands are its indented lines that start with `python`, `torchrun` or `VAR=value python` and name
the file itself; its summary is its first paragraph. A field's meaning is the `# ...` comment on its line; a block of
whole-line comments between fields opens a section.

Errors. Every entry point ends through run_main: bad input, a full disk, a NaN loss or a dead peer prints one line
`<prog>: <what was wrong>` to stderr and exits 1; Ctrl-C prints one line (main may say where to resume: the message of
the KeyboardInterrupt it raises) and exits 130. COSPEC_TRACEBACK=1 in the environment shows the traceback instead.
"""
from __future__ import annotations

import argparse
import ast
import contextlib
import dataclasses
import errno
import inspect
import io
import json
import os
import re
import sys
import textwrap
import tokenize

from safetensors import SafetensorError

from parallel.waits import WaitFailed

HELP_FLAGS = ("-h", "--help")
HELP_ALL = "--help_all"  # every flag in full where --help is brief (train.py's Config)
TRACEBACK = "COSPEC_TRACEBACK"  # =1: an entry point's error shows its traceback, not one line
# what a user can cause and fix: the message is the whole story (anything else is a bug: its type is shown too)
USER_ERRORS = (ValueError, OSError, FloatingPointError, ImportError, MemoryError, SafetensorError, WaitFailed)
_COMMAND = re.compile(r"^(?:[A-Z_][A-Z0-9_]*=\S+\s+)*(?:python|torchrun)\s")


def wants_help(argv) -> bool:
    return any(a in HELP_FLAGS for a in argv)


def print_help(text: str) -> None:
    """Print `text` on rank 0 (RANK unset: a plain process is rank 0)."""
    if os.environ.get("RANK", "0") == "0":
        print(text)


def commands(doc: str, file: str) -> list:
    """The docstring's command lines that run `file` (all of them when none names it), as written: comments and their
    continuation lines (a line holding only a comment right below) too."""
    stem = os.path.splitext(os.path.basename(file))[0]
    own, every, last = [], [], None
    for ln in (doc or "").splitlines():
        text = ln.strip()
        if ln[:1].isspace() and _COMMAND.match(text):
            indent = len(ln) - len(ln.lstrip())
            last = [ln[indent:].rstrip()]
            every.append(last)
            if re.search(rf"(?<!\w){re.escape(stem)}(?:\.py)?\b", text.split("#")[0]):
                own.append(last)
        elif last is not None and text.startswith("#") and ln[:indent].isspace():
            last.append(ln[indent:].rstrip())
        else:
            last = None
    return [line for cmd in (own or every) for line in cmd]


def program(file: str) -> str:
    """How `file` is run: `python -m pkg.mod` inside a package (a folder with __init__.py), else `python PATH`."""
    path = os.path.abspath(file)
    parts, top = [os.path.splitext(os.path.basename(path))[0]], os.path.dirname(path)
    while os.path.isfile(os.path.join(top, "__init__.py")):
        parts.insert(0, os.path.basename(top))
        top = os.path.dirname(top)
    return f"python -m {'.'.join(parts)}" if len(parts) > 1 else f"python {os.path.relpath(path)}"


def summary(doc: str) -> str:
    """The docstring's first paragraph, its line breaks kept."""
    return (doc or "").strip().split("\n\n")[0].strip()


def describe(doc: str, file: str) -> str:
    """usage (the docstring's commands for this file) and what it does (its first paragraph)."""
    cmds = commands(doc, file) or [program(file)]
    return "usage:\n" + "\n".join("  " + c for c in cmds) + "\n\n" + summary(doc)


def answer_help(doc: str, file: str, argv=None) -> None:
    """-h / --help among the arguments: print describe(doc, file) and exit 0; otherwise return."""
    if wants_help(sys.argv[1:] if argv is None else argv):
        print_help(describe(doc, file))
        raise SystemExit(0)


class _OneLineParser(argparse.ArgumentParser):
    def error(self, message):  # one line naming the flag, exit 2 (argparse's usage block above it: --help has it)
        self.exit(2, f"{os.path.basename(self.prog.split()[-1])}: {message}\n")  # prog: `python -m pkg.mod`


def parser(doc: str, file: str, **kw) -> argparse.ArgumentParser:
    """An ArgumentParser whose --help shows the docstring's summary above the flags and its commands below, and whose
    errors are one line (`harness.cost_model: argument --dp: invalid int value: 'x'`, exit 2)."""
    cmds = commands(doc, file)
    return _OneLineParser(prog=program(file), description=summary(doc),
                                   formatter_class=argparse.RawDescriptionHelpFormatter,
                                   epilog="examples:\n" + "\n".join("  " + c for c in cmds) if cmds else None, **kw)


def field_docs(cls) -> list:
    """[(section, [(field, comment), ...]), ...] from the dataclass's source: the comment on each field's line is its
    meaning ("" when none); whole-line comments just above a field open a new section titled by them. The fields a
    dataclass takes from its dataclass bases come first, from the bases' own sources, as dataclasses order them."""
    bases = [b for b in reversed(cls.__mro__[1:]) if dataclasses.is_dataclass(b) and b.__dataclass_fields__]
    return [s for b in bases for s in _own_field_docs(b)] + _own_field_docs(cls)


def _own_field_docs(cls) -> list:
    """field_docs of the fields written in `cls`'s own body."""
    src = textwrap.dedent(inspect.getsource(cls))
    comments, whole = {}, set()  # line -> comment text; lines that hold only a comment
    for tok in tokenize.generate_tokens(io.StringIO(src).readline):
        if tok.type == tokenize.COMMENT:
            comments[tok.start[0]] = tok.string.lstrip("#").strip()
            if not tok.line[:tok.start[1]].strip():
                whole.add(tok.start[0])
    body = ast.parse(src).body[0].body
    sections, prev_end = [("", [])], 0
    for node in body:
        if not (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)):
            continue
        head = [comments[n] for n in range(prev_end + 1, node.lineno) if n in whole]
        if head:
            sections.append((" ".join(head), []))
        sections[-1][1].append((node.target.id, comments.get(node.end_lineno, "")
                                if node.end_lineno not in whole else ""))
        prev_end = node.end_lineno
    return [s for s in sections if s[1]]


def show_value(v) -> str:
    """A value as the user types it: -1 for -1.0, '' for the empty string, true / false, 2,2,1 for a tuple."""
    if isinstance(v, bool):
        return str(v).lower()
    if isinstance(v, str):
        return v if v else "''"
    if isinstance(v, tuple):  # --tree=2,2,1
        return ",".join(show_value(x) for x in v) if v else "''"
    r = repr(v)
    return r[:-2] if isinstance(v, float) and r.endswith(".0") else r


def _entry(name: str, typ: str, default, expect: str | None, comment: str) -> list:
    """One flag as `--name TYPE  default: D; expected: E`, its comment beneath (the facts on a line of their own when
    the name is long)."""
    head = f"  --{name} {typ.upper()}"
    facts = f"default: {show_value(default)}" + (f"; expected: {expect}" if expect is not None else "")
    out = [f"{head:<30} {facts}"] if len(head) < 30 else [head, f"{'':<30} {facts}"]
    return out + ([f"{'':<6}{comment}"] if comment else [])


def _types(cls) -> dict:
    return {f.name: f.type if isinstance(f.type, str) else f.type.__name__ for f in dataclasses.fields(cls)}


def flags_help(cls, expect: dict | None = None, default_title: str = "general") -> str:
    """Every field of the dataclass `cls` as `--name TYPE  default: D; expected: E` with its comment beneath, grouped
    by section (fields before any section comment under default_title). expect: field -> what a value must be."""
    expect, obj, types = expect or {}, cls(), _types(cls)
    out = []
    for title, fields in field_docs(cls):
        out += [""] + textwrap.wrap(f"{title or default_title}:", 116, subsequent_indent="  ")
        for name, comment in fields:
            out += _entry(name, types[name], getattr(obj, name), expect.get(name), comment)
    return "\n".join(out[1:])


def grouped_help(cls, groups, expect: dict | None = None, brief: bool = False) -> str:
    """The fields of `cls` by topic: groups = ((title, main, (field, ...)), ...), every field in one group. In full,
    each field as flags_help shows it; brief: a main group's fields one line each (`--name=default  meaning`, cut to
    120 columns), the other groups' field names only."""
    expect, obj, types = expect or {}, cls(), _types(cls)
    comment = {name: c for _, fields in field_docs(cls) for name, c in fields}
    out = []
    for title, main, names in groups:
        out += [""] + textwrap.wrap(f"{title}:", 116, subsequent_indent="  ")
        for name in names if main or not brief else ():
            if not brief:
                out += _entry(name, types[name], getattr(obj, name), expect.get(name), comment[name])
                continue
            head = f"  --{name}={show_value(getattr(obj, name))}"
            out.append(f"{head:<30} {textwrap.shorten(comment[name], 119 - max(30, len(head)), placeholder=' ...')}"
                       .rstrip())
        if brief and not main:
            out += textwrap.wrap(" ".join(f"--{n}" for n in names), 118, initial_indent="  ", subsequent_indent="  ")
    return "\n".join(out[1:])


def prog_name(file: str) -> str:
    """How errors are prefixed: `train.py` for a root script, `harness.memory_plan` for a module of a package."""
    run = program(file)
    return run.split()[-1] if run.startswith("python -m ") else os.path.basename(file)


def one_line(e: BaseException) -> str:
    """The error as one line: its message (newlines folded); an unexpected type is named, with the way to see where."""
    msg = " ".join(str(e).split()) or type(e).__name__
    if isinstance(e, USER_ERRORS) or type(e).__name__ == "OutOfMemoryError":  # torch's (a RuntimeError): too big
        return msg
    return f"{type(e).__name__}: {msg} (an internal error; {TRACEBACK}=1 shows the traceback)"


def run_main(main, file: str, argv=None):
    """Run an entry point's main (main() or main(argv)) and exit: its return code (an int; else 0); an exception as one
    line `<prog>: <message>` on stderr, exit 1; Ctrl-C as one line (the KeyboardInterrupt's message, if main gave
    one), exit 130, printed by rank 0 only. With COSPEC_TRACEBACK=1 the exception propagates (a traceback)."""
    prog = prog_name(file)
    try:
        code = main() if argv is None else main(argv)
    except KeyboardInterrupt as e:
        if os.environ.get(TRACEBACK) == "1":
            raise
        if os.environ.get("RANK", "0") == "0":
            print(f"{prog}: {' '.join(str(e).split()) or 'interrupted'}", file=sys.stderr, flush=True)
        raise SystemExit(130) from None
    except Exception as e:  # noqa: BLE001 -- the entry point's last word: one line
        if os.environ.get(TRACEBACK) == "1":
            raise
        print(f"{prog}: {one_line(e)}", file=sys.stderr, flush=True)
        raise SystemExit(1) from None
    raise SystemExit(code if isinstance(code, int) else 0)  # main's int, or 0 (a main may return its results)


@contextlib.contextmanager
def writing(path: str):
    """A failed write inside (OSError, or safetensors' SafetensorError, which is not one: "No space left on device",
    no path) becomes an OSError naming `path`, with the errno when one can be read from the message."""
    try:
        yield
    except (OSError, SafetensorError) as e:
        if isinstance(e, OSError) and e.filename:
            raise
        text = str(e)
        code = getattr(e, "errno", None) or next((n for n, s in ((errno.ENOSPC, "No space left"),
                                                                (errno.EDQUOT, "quota exceeded"),
                                                                (errno.EROFS, "Read-only file system"))
                                                 if s in text), errno.EIO)
        raise OSError(code, f"{getattr(e, 'strerror', None) or os.strerror(code)} (while writing; {text})"
                      if code == errno.EIO else (getattr(e, "strerror", None) or os.strerror(code)), path) from None


def read_json(path: str, what: str = "") -> dict:
    """A JSON object from `path`; errors name the file (and the line and column of a syntax error), then `what`."""
    try:
        with open(path, encoding="utf-8") as f:
            obj = json.load(f)
    except json.JSONDecodeError as e:  # the parser's message names no file
        raise ValueError(f"{path}: invalid JSON ({e.msg} at line {e.lineno}, column {e.colno}){what}") from None
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"{path}: cannot be read ({type(e).__name__}: {e}){what}") from None
    if not isinstance(obj, dict):
        raise ValueError(f"{path}: expected a JSON object, got {type(obj).__name__}{what}")
    return obj
