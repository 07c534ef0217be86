"""The draft-family benchmarks' flags and tables (bench/bench_draft_families.py, bench_rollout_families.py,
bench_e2e_budget.py --drafters): every value is checked before anything is trained or spawned, and the family table
names each field a run left empty. ~5 s on 2 cores (imports only, nothing trained)."""
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "bench"))
import bench_draft_families  # noqa: E402
import bench_e2e_budget  # noqa: E402
import bench_rollout_families  # noqa: E402


def test_memory_bench_flags():
    a = bench_draft_families.parse(["--families", "dflash,dspark", "--T", "65536,8192", "--V", "151936"])
    assert (a.families, a.T, a.V, a.cps) == (["dflash", "dspark"], [65536, 8192], [151936], [1, 4])
    q = bench_draft_families.parse(["--quick"])
    assert (q.T, q.V, q.cps, q.seq_len) == ([1024], [4096], [1, 2], 512)


@pytest.mark.parametrize("argv", [["--families", "medusa"], ["--T", "64k"], ["--T", "1000"],
                                  ["--cps", "1,3", "--T", "4096", "--seq_len", "2048"]])
def test_memory_bench_refuses(argv):
    with pytest.raises(SystemExit):
        bench_draft_families.parse(argv)


def test_memory_ratios():
    rows = [dict(family="dflash", T=8, V=4, cp=cp, live_mib=m) for cp, m in ((1, 40.0), (4, 10.0))]
    assert bench_draft_families.ratios(rows) == {"dflash T=8 V=4: live cp1/cp4": 4.0}


def test_rollout_families_flags():
    cfg, names, W, anchors = bench_rollout_families.parse(["--drafters=dflash,eagle3", "--block_size=6", "--ks=2,5"])
    assert (names, W, anchors, cfg.ks, cfg.trees, cfg.auto) == (["dflash", "eagle3"], 6, 8, (2, 5), "", False)
    assert cfg.out == "bench/results/rollout_families.json"
    quick = bench_rollout_families.parse(["--quick"])[0]
    assert (quick.repeats, quick.batches, quick.out) == (1, (1, 8), "bench/results/rollout_families_quick.json")


@pytest.mark.parametrize("argv,match", [
    (["--drafters=medusa"], "--drafters"),
    (["--block_size=x"], "--block_size"),
    (["--block_size=1"], "--block_size"),
    (["--block_size=4", "--ks=2,4"], "--ks"),  # a block of 4 proposes at most 3 tokens
    (["--no_such_key=1"], "bad argument"),
])
def test_rollout_families_refuses(argv, match):
    with pytest.raises(SystemExit, match=match):
        bench_rollout_families.parse(argv)


def test_e2e_families_flags():
    args, flags = bench_e2e_budget.parse(["--drafters", "eagle3,dspark", "--seeds", "0", "--", "--preset", "test"])
    assert (args.drafters, args.name) == (["eagle3", "dspark"], "families")
    assert flags == ["--preset", "test", "--threads=1"]
    plain, _ = bench_e2e_budget.parse([])
    assert (plain.drafters, plain.name) == (None, "e2e_budget")
    assert bench_e2e_budget.run_name(None, 2, 0) == "2_s0"  # EAGLE-3's budget runs keep their names
    assert bench_e2e_budget.run_name("dflash", 2, 0) == "dflash_2_s0"
    for argv in (["--drafters", "medusa"], ["--drafters", "dflash", "--", "--drafter=dspark"]):
        with pytest.raises(SystemExit):
            bench_e2e_budget.parse(argv)


def test_family_table_names_empty_fields():
    full = {k: 1.0 for k in bench_e2e_budget.FAMILY_COLUMNS} | dict(accept_gain_vs_frozen_ci=[0.1, 0.2],
                                                                  accept_gain_vs_offline_ci=[-0.1, 0.3], seed=0)
    res = {"families": {"eagle3": {2: [full]}, "dflash": {2: [dict(full, rollout_speedup=None)]}}}
    assert bench_e2e_budget.missing(res) == ["dflash 1/2 seed 0: rollout_speedup"]
    table = bench_e2e_budget.family_table(res).splitlines()
    assert len(table) == 4 and "[+0.10, +0.20]" in table[2] and "| - |" in table[3]


def test_e2e_a_block_flag_goes_to_the_block_families_alone():
    """EAGLE-3's and the plain runs' train.py refuse --block_size (config_checks.check_family_flags): the side by side
    hands each family the flags it reads; one no listed family reads stays, for train.py to refuse."""
    flags = ["--preset", "test", "--block_size=8", "--anchors", "8", "--markov_rank=4", "--ttt_passes", "2", "--resume"]
    listed = ["eagle3", "dflash", "dspark"]
    assert bench_e2e_budget.family_flags(flags, "eagle3", listed) == ["--preset", "test", "--ttt_passes", "2",
                                                                      "--resume"]
    assert bench_e2e_budget.family_flags(flags, "dflash", listed) == ["--preset", "test", "--block_size=8",
                                                                      "--anchors", "8", "--resume"]
    assert bench_e2e_budget.family_flags(flags, "dspark", listed) == flags[:6] + ["--resume"]
    assert bench_e2e_budget.family_flags(flags, "dflash", ["dflash"]) == flags  # --markov_rank: refused by train.py
