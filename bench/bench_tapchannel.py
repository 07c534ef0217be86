"""How much does shipping the draft's taps cost a pipeline step? Four transports, side by side in one run.

PP = 4 gloo processes, 1F1B, M = 8 microbatches, a policy sized so that a step takes seconds on CPU. The draft hook
only touches the taps (no draft model), so every difference below is the transport's:

  (a) no_taps      the plain pipeline step: no taps at all (the floor)
  (b) tapchannel   TapChannel: async isend of detached taps on a group of their own, received by the last stage at F(m)
  (c) piggyback    taps concatenated onto the activation each stage sends on: hop s -> s+1 carries every tap of
                   stages <= s, on the critical path (gradients are not inflated: taps carry none)
  (d) blocking     a blocking send of each tap to the last stage inside F(m), on the pipeline group, placed *after*
                   the activation send -- the one place it cannot deadlock (before it, stage 0 would wait for the last
                   stage's recv while the last stage waits for stage 0's activation). Each source then stalls in F(m)
                   until the last stage reaches F(m), which starves the 1F1B warm-up.

Median of R steps per transport, the transports interleaved step by step (a b c d a b c d ...) so machine noise hits
them alike; a step's time is the slowest rank's, between a barrier and the end of PipelineSchedule.step. Also reported:
the median of the back-to-back ratios (a_i, b_i) ("paired"), and the CPU-seconds all ranks spent per step (process
time, gloo's threads included) -- the work a transport adds, which other load on a shared machine barely moves. Bytes
are what each stage sends per step (pipeline group + tap path). Caveat: with more processes than cores the stages do
not run concurrently as on real hardware, so stalls (d) are partly hidden by other stages' work.

    python bench/bench_tapchannel.py               # spawns 4 gloo processes; writes bench/results/tapchannel.{json,md}
    torchrun --standalone --nproc_per_node=4 bench/bench_tapchannel.py
"""
from __future__ import annotations

import json
import os
import platform
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from model import EMBED_TAP, ModelConfig, Transformer, default_tap_layers  # noqa: E402
from parallel.grid import Grid  # noqa: E402
from parallel.pp_schedule import split_layers  # noqa: E402
from pipeline import Microbatch, PipelineSchedule, build_stage  # noqa: E402
from parallel.cli import parser  # noqa: E402

PP, M = 4, 8
SEQS, SEQ_LEN = 2, 128  # per microbatch: T = 256 tokens
CFG = ModelConfig(vocab_size=1024, hidden_size=256, intermediate_size=768, num_hidden_layers=8,
                  num_attention_heads=8, num_key_value_heads=4)
MODES = ("no_taps", "tapchannel", "piggyback", "blocking")


class Piggyback(PipelineSchedule):
    """(c): F(m) on stage s sends [h_s; taps of stages <= s] as one (T (1 + k), H) tensor; B(m) is unchanged."""

    def __init__(self, *args, **kw):
        super().__init__(*args, **kw)
        self.channel = None  # taps travel with the activations instead
        a = self.stage.layer_range[0]
        self.upstream = tuple(l for l in self.tap_layers if l < a and not self.first)  # arrive with my input
        self._carried = {}

    def _recv_shape(self, m):
        return (1 + len(self.upstream)) * self._mbs[m].tokens.shape[0], self.H

    def _input(self, m, buf):
        T = self._mbs[m].tokens.shape[0]
        self._carried[m] = {l: buf[(i + 1) * T:(i + 2) * T] for i, l in enumerate(self.upstream)}
        return buf[:T].detach().requires_grad_()

    def _payload(self, m, out):
        carried = self._carried.pop(m, {})
        parts = [out.hidden.detach()] + [carried[l] for l in self.upstream] + [out.taps[l].detach()
                                                                                  for l in self.local_taps]
        return torch.cat(parts)  # the pack is a copy, part of the method's cost

    def _gather_taps(self, m, out):
        return dict(sorted({**self._carried.pop(m, {}), **{l: t.detach() for l, t in out.taps.items()}}.items()))


class Blocking(PipelineSchedule):
    """(d): each source blocks in F(m) until the last stage has received its taps, on the pipeline group."""

    def __init__(self, *args, **kw):
        super().__init__(*args, **kw)
        self.tapper, self.channel = self.channel, None  # keep TapChannel's bookkeeping (who owns what), not its path

    def _send_taps(self, m, out):  # after the activation's batch: the order that avoids the deadlock
        for l in self.tapper.layers_of[self.grid.pp_rank]:
            t = out.taps[l].detach().contiguous()
            dist.send(t, dst=self.grid.pp_ranks[-1], group=self.grid.pp_group)  # blocks until the last stage posts
            self._p2p_bytes += t.numel() * t.element_size()  # these do travel on the pipeline group

    def _gather_taps(self, m, out):
        taps = {l: t.detach() for l, t in out.taps.items()}
        for s in self.tapper.sources:
            for l in self.tapper.layers_of[s]:
                buf = torch.empty(self._mbs[m].tokens.shape[0], self.H, dtype=self.dtype)
                dist.recv(buf, src=self.grid.pp_ranks[s], group=self.grid.pp_group)
                taps[l] = buf
        return dict(sorted(taps.items()))


def batch(seed=0):
    g = torch.Generator().manual_seed(seed)
    mbs = []
    for _ in range(M):
        tok = torch.randint(CFG.vocab_size, (SEQS * SEQ_LEN,), generator=g)
        cu = torch.arange(0, SEQS * SEQ_LEN + 1, SEQ_LEN, dtype=torch.int32)
        lab = torch.roll(tok, -1).clone()
        lab[cu[1:].long() - 1] = -100
        mbs.append(Microbatch(tok, cu, None, {"labels": lab}))
    return mbs


def worker(rank, world, store_path, out_path, repeats):
    torch.set_num_threads(1)
    if store_path is not None:
        dist.init_process_group("gloo", store=dist.FileStore(store_path, world), rank=rank, world_size=world)
    grid = Grid.build(pp=PP)
    torch.manual_seed(0)
    split = split_layers(CFG.num_hidden_layers, PP)
    stage = build_stage(CFG, split[grid.pp_rank], Transformer(CFG).state_dict())
    taps = default_tap_layers(CFG.num_hidden_layers) + (EMBED_TAP,)
    mbs = batch()
    n = sum(int((mb.extra["labels"] >= 0).sum()) for mb in mbs)

    def loss_fn(logits, mb):
        return F.cross_entropy(logits, mb.extra["labels"], ignore_index=-100, reduction="sum") / n

    touched = []
    hook = lambda d: touched.append(sum(float(t[0, 0]) for t in d.taps.values()))  # noqa: E731  (reads every tap)
    scheds = {"no_taps": PipelineSchedule(stage, grid, split),
              "tapchannel": PipelineSchedule(stage, grid, split, tap_layers=taps),
              "piggyback": Piggyback(stage, grid, split, tap_layers=taps),
              "blocking": Blocking(stage, grid, split, tap_layers=taps)}
    times, cpu = {k: [] for k in MODES}, {k: [] for k in MODES}
    nbytes = {}
    for rep in range(repeats + 1):  # rep 0 warms up every path
        for mode in MODES:
            dist.barrier()
            t0, c0 = time.perf_counter(), time.process_time()
            res = scheds[mode].step(mbs, loss_fn, None if mode == "no_taps" else hook)
            dt = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
            dc = torch.tensor([time.process_time() - c0], dtype=torch.float64)  # all threads, incl. gloo's
            dist.all_reduce(dt, op=dist.ReduceOp.MAX)  # a step lasts until its slowest rank is done
            dist.all_reduce(dc)  # CPU-seconds of the whole pipeline: barely moved by other load on the machine
            if rep:
                times[mode].append(float(dt))
                cpu[mode].append(float(dc))
            sent = res.p2p_bytes + res.tap_bytes
            per_stage = [None] * PP
            dist.all_gather_object(per_stage, sent)
            nbytes[mode] = per_stage
    if rank == 0:
        report(times, cpu, nbytes, taps, split, out_path)
    dist.destroy_process_group()


def report(times, cpu, nbytes, taps, split, out_path):
    med = {k: statistics.median(v) for k, v in times.items()}
    res = {
        "no_taps_s": med["no_taps"], "tapchannel_s": med["tapchannel"], "piggyback_s": med["piggyback"],
        "blocking_s": med["blocking"],
        "overhead_tapchannel": med["tapchannel"] / med["no_taps"],
        "overhead_piggyback": med["piggyback"] / med["no_taps"],
        "overhead_blocking": med["blocking"] / med["no_taps"],
        # the same ratios from the steps run back to back (a_i, b_i, c_i, d_i): less sensitive to slow drifts in load
        "paired_overhead": {k: statistics.median(x / y for x, y in zip(times[k], times["no_taps"])) for k in MODES},
        # their spread: the quartiles of the back-to-back ratios (a noisy shared machine moves single steps a lot)
        "paired_overhead_q1_q3": {k: _quartiles([x / y for x, y in zip(times[k], times["no_taps"])]) for k in MODES},
        "bytes_per_stage_per_step": nbytes,
        "tap_bytes_per_step": {k: sum(v) - sum(nbytes["no_taps"]) for k, v in nbytes.items()},
        "step_times_s": times,
        "cpu_s_median": {k: statistics.median(v) for k, v in cpu.items()},  # summed over the 4 ranks
        "cpu_overhead": {k: statistics.median(v) / statistics.median(cpu["no_taps"]) for k, v in cpu.items()},
        "step_cpu_s": cpu,
        "config": {"pp": PP, "microbatches": M, "schedule": "1f1b", "tokens_per_microbatch": SEQS * SEQ_LEN,
                   "hidden": CFG.hidden_size, "layers": CFG.num_hidden_layers, "split": split, "taps": list(taps),
                   "repeats": len(times["no_taps"]), "dtype": "float32"},
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "torch": torch.__version__,
                    "load_avg_1m_at_end": os.getloadavg()[0]},
    }
    rows = ["| transport | step, median s | vs no taps | paired ratio | paired q1..q3 | CPU-s, all ranks | "
            "vs no taps | MiB sent per stage per step (s0..s3) |", "|---|---|---|---|---|---|---|---|"]
    for k in MODES:
        mib = ", ".join(f"{b / 2**20:.1f}" for b in nbytes[k])
        q1, q3 = res["paired_overhead_q1_q3"][k]
        rows.append(f"| {k} | {med[k]:.3f} | {med[k] / med['no_taps']:.3f} | {res['paired_overhead'][k]:.3f} | "
                    f"{q1:.3f}..{q3:.3f} | "
                    f"{res['cpu_s_median'][k]:.2f} | {res['cpu_overhead'][k]:.3f} | {mib} |")
    table = "\n".join(rows)
    print(table)
    ok = res["overhead_tapchannel"] <= 1.05 and med["tapchannel"] < med["piggyback"]
    print(f"target b/a <= 1.05 and b < c: {'met' if ok else 'NOT met'}")
    os.makedirs(os.path.dirname(out_path), exist_ok=True)
    with open(out_path, "w") as f:
        json.dump(res, f, indent=1)
    plot(times, out_path.replace(".json", ".png"))
    with open(out_path.replace(".json", ".md"), "w") as f:
        f.write(f"`python bench/bench_tapchannel.py` -- PP={PP} gloo processes on {os.cpu_count()} CPUs, 1F1B, "
                f"M={M}, T={SEQS * SEQ_LEN} tokens/microbatch, H={CFG.hidden_size}, {CFG.num_hidden_layers} layers, "
                f"taps {list(taps)}, median of {len(times['no_taps'])} interleaved steps\n\n{table}\n")


def _quartiles(xs):
    q = statistics.quantiles(xs, n=4) if len(xs) > 1 else [xs[0]] * 3
    return q[0], q[2]


def plot(times, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(6, 3.2))
    base = statistics.median(times["no_taps"])
    for i, k in enumerate(MODES):
        r = [t / base for t in times[k]]
        ax.bar(i, statistics.median(r), color="#bbb" if k == "no_taps" else "#4c72b0", width=0.6)
        ax.plot([i] * len(r), r, "k.", ms=3)
    ax.axhline(1.05, ls="--", c="r", lw=0.8, label="target for TapChannel: 1.05")
    ax.set_xticks(range(len(MODES)), MODES)
    ax.set_ylabel("step time / median no-taps step")
    ax.set_title(f"PP={PP}, 1F1B, M={M}: cost of shipping the taps (bars: median, dots: steps)", fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv=None):
    ap = parser(__doc__, __file__)
    ap.add_argument("--repeats", type=int, default=15, help="measured steps per transport (after one warm-up)")
    ap.add_argument("--out", default=os.path.join(ROOT, "bench", "results", "tapchannel.json"),
                    help="the JSON written (the markdown table beside it)")
    args = ap.parse_args(argv)
    if args.repeats < 1:
        raise ValueError(f"--repeats={args.repeats}: expected >= 1")
    if "WORLD_SIZE" in os.environ:  # torchrun
        dist.init_process_group("gloo")
        worker(dist.get_rank(), dist.get_world_size(), None, args.out, args.repeats)
    else:
        with tempfile.TemporaryDirectory() as tmp:
            mp.spawn(worker, args=(PP, os.path.join(tmp, "store"), args.out, args.repeats), nprocs=PP)


if __name__ == "__main__":
    from parallel.cli import run_main  # an error: one line, exit 1 (COSPEC_TRACEBACK=1: the traceback)
    run_main(main, __file__)
