"""An HF checkpoint is loaded by one process per node at a time on GPUs (experiment.in_turns), all at once on the CPU.

Each rank's code runs in a thread of this process, the mesh's barrier a threading.Barrier, and a fake loader records
which ranks are loading at once. Then Mesh.phase: a failed collective inside the build (the split warm-ups' on GPUs)
ends in one line naming the rank, the phase and the others. Adds ~1 s.
"""
import threading
import time

import pytest
import torch

from harness.experiment import in_turns
from harness.mesh import Mesh, PhaseTimeout
from parallel.grid import Grid
from parallel.waits import WaitFailed


class ThreadMesh(Mesh):
    """A Mesh whose barrier is a threading.Barrier shared by the ranks' threads."""
    gate: threading.Barrier = None

    def barrier(self, phase: str = ""):
        assert phase.startswith("loading, local rank")
        self.gate.wait(timeout=30)


def run(world: int, local_world: int, device: str, together: bool = False) -> tuple:
    """in_turns on `world` thread-ranks, `local_world` per node. Returns (the most loads in flight on one node, the
    most in flight in all, every rank's result). together: each load waits until every rank is loading (a rank whose
    load was ordered after another's then fails: no result)."""
    gate, lock, inside = threading.Barrier(world), threading.Lock(), threading.Barrier(world)
    busy, peak_node, peak_all, out = {}, [0], [0], {}

    def load(rank):
        node = rank // local_world
        with lock:
            busy[node] = busy.get(node, 0) + 1
            peak_node[0] = max(peak_node[0], busy[node])
            peak_all[0] = max(peak_all[0], sum(busy.values()))
        if together:
            inside.wait(timeout=10)
        else:
            time.sleep(0.02)  # a load long enough that an unordered peer would overlap it
        with lock:
            busy[node] -= 1
        return f"model of rank {rank}"

    def rank_main(rank):
        mesh = ThreadMesh(Grid(), torch.device(device), rank, world, rank % local_world, local_world)
        mesh.gate = gate
        out[rank] = in_turns(mesh, lambda: load(rank), "loading")

    threads = [threading.Thread(target=rank_main, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    return peak_node[0], peak_all[0], out


def test_gpu_ranks_load_one_per_node_at_a_time():
    peak_node, peak_all, out = run(world=4, local_world=2, device="cuda")  # 2 nodes of 2 GPUs
    assert peak_node == 1 and peak_all <= 2
    assert out == {r: f"model of rank {r}" for r in range(4)}
    peak_node, _, out = run(world=4, local_world=4, device="cuda")  # one node of 4
    assert peak_node == 1 and len(out) == 4


def test_cpu_ranks_load_at_once_and_one_process_just_loads():
    peak_node, _, out = run(world=3, local_world=3, device="cpu", together=True)
    assert peak_node == 3 and len(out) == 3  # no turns: the copies stay on the host anyway
    assert in_turns(None, lambda: 7, "loading") == 7


def test_a_failed_collective_in_a_phase_is_one_line_naming_the_phase_and_ranks():
    mesh = Mesh(Grid(), torch.device("cpu"), 1, 3, 1, 3)
    with pytest.raises(PhaseTimeout, match=r"^rank 1: build: x: the wait for rank\(s\) 0, 2 ended .*--dist_timeout.*"
                                           r"warm-up gradient sum"):
        with mesh.phase("build: x"):
            raise WaitFailed("rank 1: warm-up gradient sum (all_reduce) failed (Connection closed by peer)")
    with pytest.raises(ValueError, match="not a wait"):  # anything else passes through as it is
        with mesh.phase("build: x"):
            raise ValueError("not a wait")
