"""Where this process sits: the DP x PP x CP mesh of a run, built once, and the device its models live on.

One process is a 1 x 1 x 1 mesh -- a plain program: no process group, no torchrun, every collective of a group of size 1
skipped (picotron's single grid). Under torchrun (WORLD_SIZE > 1) the process group is made here and nowhere else, and
grid.Grid derives every sub-group from it (and creates every communicator up front, in one order). This is the only
place where the run's mode shows:

    world size 1      Mesh(grid = Grid(), rank 0)                    python train.py
    world size N      dist.init_process_group + Grid.build(pp, cp, dp)  torchrun --nproc_per_node=N train.py

Roles that follow from the grid: rank 0 prints and writes files (`main`); EVERY rank generates: a step's rollout rows
(and the eval's, the offline arm's samples) are cut into blocks of the engine's batch, and block j goes to rank
j mod world (`row_blocks`), generated from that rank's full policy + draft copy, then gathered (`gather_all`). The cut
depends on the row count and the block size alone, so each block is the same generate call on every mesh: with the
per-row random streams (decoding/row_streams.py) a step's tokens and log-probs are bit-identical on any mesh.
"""
from __future__ import annotations

import contextlib
import datetime
import os
import socket
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from parallel.grid import Grid
from parallel.waits import WaitFailed, WaitTimeout, set_timeout, timeout

if TYPE_CHECKING:
    from harness.config import Config


class PhaseTimeout(WaitTimeout):
    """A barrier of a named phase that ended without every rank (train.py prints it as one line)."""


@dataclass
class Mesh:
    grid: Grid
    device: torch.device
    rank: int = 0
    world: int = 1
    local_rank: int = 0  # this process's index on its node (torchrun's LOCAL_RANK)
    local_world: int = 1  # processes on its node (LOCAL_WORLD_SIZE)

    @property
    def main(self) -> bool:  # evaluates, prints, writes files
        return self.rank == 0

    def blocks(self, n_rows: int, size: int) -> list:
        """This rank's blocks of n_rows rows (row_blocks)."""
        return row_blocks(n_rows, size, self.rank, self.world)

    def barrier(self, phase: str = ""):
        """Wait for every rank. phase: what the others wait for (work one rank does alone, e.g. "rank 0 building the
        warm-ups"): a barrier that outlives --dist_timeout, or whose peers left, then ends in PhaseTimeout, one line
        that names this rank, the phase and the ranks it waited for, not in a traceback."""
        if self.world <= 1:
            return
        try:
            dist.barrier()
        except Exception as e:  # noqa: BLE001 - gloo raises RuntimeError, NCCL DistBackendError
            if not phase:
                raise
            raise self._ended(phase, e) from e

    @contextlib.contextmanager
    def phase(self, phase: str):
        """Work every rank does together (e.g. the warm-ups split over the ranks): a collective inside that fails
        (parallel.waits.WaitFailed: a peer stopped, or past --dist_timeout) ends in PhaseTimeout, one line naming
        this rank, the phase and the other ranks, as a failed barrier does."""
        try:
            yield
        except WaitFailed as e:
            if isinstance(e, PhaseTimeout) or self.world <= 1:
                raise
            raise self._ended(phase, e) from e

    def _ended(self, phase: str, e: Exception) -> PhaseTimeout:
        others = ", ".join(str(r) for r in range(self.world) if r != self.rank)
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        return PhaseTimeout(f"rank {self.rank}: {phase}: the wait for rank(s) {others} ended after at most "
                            f"{timeout().total_seconds():g} s (--dist_timeout) without them ({first[:160]}); raise "
                            "--dist_timeout, or pre-build the warm-ups (python -m harness.warmup)")

    def turns(self) -> int:
        """How many turns a node's processes take to load a checkpoint one at a time: each builds it on the host
        before moving it to its device, so on GPUs one process per node at a time (~1 host copy per node); on the
        CPU the copies stay on the host anyway (1: all at once)."""
        return self.local_world if self.device.type == "cuda" else 1

    def close(self):
        """The normal end of a run: the ranks leave together, so none tears down its connections while another still
        works (rank 0 alone writes the servables and the summary). A failing run never gets here."""
        if self.world > 1:
            dist.barrier()
            dist.destroy_process_group()

    def describe(self) -> str:
        g = self.grid
        if self.world == 1:
            return f"one process, models on {self.device}"
        return (f"mesh: dp={g.dp} x pp={g.pp} x cp={g.cp} = {self.world} ranks, models on {self.device.type} "
                f"({'NCCL' if self.device.type == 'cuda' else 'gloo'})")


def row_blocks(n_rows: int, size: int, rank: int, world: int) -> list:
    """Rows 0..n_rows-1 cut into blocks of `size` (the last one shorter); block j goes to rank j mod world. Returns
    this rank's blocks as (j, range of rows). Ranks past the number of blocks get none (size > n_rows / world)."""
    n_blocks = -(-n_rows // size)
    return [(j, range(j * size, min(n_rows, (j + 1) * size))) for j in range(rank, n_blocks, world)]


def gather_all(obj) -> list:
    """Every rank's obj, in rank order, on every rank (all_gather_object: picklable host data); [obj] in one
    process."""
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return [obj]
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def rank_world() -> tuple:
    """(rank, world size) of this process: (0, 1) without a process group."""
    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def pick_device(cfg: Config) -> torch.device:
    """Where this process's models live. The process is local rank r = LOCAL_RANK of the n = LOCAL_WORLD_SIZE processes
    on its node (torchrun's env; 0 of 1 without it) and sees g = torch.cuda.device_count() GPUs:

        --device cpu, or auto without CUDA   the CPU
        g >= n                               cuda:r   every process sees the node's GPUs (torchrun): rank r takes GPU r
        g == 1                               cuda:0   each process is bound to its own GPU (CUDA_VISIBLE_DEVICES with
                                                      one device per process, e.g. SLURM's --gpus-per-task=1)
        else (1 < g < n)                     ValueError: no rank can be given its own GPU

    auto and cuda alike: with CUDA present a rank never falls back to the CPU (NCCL cannot share a GPU between ranks;
    --device cpu runs on the CPU on purpose). The error is one line naming LOCAL_RANK, LOCAL_WORLD_SIZE, g and
    CUDA_VISIBLE_DEVICES, and what to do. Under g == 1 two ranks could still be bound to one GPU: make_mesh checks
    that every rank of a host holds a different GPU once the process group exists (shared_gpus)."""
    if cfg.device == "cpu" or not torch.cuda.is_available():  # Config rejects device="cuda" without CUDA
        return torch.device("cpu")
    n_local, g = int(os.environ.get("LOCAL_WORLD_SIZE", "1")), torch.cuda.device_count()
    r = int(os.environ.get("LOCAL_RANK", "0"))
    if g >= n_local:
        return torch.device("cuda", r)
    if g == 1:
        return torch.device("cuda", 0)
    cvd = os.environ.get("CUDA_VISIBLE_DEVICES")
    raise ValueError(f"--device={cfg.device}: LOCAL_RANK={r} of LOCAL_WORLD_SIZE={n_local} processes on this node sees "
                     f"{g} GPUs" + (f" (CUDA_VISIBLE_DEVICES={cvd})" if cvd is not None else "") + ", so not every "
                     f"rank can have its own GPU; launch at most {g} processes per node, or bind one GPU to each "
                     "process (CUDA_VISIBLE_DEVICES), or run on the CPU on purpose with --device cpu")


def shared_gpus(seen: list) -> str | None:
    """seen[rank] = (host, GPU uuid) of every rank: None when no two ranks of a host hold the same GPU, else a line
    naming the first GPU held twice, its host and its ranks."""
    holders = {}
    for rank, key in enumerate(seen):
        holders.setdefault(tuple(key), []).append(rank)
    for (host, uuid), ranks in holders.items():
        if len(ranks) > 1:
            return (f"--device: ranks {', '.join(map(str, ranks))} on host {host} share one GPU ({uuid}); each rank "
                    "needs its own GPU (NCCL cannot share one): launch at most one process per visible GPU, or run on "
                    "the CPU on purpose with --device cpu")
    return None


def tied_head(cfg: Config) -> bool:
    """Is the policy's LM head its embedding: the --model preset's, or the HF checkpoint's config.json (read, no
    weights)."""
    from model import PRESETS
    if cfg.model in PRESETS:
        return PRESETS[cfg.model].tie_word_embeddings
    from serving.hf_io import config_from_hf, read_json
    path = os.path.join(cfg.model, "config.json")
    return config_from_hf(read_json(path), source=path).tie_word_embeddings


def model_dtype(cfg: Config, device: torch.device) -> torch.dtype:
    """--dtype: "auto" is bf16 on CUDA and fp32 on the CPU (where bf16 matmuls are many times slower). Under fp32 on
    CUDA, matmuls and the Triton kernel's dots may use TF32 (set here, process-wide)."""
    dt = {"bf16": torch.bfloat16, "fp32": torch.float32}.get(cfg.dtype)
    dt = dt or (torch.bfloat16 if device.type == "cuda" else torch.float32)
    if dt == torch.float32 and device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    return dt


def make_mesh(cfg: Config) -> Mesh:
    """WORLD_SIZE 1 (or unset): the 1 x 1 x 1 mesh. Else torchrun's env contract (RANK, WORLD_SIZE, LOCAL_RANK,
    MASTER_ADDR/PORT) -> process group (gloo for CPU tensors, NCCL for CUDA ones) and the DP x PP x CP grid. Every
    collective and point-to-point wait (every sub-group's too) waits at most cfg.dist_timeout s, so a dead or stopped
    rank makes its peers fail instead of hang. A device no rank can own, or an --attn_backend it cannot run, ends
    the run here, before any model is built (pick_device, Config.attn_backend_on)."""
    dev = pick_device(cfg)
    cfg.attn_backend_on(dev)  # refuses a backend this device cannot run; the build resolves it again (cheap)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world == 1:
        return Mesh(Grid(), dev)
    dp = cfg.dp or world // (cfg.pp * cfg.cp)
    if cfg.pp * cfg.cp * dp != world:
        raise ValueError(f"mesh: pp={cfg.pp} x cp={cfg.cp} x dp={dp} = {cfg.pp * cfg.cp * dp} != world size {world} "
                         f"(torchrun processes); set --pp, --cp, --dp so that their product is {world}")
    if cfg.micro_batches < dp or cfg.prompts_per_step < dp:
        raise ValueError(f"dp={dp}: needs micro_batches >= dp and prompts_per_step >= dp (got {cfg.micro_batches}, "
                         f"{cfg.prompts_per_step}): every DP replica takes whole micro-batches and whole prompt groups")
    if dev.type == "cuda":  # NCCL wants the process's current device set before its first collective
        torch.cuda.set_device(dev)
    backend = "cpu:gloo,cuda:nccl" if torch.cuda.is_available() else "gloo"
    dist.init_process_group(backend, timeout=datetime.timedelta(seconds=cfg.dist_timeout))
    if dev.type == "cuda":  # before any NCCL communicator: every rank gathers the same list and raises the same line
        problem = shared_gpus(gather_all((socket.gethostname(), str(torch.cuda.get_device_properties(dev).uuid))))
        if problem:
            raise ValueError(problem)
    set_timeout(cfg.dist_timeout)  # every sub-group and point-to-point wait too (parallel/waits.py)
    return Mesh(Grid.build(pp=cfg.pp, cp=cfg.cp, dp=dp, device=dev, tied=tied_head(cfg)), dev, dist.get_rank(), world,
                int(os.environ.get("LOCAL_RANK", "0")), int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
