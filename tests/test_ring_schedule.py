"""attention_cp's ring demo table (ring_schedule / print_ring, from step_segments) against the dense causal rule.

Over the cp steps of the zigzag ring, query chunk a of one sequence must see every key chunk b < a whole, its own
chunk as its lower triangle, no b > a, and each chunk at exactly one step; step 0 is the rank's own K/V. The printed
table has one row per (rank, step), naming the chunks step_segments gives. ~1 s on a shared 2-core CPU (9 tests).
"""
import pytest

from attention_cp import print_ring, ring_schedule


@pytest.mark.parametrize("cp", [1, 2, 3, 4])
@pytest.mark.parametrize("C", [2, 3])
def test_the_ring_covers_the_causal_mask_once(cp, C):
    table = ring_schedule(cp, C)
    assert sorted(table) == [(r, t) for r in range(cp) for t in range(cp)]
    for r in range(cp):
        assert set(table[r, 0]) == {r, 2 * cp - 1 - r}  # the zigzag pair
        for a in (r, 2 * cp - 1 - r):
            got = {}
            for t in range(cp):
                src = (r - t) % cp
                for b, how in table[r, t][a].items():
                    assert b in (src, 2 * cp - 1 - src), (r, t, a, b)  # only the K/V held at step t
                    assert b not in got, f"rank {r} q chunk {a}: key chunk {b} seen twice"
                    got[b] = how
            assert got == {**{b: "all" for b in range(a)}, a: "causal"}, (cp, r, a, got)


def test_the_printed_cp2_table(capsys):
    print_ring(2)
    rows = [line.strip() for line in capsys.readouterr().out.splitlines()[1:]]
    assert rows == ["rank 0 (chunks 0, 3)  step 0, its own K/V: q chunk 0 sees 0 (causal); q chunk 3 sees 0 (all), "
                    "3 (causal)",
                    "step 1, rank 1's chunks 1, 2: q chunk 0 sees nothing; q chunk 3 sees 1 (all), 2 (all)",
                    "rank 1 (chunks 1, 2)  step 0, its own K/V: q chunk 1 sees 1 (causal); q chunk 2 sees 1 (all), "
                    "2 (causal)",
                    "step 1, rank 0's chunks 0, 3: q chunk 1 sees 0 (all); q chunk 2 sees 0 (all)"]
