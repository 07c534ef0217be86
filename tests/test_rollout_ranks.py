"""Every rank generates: a step's rollouts (tokens, log-probs, reference log-probs, advantages), the held-out eval and
the offline arm's samples are bit-identical on the 1 x 1 x 1 mesh and on pp 2 x cp 2 and dp 2 x cp 2 under gloo (fixed
k = 4, blocks of 2 rows: each of the 4 ranks generates 2 of the 8 rollout blocks and 1 of the 4 eval blocks), every
rank generated rows, and the live table shows the slowest and fastest rank. ~90 s on 2 shared cores (measured under
load: the 1 x 1 x 1 run with its warm-ups, then one 4-process gloo job that builds both meshes in turn)."""
import pytest
import torch

from dist_util import run_distributed
from harness.config import parse_args
from harness.eval_arms import evaluate
from harness.experiment import build
from harness.mesh import Mesh, row_blocks
from harness.report import HEADER, Report
from harness.rollout import rollout
from parallel.grid import Grid

pytestmark = pytest.mark.usefixtures("one_thread")
ARGS = ["--preset=test", "--prompts_per_step=4", "--rollout_batch=2", "--eval_prompts=4", "--num_draft_tokens=4",
        "--device=cpu"]  # 16 rollout rows = 8 blocks, 8 eval rows = 4 blocks
MESHES = [(2, 2, 1), (1, 2, 2)]  # (pp, cp, dp)


def one_step(cfg, mesh) -> dict:
    """Build on `mesh`, then one step's rollout, an eval and an offline-arm sample: what every mesh must agree on."""
    s = build(cfg, mesh, log=lambda *a, **k: None)
    problems = s.task.sample(cfg.prompts_per_step, s.rng)
    timer = {}
    batch, info = rollout(s, mesh, problems, timer)
    ev = evaluate(s, mesh)
    off = s.offline.sample()
    det = {k: v for k, v in (ev or {}).items() if "tok_s" not in k and not k.startswith("speedup")}  # not timings
    return {"batch": (batch.tokens, batch.cu_seqlens, batch.old_logp, batch.ref_logp, batch.adv, batch.valid),
            "info": {k: v for k, v in info.items() if k not in ("rank_rows", "rollout_tok_s")}, "eval": det or None,
            "offline": (off.tokens, off.cu_seqlens), "rank_rows": info["rank_rows"], "timer": timer}


def _on_meshes(rank, world, cache):
    cfg = parse_args(ARGS + [f"--cache_dir={cache}"])
    return [one_step(cfg, Mesh(Grid.build(pp=pp, cp=cp, dp=dp, device=torch.device("cpu")), torch.device("cpu"),
                               rank, world)) for pp, cp, dp in MESHES]


def test_a_step_is_bit_identical_on_every_mesh_and_every_rank_generates(tmp_path):
    cfg = parse_args(ARGS + [f"--cache_dir={tmp_path}"])
    ref = one_step(cfg, Mesh(Grid(), torch.device("cpu")))  # trains and caches the warm-ups the ranks then load
    assert ref["rank_rows"] == [16] and ref["eval"] is not None
    per_rank = run_distributed(_on_meshes, world_size=4, args=(str(tmp_path),), timeout=400)
    for m, mesh in enumerate(MESHES):
        for rank, got in enumerate(r[m] for r in per_rank):
            for a, b in zip(got["batch"] + got["offline"], ref["batch"] + ref["offline"]):
                assert torch.equal(a, b), (mesh, rank)
            assert got["info"] == ref["info"], (mesh, rank)
            assert got["rank_rows"] == [4, 4, 4, 4]  # every rank generated its 2 blocks of 2 rows
            assert len(got["timer"]["rollout_rank_s"]) == 4 and min(got["timer"]["rollout_rank_cpu_s"]) > 0
            assert got["eval"] == (ref["eval"] if rank == 0 else None), (mesh, rank)  # pooled on rank 0


def test_row_blocks_cover_every_row_once():
    for n, size, world in [(16, 2, 4), (13, 4, 3), (5, 8, 4), (0, 3, 2)]:
        got = [blk for r in range(world) for blk in row_blocks(n, size, r, world)]
        assert sorted(i for _, rows in got for i in rows) == list(range(n))
        assert sorted(j for j, _ in got) == list(range(-(-n // size)))
        assert all(len(rows) == size for j, rows in got if j < n // size)
    assert [j for j, _ in row_blocks(16, 2, 1, 4)] == [1, 5]  # block j on rank j mod world


def test_live_table_shows_the_slowest_and_fastest_rank(tmp_path, capsys):
    rep = Report(parse_args(["--preset=test"]), str(tmp_path), main=True)
    row = {"step": 1, "reward": 0.5, "correct": 0.4, "explicit": 0.6, "resp_len": 40.0, "kl": 0.0,
           "zero_var_groups": 0, "clip_frac": 0.0, "accept_len": 3.0, "tau_hat_cotrained": 3.0, "rollout_tok_s": 900,
           "time": {"rollout": 2.5, "rollout_rank_s": [1.25, 2.0, 0.75, 1.5], "policy_train": 1.0,
                    "draft_train": 0.5}}
    rep.train(row)
    line = capsys.readouterr().out.splitlines()[-1].split()
    cols = dict(zip(HEADER.split(), line))
    assert (cols["t_roll"], cols["r_max"], cols["r_min"]) == ("2.50", "2.00", "0.75")
