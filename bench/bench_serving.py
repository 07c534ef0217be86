"""vLLM (CPU build) and cospec's own engine side by side on one servable pair: tokens/s and acceptance, with and
without the draft, at T = 0 and T = 1, batch 1 / 8 / 64, as ratios. One run: every cell is timed in the same
process pair, alternating engines, so the machine's load moves them alike (the load is recorded with the results).

    python bench/bench_serving.py --run runs/NAME      # a run's policy/ + draft/ (a servable preset: docs/serving.md)
    python bench/bench_serving.py --run runs/NAME --batches 1,8 --max_tokens 48 --repeats 3

Writes bench/results/serving.json and prints the table. Needs vLLM's environment (bash .ci/vllm_env.sh). vLLM runs
with the expand workaround only if its losslessness check needs it (serving/engine_check.py), in fp32, k = 3.
Both acceptance columns count a row's stopping step whole, as vLLM's counters do (speculative.py's docstring).
"""
import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from serving.engine_check import checked_engine  # noqa: E402
from serving.hf_io import from_pretrained  # noqa: E402
from serving.vllm_engine import VllmEngine  # noqa: E402
from speculative import generate  # noqa: E402
from tasks import task  # noqa: E402
from harness.draft_formats import load_draft  # noqa: E402


def cospec_cell(policy, draft, prompts, k, T, max_tokens, eos):
    g = torch.Generator().manual_seed(0)
    t0 = time.perf_counter()
    with torch.no_grad():
        r = generate(policy, draft, prompts, max_new_tokens=max_tokens, num_draft_tokens=k if draft else 0,
                     temperature=T, eos_id=eos, generator=g)
    wall = time.perf_counter() - t0
    return sum(t.numel() for t in r.tokens) / wall, r.stats.acceptance_length_uncut  # counted as vLLM counts


def vllm_cell(eng, prompts, T, max_tokens, eos, spec):
    o = eng.generate([p.tolist() for p in prompts], temperature=T, max_tokens=max_tokens, stop=eos, spec=spec)
    return sum(len(t[0]) for t in o.tokens) / o.wall_s, o.acceptance_length


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--run", required=True, help="a run directory holding policy/ and draft/")
    ap.add_argument("--batches", default="1,8,64", help="comma-separated batch sizes")
    ap.add_argument("--max_tokens", type=int, default=48, help="new tokens per prompt at most")
    ap.add_argument("--repeats", type=int, default=3, help="timed repeats per cell (the median is reported)")
    ap.add_argument("--k", type=int, default=3, help="draft tokens per step")
    ap.add_argument("--out", default="bench/results/serving.json", help="the JSON written")
    a = ap.parse_args()
    torch.set_num_threads(1)
    policy = from_pretrained(os.path.join(a.run, "policy")).eval()
    draft = load_draft(os.path.join(a.run, "draft"), policy).eval()
    src = task.CountUpTask()
    eos = src.tok.eos_ids  # every id that ends a row: both engines stop on them
    batches = [int(b) for b in a.batches.split(",")]
    pool = [src.encode_prompt(p) for p in src.eval_set(max(batches))]
    rows, load = [], os.getloadavg()
    with VllmEngine(os.path.join(a.run, "policy"), os.path.join(a.run, "draft"), k=a.k) as eng:
        check = checked_engine(eng, [p.tolist() for p in pool[:8]], stop=eos)
        for T in (0.0, 1.0):
            for B in batches:
                cells = {"vllm_spec": [], "vllm_ar": [], "cospec_spec": [], "cospec_ar": []}
                for _ in range(a.repeats):  # alternate the four so a load spike hits all of them
                    cells["vllm_spec"].append(vllm_cell(eng, pool[:B], T, a.max_tokens, eos, True))
                    cells["vllm_ar"].append(vllm_cell(eng, pool[:B], T, a.max_tokens, eos, False))
                    cells["cospec_spec"].append(cospec_cell(policy, draft, pool[:B], a.k, T, a.max_tokens, eos))
                    cells["cospec_ar"].append(cospec_cell(policy, None, pool[:B], a.k, T, a.max_tokens, eos))
                med = {k: sorted(v)[len(v) // 2] for k, v in cells.items()}  # by tokens/s
                rows.append({"T": T, "batch": B, **{f"{k}_tok_s": v[0] for k, v in med.items()},
                             "vllm_accept": med["vllm_spec"][1], "cospec_accept": med["cospec_spec"][1],
                             "vllm_spec_over_ar": med["vllm_spec"][0] / med["vllm_ar"][0],
                             "cospec_spec_over_ar": med["cospec_spec"][0] / med["cospec_ar"][0],
                             "vllm_spec_over_cospec_spec": med["vllm_spec"][0] / med["cospec_spec"][0]})
    res = {"run": a.run, "k": a.k, "max_tokens": a.max_tokens, "repeats": a.repeats, "loadavg_start": load,
           "loadavg_end": os.getloadavg(), "lossless_check": {k: v for k, v in check.items() if k != "without"},
           "workaround": check["workaround"], "engine_start_s": eng.started, "rows": rows}
    os.makedirs(os.path.dirname(a.out), exist_ok=True)
    with open(a.out, "w") as f:
        json.dump(res, f, indent=2)
    print(f"load average {load[0]:.1f} -> {res['loadavg_end'][0]:.1f}; expand workaround: {check['workaround']}")
    print("  T  batch | accept vLLM cospec | spec/AR vLLM cospec | vLLM spec / cospec spec")
    for r in rows:
        print(f"{r['T']:3.0f} {r['batch']:6d} | {r['vllm_accept']:11.2f} {r['cospec_accept']:6.2f} | "
              f"{r['vllm_spec_over_ar']:12.2f}x {r['cospec_spec_over_ar']:5.2f}x | "
              f"{r['vllm_spec_over_cospec_spec']:.2f}x")
    print(f"wrote {a.out}")


if __name__ == "__main__":
    from parallel.cli import run_main  # an error: one line, exit 1 (COSPEC_TRACEBACK=1: the traceback)
    run_main(main, __file__)
