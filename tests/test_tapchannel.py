"""TapChannel on its own, over 3 real gloo processes (stages 0 and 1 send, stage 2 is the draft's stage).

Sources run far ahead of the last stage, which posts each microbatch's receives only when it gets to it (the sources'
extra isends stay pending and must still land in the right place), microbatch sizes vary, the slots are reused by a
second step with larger microbatches, taps of the last stage come back in place, posts and receives out of order are
refused, and every delivered tap equals what its source sent, bitwise."""
import time

import pytest
import torch
from dist_util import run_distributed

from model import EMBED_TAP
from tapchannel import TapChannel, tap_owners

SPLIT = [(0, 1), (1, 2), (2, 3)]
TAPS = (EMBED_TAP, 0, 1, 2)  # stage 0: -1 and 0; stage 1: 1; stage 2 (last): 2, used in place
H = 4


def tap_value(step, m, layer, T):  # what source of `layer` sends for microbatch m: distinct everywhere
    return torch.arange(T * H, dtype=torch.float64).view(T, H) + 1000 * step + 100 * m + layer


def _worker(rank, world, steps):
    import torch.distributed as dist
    group = dist.new_group([0, 1, 2])  # a communicator of its own, as Grid.build's tap_group
    ch = TapChannel(group, [0, 1, 2], rank, SPLIT, TAPS)
    checked = 0
    for step, sizes in enumerate(steps):
        if rank < 2:  # sources: send every microbatch at once, never waiting (the last stage posts one at a time)
            for m, T in enumerate(sizes):
                ch.send(m, {l: tap_value(step, m, l, T).requires_grad_() for l in ch.layers_of[rank]})
        else:
            ch.begin(sizes, H, torch.float64, "cpu")
            time.sleep(0.2)  # let the sources run ahead of the last stage
            if step == 0:
                with pytest.raises(RuntimeError, match="in order"):
                    ch.recv(0, {})  # not posted yet
                with pytest.raises(RuntimeError, match="expected microbatch 0"):
                    ch.post(1)
            for m, T in enumerate(sizes):
                local = {2: tap_value(step, m, 2, T)}
                ch.post(m)
                got = ch.recv(m, local)
                if step == 0 and m == 0:
                    with pytest.raises(RuntimeError, match="expected microbatch 1"):
                        ch.post(1)  # m's taps are views into the slots until release(m)
                assert list(got) == sorted(TAPS)
                assert got[2].data_ptr() == local[2].data_ptr()  # the last stage's own tap: in place, no copy
                for layer, t in got.items():
                    assert not t.requires_grad and torch.equal(t, tap_value(step, m, layer, T)), (step, m, layer)
                    checked += 1
                ch.release(m)
        ch.finish()
    return checked, ch.bytes_sent


def test_tapchannel_ring_delivers_every_microbatch_bitwise():
    steps = [[3, 5, 2, 4, 6], [7, 8, 9]]  # then a second step with larger microbatches
    res = run_distributed(_worker, 3, args=(steps,), timeout=60)
    M = sum(len(s) for s in steps)
    assert res[2][0] == M * len(TAPS)
    tokens = sum(sum(s) for s in steps)
    assert res[0][1] == 2 * tokens * H * 8 and res[1][1] == tokens * H * 8 and res[2][1] == 0  # bytes: each tap once


def test_tap_owners():
    assert tap_owners(SPLIT, TAPS) == {EMBED_TAP: 0, 0: 0, 1: 1, 2: 2}
    with pytest.raises(ValueError, match="out of range"):
        tap_owners(SPLIT, (3,))
