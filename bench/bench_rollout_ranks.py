"""One RL step's rollout phase with one generating rank (rank 0 takes every block, the others wait in the gather:
the layout before every rank generated) against every rank generating its blocks (harness/rollout.py), on the same
mesh, prompts and row streams, under torchrun.

    torchrun --standalone --nproc_per_node=4 bench/bench_rollout_ranks.py --repeats=3 --sft_steps=300 \
        --draft_warmup_steps=100            # the default experiment's rollout (mini policy, 32 x 8 rows, k = 4)

Flags: --repeats=N (default 3), then any train.py flag (the run whose rollout is timed; its warm-ups are cached as
train.py's). Each repeat samples one step's prompts and runs both layouts on them, in alternating order, from the
same rollout-stream state: the two batches must be bit-identical (checked), only who generates differs. Per layout,
the median over repeats of: the phase's wall seconds (rank 0, from a barrier to the gathered batch), the slowest
rank's wall seconds for its blocks, and each rank's CPU seconds for its blocks (process time: on a shared 2-core
machine 4 busy processes get ~half a core each, so wall time understates what each rank's share costs; CPU time is
the fairer per-rank figure). Writes bench/results/rollout_ranks.json and .md (rank 0).
"""
from __future__ import annotations

import json
import os
import platform
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from harness.config import parse_args  # noqa: E402
from harness.experiment import build  # noqa: E402
from harness.mesh import make_mesh, row_blocks  # noqa: E402
from harness.rollout import rollout  # noqa: E402

OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "rollout_ranks")


def timed(s, mesh, problems, gen_state, one: bool) -> tuple:
    """One rollout phase; one=True: rank 0 generates every block. -> (batch, {"wall", "rank_s", "rank_cpu_s"})."""
    s.gen.set_state(gen_state)
    mesh.blocks = (lambda n, size: row_blocks(n, size, 0, 1) if mesh.rank == 0 else []) if one else \
        (lambda n, size: row_blocks(n, size, mesh.rank, mesh.world))
    mesh.barrier()
    t0, timer = time.perf_counter(), {}
    batch, _ = rollout(s, mesh, problems, timer)
    return batch, {"wall": time.perf_counter() - t0, "rank_s": timer["rollout_rank_s"],
                   "rank_cpu_s": timer["rollout_rank_cpu_s"]}


def main(argv):
    repeats = int(next((a.split("=", 1)[1] for a in argv if a.startswith("--repeats=")), 3))
    cfg = parse_args([a for a in argv if not a.startswith("--repeats=")])
    torch.set_num_threads(cfg.threads)
    mesh = make_mesh(cfg)
    s = build(cfg, mesh, log=print if mesh.main else (lambda *a, **k: None))
    runs = {"one": [], "all": []}
    for rep in range(repeats):
        problems, state = s.task.sample(cfg.prompts_per_step, s.rng), s.gen.get_state()
        batches = {}
        for mode in (("one", "all") if rep % 2 == 0 else ("all", "one")):
            batches[mode], t = timed(s, mesh, problems, state, mode == "one")
            runs[mode].append(t)
        assert torch.equal(batches["one"].tokens, batches["all"].tokens)
        assert torch.equal(batches["one"].old_logp, batches["all"].old_logp)
    if not mesh.main:
        return mesh.close()
    med = lambda xs: statistics.median(xs)  # noqa: E731
    res = {mode: {"phase_wall_s": med([t["wall"] for t in ts]),
                  "slowest_rank_wall_s": med([max(t["rank_s"]) for t in ts]),
                  "rank_cpu_s": [med([t["rank_cpu_s"][r] for t in ts]) for r in range(mesh.world)],
                  "max_rank_cpu_s": med([max(t["rank_cpu_s"]) for t in ts]),
                  "total_cpu_s": med([sum(t["rank_cpu_s"]) for t in ts])} for mode, ts in runs.items()}
    out = {"command": "torchrun --standalone --nproc_per_node=%d bench/bench_rollout_ranks.py %s"
                      % (mesh.world, " ".join(argv)),
           "mesh": mesh.describe(), "rows": cfg.prompts_per_step * cfg.group_size, "rollout_batch": cfg.rollout_batch,
           "k": cfg.num_draft_tokens, "repeats": repeats, "cpus": os.cpu_count(), "machine": platform.processor(),
           **res, "wall_speedup": res["one"]["phase_wall_s"] / res["all"]["phase_wall_s"],
           "max_rank_cpu_ratio": res["one"]["max_rank_cpu_s"] / res["all"]["max_rank_cpu_s"]}
    with open(OUT + ".json", "w") as f:
        json.dump(out, f, indent=2)
    md = [f"`{out['command']}` ({out['mesh']}, {out['rows']} rows in blocks of {out['rollout_batch']}, k = {out['k']},"
          f" median of {repeats}; {out['cpus']} CPUs)", "",
          "| generating ranks | phase wall s | slowest rank wall s | CPU s per rank | max rank CPU s | total CPU s |",
          "|---|---:|---:|---|---:|---:|"]
    for mode, name in (("one", "one (rank 0)"), ("all", f"all {mesh.world}")):
        r = res[mode]
        md.append(f"| {name} | {r['phase_wall_s']:.2f} | {r['slowest_rank_wall_s']:.2f} | "
                  f"{', '.join(f'{x:.2f}' for x in r['rank_cpu_s'])} | {r['max_rank_cpu_s']:.2f} | "
                  f"{r['total_cpu_s']:.2f} |")
    with open(OUT + ".md", "w") as f:
        f.write("\n".join(md) + "\n")
    print("\n".join(md))
    mesh.close()


if __name__ == "__main__":
    from parallel.cli import answer_help, run_main  # an error: one line, exit 1 (COSPEC_TRACEBACK=1: traceback)
    answer_help(__doc__, __file__)  # -h / --help: usage and summary from the docstring, exit 0
    run_main(main, __file__, sys.argv[1:])
