"""The results tables against the files their numbers come from, and the README's budget. ~1 s.

docs/results.md holds every result in one table; the README quotes at most 8 of its rows, shorter. Every row of both
is declared here, by the start of its first cell, with where its numbers come from:
- ("json", file, values): every number printed in the row's number cell is one of `values` (read from the committed
  results file by the current code's benchmark) at the digits printed. In docs/results.md every value is printed too;
  the README may quote a subset. A number in the cell that no value explains fails, so a figure cannot be pasted in
  without its source.
- ("test", files): the row quotes what a test asserts; the command cell (docs/results.md) must name each test file,
  which must exist.
- ("commit", sha): measured by older code and kept with no results file; the row must say "at commit <sha>" (not in
  the README, which names no commit).
A row that is not declared fails: a new result comes with its source.

The README is a front door: at most 150 lines and 1,800 words, no commit hash, no date; its quick start's times are
the stored runs' (the main job's range, the tests' time in docs/quickstart.md), and its printout is the stored run's.
"""
import json
import math
import os
import re
import statistics

import pytest

from test_layout import ROOT

NUMBER = re.compile(r"(?<![\w.])[-−+]?\d+(?:\.\d+)?(?:e[-−+]?\d+)?(?![\w.])")


def _load(path):
    with open(os.path.join(ROOT, path)) as f:
        return json.load(f)


def _e2e(budget="2"):
    runs = _load("bench/results/e2e_default.json")["budgets"][budget]
    cis = [x[f"accept_gain_vs_{arm}_ci"] for arm in ("frozen", "offline") for x in runs]
    means = [statistics.mean(x[f"accept_len_{arm}"] for x in runs) for arm in ("cotrained", "frozen", "offline")]
    return [v for ci in cis for v in ci] + means


def _e2e_speedup():
    runs = _load("bench/results/e2e_default.json")["budgets"]["2"]
    sp = [x["e2e_step_speedup_measured"] for x in runs]
    return [statistics.mean(sp), statistics.stdev(sp)]


def _budgets():
    b = _load("bench/results/e2e_budget.json")["budgets"]
    return [statistics.mean(x["accept_len_cotrained"] for x in b[k]) for k in ("1", "2", "4", "8")]


def _attention():
    rows = _load("bench/results/attention.json")["rows"]
    return [r["peak_bytes_per_rank"] / 2 ** 20 for cp in (1, 2, 4, 8) for r in rows
            if r["method"] == "ours" and r["L"] == 16384 and r["P"] == 3 and r["cp"] == cp]


def _rollout():
    t = _load("bench/results/rollout_auto.json")["auto_targets"]
    tau1 = [r for r in t["rows"] if r["temperature"] == 1.0]
    tau1.sort(key=lambda r: r["batch"])
    runs = [_load(f"bench/results/{f}.json")["auto_targets"] for f in ("rollout_auto_run1", "rollout_auto_run2")]
    ratio = lambda x: x["geomean_auto"] / x["geomean_best_fixed"]  # noqa: E731
    repeats = sorted({r["repeats"] for r in _load("bench/results/rollout_auto.json")["rows"]}, reverse=True)
    return ([r["auto"] for r in tau1] + [r["auto_sd"] for r in tau1] + repeats
            + [ratio(t), statistics.mean([ratio(x) for x in runs + [t]])])


def _rollout_families(name: str):
    fams = _load(f"bench/results/{name}.json")["families"]
    return [max(r["speedup"] for r in fams[f]["rows"] if r["batch"] == B and r["temperature"] == 1.0)
            for f in ("eagle3", "dflash", "dspark") for B in (1, 8, 64)]


def _dspark_cut():
    rows = {(r["batch"], r["k"], r["threshold"]): r for r in _load("bench/results/dspark_cut.json")["rows"]}
    cut = [rows[(1, 8, t)] for t in (0.5, 0.7, 0.9)]
    return ([rows[(1, 8, 0.0)]["acceptance_length"]["mean"]] + [r["drafts_cut"]["mean"] for r in cut]
            + [r["acceptance_length"]["vs_off"][k] for r in cut for k in ("mean", "sd")])


def _family_experiment(name="families", keys=("accept_len_cotrained", "e2e_step_speedup_measured")):
    fams = _load(f"bench/results/{name}.json")["families"]  # the families the experiment ran
    mean = lambda f, key: statistics.mean(x[key] for x in fams[f]["2"])  # noqa: E731
    return [mean(f, key) for key in keys for f in fams]


def _block_experiment(name: str):
    """A block-drafter variant, quoted beside the EAGLE-3 runs it is compared with (families.json's acceptance)."""
    keys = ("accept_len_cotrained", "rollout_speedup", "e2e_step_speedup_measured")
    runs = _load("bench/results/families.json")["families"]["eagle3"]["2"]
    eagle3 = statistics.mean(x["accept_len_cotrained"] for x in runs)
    return _family_experiment(name, keys) + [eagle3]


def _e2e_vllm():
    sp = [x["e2e_step_speedup_measured"] for x in _load("bench/results/e2e_vllm.json")["budgets"]["2"]]
    return [statistics.mean(sp), statistics.stdev(sp)]


def _tapchannel():
    d = _load("bench/results/tapchannel.json")
    return [d["paired_overhead"]["tapchannel"], *d["paired_overhead_q1_q3"]["tapchannel"],
            d["paired_overhead"]["piggyback"], d["paired_overhead"]["blocking"],
            *sorted(_load(f"bench/results/tapchannel_{r}.json")["paired_overhead"]["tapchannel"]
                    for r in ("run2", "run3"))]


def _families():
    rows = _load("bench/results/draft_families.json")["rows"]
    out = []
    for fam in ("dflash", "dspark"):
        mib = {r["cp"]: r["live_mib"] for r in rows
               if r["family"] == fam and r["T"] == 65536 and r["V"] == 151936}
        out += [mib[1], mib[4], mib[1] / mib[4]]
    return out


def _omp_wait():
    rows = {(r["load"], r["threads"], r["wait_policy"]): r for r in _load("bench/results/omp_wait.json")["rows"]}
    busy = [rows[(load, n, "default")]["vs_quiet"] for n in (1, 2)
            for load in ("busy neighbour, nice 19", "busy neighbour, nice 0")]
    return busy + [rows[("quiet", n, "default")]["seconds_per_step"] for n in (2, 1)]


SOURCES = {
    "co-trained draft vs the frozen": ("json", "bench/results/e2e_default.json", _e2e),
    "the same with the policy held still": ("commit", "a1a5b93"),
    "**end-to-end RL step vs plain GRPO": ("json", "bench/results/e2e_default.json", _e2e_speedup),
    "draft-training budget": ("json", "bench/results/e2e_budget.json", _budgets, ("0", "1")),
    "one GRPO + co-training step": ("test", ["tests/test_dist_step.py", "tests/test_bf16.py"]),
    "memory plan vs the tensors": ("test", ["tests/test_memory_plan.py"]),
    "Qwen3-8B at 32K tokens": ("test", []),
    "Qwen3-8B, 8K-token responses": ("test", []),
    "a draft family's whole training step": ("json", "bench/results/draft_families.json", _families,
                                             ("151936", "1", "4")),
    "ring + branch attention, peak MiB": ("json", "bench/results/attention.json", _attention),
    "speculative rollouts vs autoregressive": ("json", "bench/results/rollout_auto.json", _rollout, ("3",)),
    "the exports served and refit by a real engine": ("test", ["tests/test_vllm_engine.py"]),
    "every family's draft in the field's formats": ("test", ["tests/test_speculators_parity.py"]),
    "the end-to-end RL step with rollouts from vLLM": ("json", "bench/results/e2e_vllm.json", _e2e_vllm,
                                                       ("4", "3", "0.5")),
    "**H200**: the first GPU run": ("test", ["tests/test_gpu_check.py"]),
    "**H200**: speculative rollouts per draft family": ("json", "bench/results/rollout_families_gpu.json",
                                                        lambda: _rollout_families("rollout_families_gpu"), ("3",)),
    "DSpark's confidence cut": ("json", "bench/results/dspark_cut.json", _dspark_cut, ("0.5", "0.7", "0.9")),
    "speculative rollouts per draft family on this CPU": ("json", "bench/results/rollout_families.json",
                                                          lambda: _rollout_families("rollout_families"), ("3",)),
    "the three draft families in the default experiment": ("json", "bench/results/families.json",
                                                            _family_experiment, ("3", "4")),
    "the block drafts at the paper's depth": ("json", "bench/results/families_l5_b5.json",
                                              lambda: _block_experiment("families_l5_b5"),
                                              ("3",)),
    "three-layer block drafts, a block of k + 1, 16": ("json", "bench/results/families_l3_b5_a16.json",
                                                       lambda: _block_experiment("families_l3_b5_a16"), ("3", "2")),
    "the draft warm-up's step beside one busy process": ("json", "bench/results/omp_wait.json", _omp_wait,
                                                        ("1", "2", "19", "0")),
    "TapChannel vs no taps": ("json", "bench/results/tapchannel.json", _tapchannel, ("4", "21", "2")),
    "largest vocabulary-sized tensor": ("test", ["tests/test_vocab_growth.py"]),
    "host syncs per speculative decode step": ("test", ["tests/test_host_sync.py"]),
}


def results_rows(page: str = "docs/results.md"):
    """(first cell, number cell, last cell) of each row of `page`'s results table (the command cell in
    docs/results.md, the page link in the README)."""
    with open(os.path.join(ROOT, page)) as f:
        text = f.read()
    if page == "README.md":
        text = text.split("\n## Results", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in text.splitlines() if line.startswith("|")][2:]  # header and rule dropped
    return [[c.strip() for c in line.strip("|").split("|")][:3] for line in rows]


def matches(token: str, value: float) -> bool:
    """`token` is `value` at the digits printed: |token - value| <= half a unit of its last digit."""
    t = token.replace("−", "-")
    decimals = len(t.split(".")[1].split("e")[0]) if "." in t else 0
    return math.isfinite(value) and abs(float(t) - value) <= 0.5 * 10 ** -decimals + 1e-12


def source_of(first_cell: str):
    hits = [v for k, v in SOURCES.items() if first_cell.startswith(k)]
    assert len(hits) == 1, f"README results row {first_cell[:60]!r}: declare its source in SOURCES ({len(hits)} match)"
    return hits[0]


def test_the_tables_are_found():
    assert len(results_rows()) >= 8
    assert 4 <= len(results_rows("README.md")) <= 8, "the README quotes at most 8 results"


def _check_numbers(first: str, number: str, src, every: bool):
    _, path, values, *context = src
    values, context = values(), (context[0] if context else ())
    tokens = NUMBER.findall(number)
    unexplained = [t for t in tokens if t not in context and not any(matches(t, v) for v in values)]
    assert not unexplained, f"{first[:40]!r}: {unexplained} are not in {path} ({values})"
    unprinted = [round(v, 4) for v in values if not any(matches(t, v) for t in tokens)]
    assert not (every and unprinted), f"{first[:40]!r}: {path} holds {unprinted}, which the table does not print"


@pytest.mark.parametrize("row", results_rows(), ids=lambda r: r[0][:40])
def test_row_matches_its_source(row):
    first, number, command = row
    src = source_of(first)
    if src[0] == "commit":
        assert f"at commit {src[1]}" in number + first, f"{first[:40]!r}: label it 'measured at commit {src[1]}'"
    elif src[0] == "test":
        for f in src[1]:
            assert os.path.isfile(os.path.join(ROOT, f)) and f in command, (first[:40], f)
    else:
        _check_numbers(first, number, src, every=True)


@pytest.mark.parametrize("row", results_rows("README.md"), ids=lambda r: r[0][:40])
def test_readme_row_is_a_result(row):
    """A README row is a row of docs/results.md, quoted (a subset of its numbers), linking to an existing page."""
    first, number, link = row
    src = source_of(first)
    assert src[0] != "commit", f"README row {first[:40]!r}: measured by older code; keep it in docs/results.md only"
    assert sum(r[0].startswith(k) for r in results_rows() for k in SOURCES if first.startswith(k)) == 1, first[:40]
    page = re.fullmatch(r"\[[^]]+\]\((docs/[\w.]+\.md)\)", link)
    assert page and os.path.isfile(os.path.join(ROOT, page[1])), f"README row {first[:40]!r}: link {link!r}"
    if src[0] == "json":
        _check_numbers(first, number, src, every=False)


def test_the_stated_size_of_the_code_is_its_size():
    """The README's "~N.Nk lines in M files (plus ~N.Nk lines of tests": M is the count of modules the layout test
    walks, the line counts within 2% (they drift a little between recounts)."""
    from test_layout import project_modules
    with open(os.path.join(ROOT, "README.md")) as f:
        m = re.search(r"~(\d+\.\d)k lines in (\d+) files \(plus ~(\d+\.\d)k lines of tests", f.read())
    assert m, "README: state the code's size as '~N.Nk lines in M files (plus ~N.Nk lines of tests'"
    lines = lambda paths: sum(len(open(p, encoding="utf-8").read().splitlines()) for p in paths)  # noqa: E731
    mods = project_modules()
    tests = [os.path.join(ROOT, "tests", f) for f in os.listdir(os.path.join(ROOT, "tests")) if f.endswith(".py")]
    assert int(m[2]) == len(mods), f"README says {m[2]} files; the layout test walks {len(mods)}"
    for said, n in ((m[1], lines(mods.values())), (m[3], lines(tests))):
        assert abs(float(said) * 1000 - n) <= 0.02 * n, f"README says ~{said}k lines; counted {n}"


def _readme() -> str:
    with open(os.path.join(ROOT, "README.md")) as f:
        return f.read()


def test_the_readme_keeps_its_budget():
    """A front door: at most 150 lines and 1,800 words; no commit hash and no date (they live in docs/, beside the
    numbers they qualify)."""
    text = _readme()
    assert len(text.splitlines()) <= 150, f"README: {len(text.splitlines())} lines; at most 150"
    assert len(text.split()) <= 1800, f"README: {len(text.split())} words; at most 1,800"
    hashes = [h for h in re.findall(r"(?<![\w/.-])[0-9a-f]{7,40}(?![\w/.-])", text) if re.search(r"[a-f]", h)
              and re.search(r"\d", h)]
    assert not hashes, f"README names commits {hashes}: move them to docs/ beside their numbers"
    dates = re.findall(r"\b20\d\d-\d\d-\d\d\b", text)
    assert not dates, f"README carries dates {dates}: move them to docs/ beside their numbers"


def test_the_quick_starts_times_are_the_stored_runs():
    """The main job's range is the stored default runs' wall time, in minutes to the half; the tests' time is the one
    docs/quickstart.md states, to the minute."""
    walls = [_load(p)["wall_s"] / 60 for p in ("docs/quickstart_run.json", "docs/default_run.json",
                                               "docs/examples/default_run_661192c.json",
                                               "docs/examples/default_run_aaab936.json")]
    m = re.search(r"the main job: (\d+(?:\.\d)?)-(\d+(?:\.\d)?) min", _readme())
    assert m and float(m[1]) == math.floor(min(walls) * 2) / 2 and float(m[2]) == math.floor(max(walls)), (m, walls)
    with open(os.path.join(ROOT, "docs/quickstart.md")) as f:
        said = re.search(r"passed, \d+ skipped[^)]*? in (\d+) min (\d+) s", f.read())
    m = re.search(r"the tests: ~(\d+) min", _readme())
    assert said and m and int(m[1]) == round(int(said[1]) + int(said[2]) / 60), (m, said)


def test_the_printout_is_the_stored_runs():
    """Every number of the README's printout is a field of the stored run it shows (docs/quickstart_run_metrics.jsonl),
    at the digits printed: its eval lines at steps 0 and 30 and its table rows at steps 1 and 30."""
    block = _readme().split("## What you see", 1)[1].split("```", 2)[1]
    with open(os.path.join(ROOT, "docs/quickstart_run_metrics.jsonl")) as f:
        records = [json.loads(line) for line in f]
    for line in block.strip().splitlines()[1:]:
        ev = re.match(r"\s+eval @ (\d+):", line)
        step = int(ev[1]) if ev else int(line.split()[0]) if line.split()[0].isdigit() else None
        if step is None:
            continue  # the header
        rec = next(r for r in records if r["step"] == step and r["kind"] == ("eval" if ev else "train"))
        values = [v for x in rec.values() for v in (x if isinstance(x, list) else [x])
                  if isinstance(v, (int, float)) and not isinstance(v, bool)]
        tokens = NUMBER.findall(line.split(":", 1)[1] if ev else line)
        bad = [t for t in tokens if t not in ("4", str(step)) and not any(matches(t, v) for v in values)]
        assert not bad, f"README printout, step {step}: {bad} are not in the stored run"
