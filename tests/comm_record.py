"""Record the communication of a real train.py run, one trace per rank, for commcheck.nccl_check to replay.

    torchrun --standalone --nproc_per_node=8 tests/comm_record.py OUT --preset test --pp 2 --cp 4 --zero1 \
        --dtype bf16 --drafter dflash --ckpt_every 1 --steps 1 --out RUN --cache_dir CACHE
    # -> OUT/rank<r>.json.gz for every rank (commcheck.recorded.save / load)

Everything after OUT is train.py's command line; train.main runs unchanged while commcheck.comm_trace.CommRecorder
logs every torch.distributed call (the ring's exchanges, the pipeline's batches and TapChannel are batch_isend_irecv /
isend / irecv; ZeRO-1's all_gather, the reductions, refit's broadcasts, the rollout's gathers, the warm-up's and the
checkpoint's collectives) and every wait on their works, and a dispatch mode (sync_count.HostSyncs) logs the host
sync points between them. Group names come from the Grid the run builds. The build takes the GPU node's path (every
rank trains the uncached warm-ups together, harness.experiment.split_warmups), which on the CPU is left to rank 0 while
the others wait: give a fresh --cache_dir to record the warm-ups' collectives. The product has no switch for any of
this: the wrapper patches it from outside, for the tests only (tests/test_nccl_real.py).
"""
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.dirname(os.path.abspath(__file__))]

from commcheck.comm_trace import CommRecorder  # noqa: E402
from commcheck.recorded import save  # noqa: E402
from sync_count import HostSyncs  # noqa: E402


class _HostPoints(HostSyncs):
    """HostSyncs that logs each sync into the recorder's trace instead of counting it."""

    def __init__(self, rec):
        super().__init__()
        self.rec = rec

    def _add(self, name):
        self.rec.host_sync()


def main(argv):
    out, args = argv[0], argv[1:]
    import torch.distributed as dist

    import train
    from harness import experiment
    from parallel.grid import Grid
    experiment.split_warmups = lambda mesh: True  # the GPU node's build: the ranks split the warm-ups
    grids, build = [], Grid.build.__func__

    def named_build(cls, *a, **kw):  # keep the grid: its handles name the groups
        grids.append(build(cls, *a, **kw))
        return grids[-1]

    Grid.build = classmethod(named_build)
    rec = CommRecorder()
    try:
        with rec, _HostPoints(rec):
            train.main(args)
    finally:
        Grid.build = classmethod(build)
    names = {pg: name for g in grids for (name, _), pg in g.handles.items()}
    rank = int(os.environ.get("RANK", "0"))
    save(os.path.join(out, f"rank{rank}.json.gz"), rec.events(names))
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1:])
