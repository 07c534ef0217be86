"""The house: the paper's ideas at the root, the machinery in named folders, imports one way, small files.

LAYERS is the declared order, lowest first: a root file or a folder may import only itself and what comes before it.
Imports anywhere in a file count (function-local and TYPE_CHECKING ones too), relative ones resolved. The install
puts no module into site-packages (pyproject.toml says why), so everything runs from the checkout. ~15 s in all,
most of it building the wheel and importing every module in a fresh interpreter.
"""
import ast
import os
import shutil
import subprocess
import sys
import zipfile

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MAX_FILE_LINES, MAX_FUNC_LINES, MAX_COLUMNS = 450, 80, 120

LAYERS = [  # (unit, what it is); a unit imports only itself and the units above it in this list
    ("parallel", "the ring, the process grid, cross-rank checks"),
    ("tasks", "the built-in task and HF data"),
    ("branch_mask", "who attends to whom; where each token lives under CP (zigzag)"),
    ("modeling", "the policy's layers, the KV cache, mixed precision"),
    ("decoding", "the accept / residual rule, tree drafts"),
    ("model", "the policy"),
    ("attention_blocks", "one ring step's block attention (tiles, per-row key limits) and the exact LSE merge"),
    ("attention_cp", "idea (a): zigzag ring attention fused with the local branch, exact LSE merge"),
    ("backends", "Triton / flash-attn / padded kernels, fused log-probs"),
    ("serving", "HF checkpoints, EAGLE-3 export, reduced draft vocabulary, vLLM as the engine: refit, checks"),
    ("draft_loss", "the draft's TTT loss, streamed"),
    ("draft_ttt", "the draft's multi-pass training (TTT): passes over trunk + branch, its loss and metrics"),
    ("draft_block", "block drafts' training: seeded anchors, the block targets and the streamed block loss"),
    ("drafter", "the drafter protocol: what a draft family gives the engine, the trainer and the export"),
    ("draft", "the EAGLE-3 draft: its layer, inference steps, save / load"),
    ("draft_dflash", "the DFlash block draft: context KV injection, one forward per block, its loss"),
    ("draft_dspark", "DSpark: the DFlash backbone with a low-rank Markov head and a confidence head"),
    ("speculative", "lossless speculative rollouts"),
    ("tapchannel", "idea (b): feature taps to the draft's stage over their own path"),
    ("pipeline", "pipeline parallelism with CP inside each stage"),
    ("rl_loop", "GRPO and the co-training step, single process"),
    ("dist_step", "the same step over DP x PP x CP"),
    ("commcheck", "the NCCL deadlock checker"),
    ("harness", "config, mesh, warm-ups, controls, the step's phases, reports"),
    ("checkpoints", "checkpoints and resumes"),
    ("hf_io", "root re-export of serving/hf_io"),
    ("train", "the entry point"),
]
ORDER = {name: i for i, (name, _) in enumerate(LAYERS)}
SKIP = {"tests", "bench", "docs", "runs", "cache", "build", "dist"}


def project_modules() -> dict:
    """dotted module name -> path, for every .py of the root and its folders (not tests/, bench/, docs/)."""
    mods = {}
    for top, dirs, files in os.walk(ROOT):
        dirs[:] = sorted(d for d in dirs if d not in SKIP and not d.startswith((".", "__")) and ".egg-info" not in d)
        for f in files:
            if f.endswith(".py"):
                parts = os.path.relpath(os.path.join(top, f), ROOT)[:-3].split(os.sep)
                mods[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = os.path.join(top, f)
    return mods


def import_graph(mods: dict) -> dict:
    """module -> the project modules it imports (anywhere in the file)."""
    def resolve(name):
        parts = name.split(".")
        for i in range(len(parts), 0, -1):
            if ".".join(parts[:i]) in mods:
                return ".".join(parts[:i])
        return None

    graph = {}
    for name, path in mods.items():
        pkg = name.split(".") if path.endswith("__init__.py") else name.split(".")[:-1]
        deps = set()
        for node in ast.walk(ast.parse(open(path, encoding="utf-8").read())):
            if isinstance(node, ast.Import):
                deps |= {resolve(a.name) for a in node.names}
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    base = ".".join(pkg[:len(pkg) - node.level + 1] + ([base] if base else []))
                for a in node.names:  # `from pkg import mod` names a submodule where one exists
                    deps.add(resolve(f"{base}.{a.name}" if base else a.name) or resolve(base))
        graph[name] = {d for d in deps if d and d != name and not (path.endswith("__init__.py")
                                                                   and d.startswith(name + "."))}
    return graph


def find_cycle(graph: dict):
    state, stack = {}, []

    def visit(u):
        state[u] = 1
        stack.append(u)
        for v in sorted(graph[u]):
            if state.get(v) == 1:
                return stack[stack.index(v):] + [v]
            if v not in state and (c := visit(v)):
                return c
        state[u] = 2
        stack.pop()
        return None

    for u in sorted(graph):
        if u not in state and (c := visit(u)):
            return c
    return None


def unit(module: str) -> str:
    return module.split(".")[0]


def test_every_module_sits_in_a_declared_layer_and_the_root_holds_only_them():
    mods = project_modules()
    assert {unit(m) for m in mods} == set(ORDER), "LAYERS and the files on disk disagree"
    for name, _ in LAYERS:
        is_folder = os.path.isdir(os.path.join(ROOT, name))
        assert is_folder != os.path.isfile(os.path.join(ROOT, name + ".py")), name
        if is_folder:  # a folder opens with a docstring saying what it holds and what it may import
            doc = ast.get_docstring(ast.parse(open(os.path.join(ROOT, name, "__init__.py")).read()))
            assert doc and "May import" in doc, f"{name}/__init__.py: no docstring naming what it may import"


def test_imports_go_one_way_and_there_is_no_cycle():
    graph = import_graph(project_modules())
    assert find_cycle(graph) is None, f"import cycle: {' -> '.join(find_cycle(graph))}"
    bad = sorted(f"{m} imports {d}" for m, ds in graph.items() for d in ds if ORDER[unit(d)] > ORDER[unit(m)])
    assert not bad, "imports against the declared order (LAYERS):\n" + "\n".join(bad)


def test_the_checker_catches_a_cycle_and_an_upward_import():  # the checks above can fail
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None
    assert ORDER[unit("harness.config")] > ORDER["model"]  # so `model` importing harness.config would be refused


def test_files_and_functions_stay_small():
    long_files, long_funcs = [], []
    for name, path in project_modules().items():
        src = open(path, encoding="utf-8").read()
        if src.count("\n") > MAX_FILE_LINES:
            long_files.append(f"{name}: {src.count(chr(10))} lines")
        for node in ast.walk(ast.parse(src)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                n = node.end_lineno - node.lineno + 1
                if n > MAX_FUNC_LINES:
                    long_funcs.append(f"{name}:{node.lineno} {node.name} ({n} lines)")
    assert not long_files, f"files over {MAX_FILE_LINES} lines: {long_files}"
    assert not long_funcs, f"functions over {MAX_FUNC_LINES} lines: {long_funcs}"


def test_no_line_is_wider_than_the_house_width():
    """Every Python file of the repository, tests and benchmarks included: at most MAX_COLUMNS characters a line."""
    wide = []
    for top, dirs, files in os.walk(ROOT):
        dirs[:] = [d for d in dirs if not d.startswith((".", "__")) and ".egg-info" not in d
                   and d not in ("runs", "cache", "build", "dist")]
        for f in files:
            if f.endswith(".py"):
                path = os.path.join(top, f)
                for i, line in enumerate(open(path, encoding="utf-8").read().split("\n"), 1):
                    if len(line) > MAX_COLUMNS:
                        wide.append(f"{os.path.relpath(path, ROOT)}:{i} ({len(line)})")
    assert not wide, f"lines over {MAX_COLUMNS} columns: {wide}"


def test_every_module_imports_from_the_checkout_alone(tmp_path):
    """A fresh interpreter whose only project path is the root imports every module (nothing relies on an installed
    copy); run from another directory, so the current directory cannot stand in for the root."""
    mods = sorted(project_modules())
    code = "import importlib\nfor m in %r:\n    importlib.import_module(m)\nprint('ok')" % mods
    env = {**os.environ, "PYTHONPATH": ROOT}
    r = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr[-2000:]


def test_the_install_puts_no_module_into_site_packages(tmp_path):
    """What the install declares matches the files: no py-module, no package; the wheel holds only its metadata."""
    pytest.importorskip("setuptools")
    src = tmp_path / "src"  # a copy, so that the build leaves nothing in the checkout
    shutil.copytree(ROOT, src, ignore=shutil.ignore_patterns(".git", "runs", "cache", "build", "__pycache__",
                                                             "*.egg-info"))
    r = subprocess.run([sys.executable, "-m", "pip", "wheel", str(src), "--no-deps", "--no-build-isolation", "-q",
                        "-w", str(tmp_path / "wheel")], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    (wheel,) = os.listdir(tmp_path / "wheel")
    names = zipfile.ZipFile(tmp_path / "wheel" / wheel).namelist()
    assert names and all(n.split("/")[0].endswith(".dist-info") for n in names), names
