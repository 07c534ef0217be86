"""Every point-to-point wait is bounded by --dist_timeout (parallel/waits.py): a stopped rank (SIGSTOP) makes its
peers fail with one line naming the rank and the wait, instead of hanging.

test_a_stopped_rank_fails_its_peers_with_the_wait_named: the real update (dist_step.DistCotrainer: the pipeline's
batches, ring attention, cp_shift, TapChannel) on a pp 2 x cp 2 mesh of 4 processes started with torchrun's env
contract and the real harness.mesh.make_mesh, --dist_timeout 10. One healthy step, then rank 2 stops itself and the
others run the next step. Each live rank must exit non-zero on its own; before the waits were bounded they waited on
sub-groups whose timeout was torch's 30 min default (new_group ignores init_process_group's timeout) and the test ran
into its 150 s limit. Adds ~45 s on 2 cores under a load average of ~13 (measured 42-50 s, ~20 s of it the 4
processes importing torch at once, ~8 s the healthy step, then the 10 s timeout). The other tests add < 0.1 s.
"""
import datetime
import os
import re
import signal
import socket
import subprocess
import sys
import time

import pytest
import torch
import torch.distributed as dist

from parallel import waits

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TIMEOUT_S = 10  # --dist_timeout of the stopped run
LIMIT_S = 150  # the test's own bound: far above TIMEOUT_S plus start-up and one step


class _Work:  # a torch Work stand-in: records the timeout it was given, raises what the backend would
    def __init__(self, error=None):
        self.error, self.timeouts = error, []

    def wait(self, timeout=None):
        self.timeouts.append(timeout)
        if self.error:
            raise self.error
        return True


def test_wait_all_names_the_rank_and_the_wait():
    ok, late = _Work(), _Work(RuntimeError("[unbound_buffer.cc:78] Timed out waiting 10000ms for recv operation"))
    with pytest.raises(waits.WaitTimeout, match=r"^rank 0: pipeline recv of activations for microbatch 3 from stage 0 "
                                                r"timed out after 1800 s \(--dist_timeout\)$"):
        waits.wait_all([ok, late], ["pipeline send of gradients for microbatch 1 to stage 0",
                                    "pipeline recv of activations for microbatch 3 from stage 0"])
    assert ok.timeouts[0] > datetime.timedelta(0)  # timedelta(0) would mean "no timeout" to torch
    dead = _Work(RuntimeError("[pair.cc:534] Connection closed by peer [127.0.0.1]:4242\nmore"))
    with pytest.raises(waits.WaitFailed, match=r"^rank 0: CP cp_shift: recv from rank 3, TapChannel x failed: "
                                               r"\[pair.cc:534\] Connection closed by peer \[127.0.0.1\]:4242$"):
        waits.wait_all([dead], ["CP cp_shift: recv from rank 3", "TapChannel x"])  # one Work for two: NCCL's batch
    with pytest.raises(ValueError, match="dist_timeout=0"):
        waits.set_timeout(0)


def test_nccl_waits_do_not_poll_gloo_waits_are_bounded():
    """The dispatch by backend: NCCL's works get a plain wait() (the stream waits; the watchdog bounds it), gloo's and
    those of no known backend (None) get a timeout; a failure is named the same way on both."""
    nccl, gloo, none = _Work(), _Work(), _Work()
    waits.wait_all([nccl], ["CP ring recv"], backend="nccl")
    waits.wait_all([gloo], ["CP ring recv"], backend="gloo")
    waits.wait_all([none], ["CP ring recv"])  # no backend known (no process group): bounded
    assert nccl.timeouts == [None]
    assert gloo.timeouts[0] > datetime.timedelta(0) and none.timeouts[0] > datetime.timedelta(0)
    late = _Work(RuntimeError("Watchdog caught collective operation timeout: WorkNCCL(SeqNum=7, OpType=RECV)"))
    with pytest.raises(waits.WaitTimeout, match=r"^rank 0: TapChannel recv timed out after 1800 s"):
        waits.wait_all([late], ["TapChannel recv"], backend="nccl")


def test_backend_of_reads_the_group_per_device_type(monkeypatch):
    """backend_of: a composite group ("cpu:gloo,cuda:nccl", what make_mesh creates on a GPU node) runs CUDA tensors on
    NCCL and CPU tensors on gloo; a group made with one name runs every device type it supports; no process group:
    None (a bounded wait). A tensor's device picks the entry."""
    import torch
    import torch.distributed as dist
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    for name, want in (("cpu:gloo,cuda:nccl", {"cuda": "nccl", "cpu": "gloo"}), ("nccl", {"cuda": "nccl", "cpu": None}),
                       ("gloo", {"cuda": "gloo", "cpu": "gloo"})):
        monkeypatch.setattr(dist, "get_backend", lambda group=None, name=name: name)
        got = {kind: waits.backend_of(None, kind) for kind in want}
        assert got == want, (name, got)
        assert waits.backend_of(object(), torch.device("cuda", 1)) == want["cuda"]
        assert waits.backend_of(object(), torch.zeros(1)) == want["cpu"]  # a CPU tensor
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    assert waits.backend_of(None, "cuda") is None


DRIVER = """
import os, signal, sys
sys.path[:0] = [{root!r}, {tests!r}]
import torch
from dist_step import DistCotrainer
from harness.config import parse_args
from harness.mesh import make_mesh
from parallel.waits import WaitFailed
from test_dist_step import grpo, make_batch, make_models, make_policy_opt
torch.set_num_threads(1)
cfg = parse_args(["--preset=test", "--model=mini", "--pp=2", "--cp=2", "--dist_timeout={timeout}"])  # a tied head,
# as make_models' policy has: the mesh makes the embedding group it needs
try:
    mesh = make_mesh(cfg)
    policy, drafts = make_models()
    ct = DistCotrainer(policy, drafts, mesh.grid, make_policy_opt)
    batch = make_batch(policy)
    ct.step(batch, grpo("global-token"), 4)
    print("step 1 done", flush=True)
    if mesh.rank == 2:
        os.kill(os.getpid(), signal.SIGSTOP)  # kill -STOP: alive, holding its connections, never answering
    ct.step(batch, grpo("global-token"), 4)
except WaitFailed as e:
    sys.exit(f"driver: {{e}}")
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_stopped_rank_fails_its_peers_with_the_wait_named(tmp_path):
    entry = tmp_path / "driver.py"
    entry.write_text(DRIVER.format(root=ROOT, tests=os.path.join(ROOT, "tests"), timeout=TIMEOUT_S))
    env = {**os.environ, "WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "4", "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(_free_port()), "OMP_NUM_THREADS": "1"}
    logs = [tmp_path / f"rank{r}.log" for r in range(4)]
    procs = [subprocess.Popen([sys.executable, str(entry)], cwd=ROOT, stdout=open(logs[r], "w"),
                              stderr=subprocess.STDOUT, env={**env, "RANK": str(r), "LOCAL_RANK": str(r)})
             for r in range(4)]
    live = [0, 1, 3]
    try:
        deadline = time.monotonic() + LIMIT_S
        while any(procs[r].poll() is None for r in live) and time.monotonic() < deadline:
            time.sleep(0.5)
        out = {r: logs[r].read_text() for r in range(4)}
        running = [r for r in live if procs[r].poll() is None]
        assert not running, f"ranks {running} still waiting {LIMIT_S} s after start (a hang); logs: {out}"
        assert all("step 1 done" in out[r] for r in range(4)), out  # the stop came after a healthy step
        assert procs[2].poll() is None  # rank 2 is still there, stopped: nobody saw it die
        assert all(procs[r].returncode != 0 for r in live), {r: procs[r].returncode for r in live}
        named = [re.search(rf"driver: rank {r}: (pipeline|CP|TapChannel) .+ timed out after {TIMEOUT_S} s "
                           r"\(--dist_timeout\)", out[r]) for r in live]
        assert any(named), out  # a rank may first wait in a collective (bounded by its group's timeout, unnamed)
    finally:
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGCONT)
                p.kill()
            p.wait()
