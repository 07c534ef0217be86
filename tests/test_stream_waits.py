"""On a GPU node no ring hop, pipeline batch or TapChannel wait blocks the host: each is a stream wait (a plain
Work.wait(), no timeout), decided per transfer by parallel.waits.backend_of from the group and the tensor's device.

The step runs for real on 4 gloo processes (pp 2 x cp 2: the pipeline's batches, ring attention inside both stages,
the draft hook's cp_shift on the CP ring, TapChannel's receives and its sends' final wait), its works wrapped by
commcheck.comm_trace.CommRecorder, which keeps the timeout each wait() was given. Twice on the same mesh:

    plain gloo                        every wait is bounded (timeout = --dist_timeout): the control
    a composite "device:backend"      the form make_mesh creates on a GPU node, "cpu:gloo,cuda:nccl", with the CPU
    group, NCCL for the step's        (which stands in for the GPU in this suite) in CUDA's place: "cuda:gloo,cpu:nccl".
    device                            Every wait must be a stream wait.

Fails on the waits that compared dist.get_backend() with "nccl" (a composite string never equals it): there every one
of the step's waits took the polling path (Work.wait(timeout)). Adds ~6 s (one spawn of 4 processes, two steps of a
tiny 8-layer policy; measured on 2 cores with another engineer's tests running beside it, so noisy).
"""
import torch
import torch.distributed as dist
import torch.nn.functional as F
from dist_util import run_distributed

from commcheck.comm_trace import CommRecorder
from model import EMBED_TAP, ModelConfig, Transformer, default_tap_layers

N_LAYERS = 8
TAPS = default_tap_layers(N_LAYERS) + (EMBED_TAP,)
GPU_NODE = "cuda:gloo,cpu:nccl"  # make_mesh's "cpu:gloo,cuda:nccl", the CPU standing in for the GPU
WHAT = {"pp": "pipeline batch", "cp": "ring hop", "tap": "TapChannel"}


def _steps(rank, world):
    from branch_mask import cp_shift
    from parallel.grid import Grid
    from parallel.pp_schedule import split_layers
    from pipeline import PipelineSchedule, build_stage, shard_for_cp
    from test_pipeline_dist import make_batch
    cfg = ModelConfig.preset("tiny", num_hidden_layers=N_LAYERS)
    torch.manual_seed(0)
    full = Transformer(cfg)
    grid = Grid.build(pp=2, cp=2)
    split = split_layers(N_LAYERS, 2)
    stage = build_stage(cfg, split[grid.pp_rank], full.state_dict())
    mbs = [shard_for_cp(mb, 2, grid.cp_rank, {"labels": -100}) for mb in make_batch(cfg, 3, 7)]
    sched = PipelineSchedule(stage, grid, split, tap_layers=TAPS)
    names = {pg: name for (name, _), pg in grid.handles.items()}

    def hook(d):  # a draft that talks on the CP ring, as the real ones do
        x = d.hidden.clone().requires_grad_()
        return (cp_shift(x, d.mb.cu_seqlens, 1, group=grid.cp_group)[0] * sum(d.taps.values())).mean() * 0

    out, real = {}, dist.get_backend
    for label, backend in (("gloo", None), ("gpu node", GPU_NODE)):
        if backend is not None:
            dist.get_backend = lambda group=None: backend  # every group reports the composite string
        try:
            with CommRecorder() as rec:
                sched.step(mbs, lambda logits, mb: F.cross_entropy(logits, mb.extra["labels"], ignore_index=-100),
                           hook)
        finally:
            dist.get_backend = real
        group_of = {ev[1]: names.get(ev[3][0]) for ev in rec.raw if ev[0] == "call"}
        out[label] = [(WHAT[group_of[cid]], t) for cid, ts in rec.wait_timeouts.items() for t in ts
                      if group_of[cid] in WHAT]
    return out


def test_no_host_wait_per_transfer_on_a_gpu_node():
    res = run_distributed(_steps, 4, timeout=180)
    for rank in range(4):
        gloo, gpu = res[rank]["gloo"], res[rank]["gpu node"]
        kinds = {what for what, _ in gloo}
        assert {"pipeline batch", "ring hop"} <= kinds, (rank, kinds)  # every rank: a stage with CP inside
        assert rank not in (2, 3) or "TapChannel" in kinds  # the last stage waits on the taps it receives
        assert gloo and all(t is not None and t.total_seconds() > 0 for _, t in gloo), (rank, gloo)  # the control
        assert sorted(w for w, _ in gpu) == sorted(w for w, _ in gloo), rank  # the same waits ...
        polled = [w for w, t in gpu if t is not None]
        assert polled == [], (rank, f"{len(polled)} of {len(gpu)} waits polled the host", polled[:5])  # ... none polls
