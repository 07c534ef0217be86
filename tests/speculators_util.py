"""The cospec side of the speculators oracle: finds the python of the library's environment (`bash
.ci/speculators_env.sh` builds .venv-speculators; or $COSPEC_SPECULATORS_PYTHON) and runs tests/speculators_oracle.py
in it. cospec never imports speculators; files travel both ways as torch.save'd dicts (the oracle's docstring lists
the keys).

    py = speculators_python()                         # in a test: skipped without it, a failure when CI=true
    run_oracle("create", "dflash", draft_dir, "--spec", json.dumps(spec))   # -> the oracle's stdout
    run_oracle("forward", "dflash", draft_dir, in_pt, out_pt); torch.load(out_pt)
"""
from __future__ import annotations

import os
import subprocess

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ORACLE = os.path.join(ROOT, "tests", "speculators_oracle.py")
INSTALL = ("bash .ci/speculators_env.sh   (a virtual environment .venv-speculators with speculators 0.9.0; "
           "or set COSPEC_SPECULATORS_PYTHON)")


def speculators_python() -> str:
    """The python of the speculators environment. Without one the calling test is skipped with the line that
    builds it; in CI (CI=true) that is a failure."""
    import pytest
    p = os.environ.get("COSPEC_SPECULATORS_PYTHON") or os.path.join(ROOT, ".venv-speculators", "bin", "python")
    if os.path.isfile(p) and os.access(p, os.X_OK):
        return p
    msg = f"the speculators library is not installed ({p} missing): {INSTALL}"
    pytest.fail(msg) if os.environ.get("CI") == "true" else pytest.skip(msg)


def run_oracle(command: str, *args, timeout: float = 600) -> str:
    """Runs `python tests/speculators_oracle.py command args...` in the speculators environment; returns its stdout.
    A non-zero exit or a timeout raises RuntimeError with the command and the tail of its stderr."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    cmd = [speculators_python(), ORACLE, command, *map(str, args)]
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, cwd=ROOT)
    except subprocess.TimeoutExpired as e:
        err = e.stderr.decode(errors="replace") if isinstance(e.stderr, bytes) else e.stderr or ""
        raise RuntimeError(f"speculators oracle timed out after {timeout} s: {' '.join(cmd)}\n{err[-4000:]}") from None
    if r.returncode != 0:
        raise RuntimeError(f"speculators oracle failed (exit {r.returncode}): {' '.join(cmd)}\n{r.stderr[-4000:]}")
    return r.stdout
