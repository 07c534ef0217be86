"""The memory of the draft's whole training step (not attention alone), measured per rank over gloo CPU processes.

One step of the last pipeline stage's losses on T packed tokens (sequences of `seq_len`), vocabulary V, cp ranks in the
zigzag layout, P = 3 TTT passes. Methods, side by side:

  old           draft: TTT forward (ring attention) + the previous dense loss (draft_loss.dense_pass_losses: (T, V)
                log_softmax, a shifted copy per pass, ...) + backward through the ring; teacher logits (T, V) as input
  stream        the same step with the streamed loss (draft_loss.StreamingSoftCE), teacher logits as input
  fused         the streamed loss with the fused teacher: input is the policy's final hidden (T, H) + its LM head
  gather        the gather-to-full-length baseline: taps, tokens and the teacher's hidden all-gathered on every rank,
                the draft run at full length (streamed loss, fused teacher), its grads divided by cp
  policy        the policy's GRPO log-prob loss, unfused: logits = hidden W^T (T, V), log-prob, backward
  policy_fused  the same with fused_logprob.token_logp (chunked, recomputed in backward)
  step_fused    policy_fused + fused in one measurement: the last stage's losses with no (T, V) tensor anywhere

Memory = growth of the rank process's peak RSS during the step over what it held just before (inputs built, gc +
malloc_trim, VmHWM reset by `echo 5 > /proc/self/clear_refs`, VmRSS read); after the step, growth = VmHWM - baseline,
max over ranks. glibc's mmap threshold is pinned at 128 KiB so RSS follows live tensors. `total` = VmHWM itself
(inputs, model and gloo included). Inputs (teacher logits or hidden, taps) are not in the growth, as the issue defines.
The chunk is the byte budget's (--chunk_mib, default 256: rows = 256 MiB / 4V, 441 at V = 151936, 2048 at V = 32768;
fused_logprob.budget_rows), the same bytes per chunk at every V. Seconds: wall time of the step, max over ranks.

    python bench/bench_draft_step.py            # ~21 min on 2 shared cores; bench/results/draft_step.{json,md,png}
    python bench/bench_draft_step.py --quick    # ~1 min; bench/results/draft_step_quick.{json,md,png}
    python bench/bench_draft_step.py --replot   # table and plot again from the JSON
    python bench/bench_draft_step.py --long_vocab   # ~11 min: adds the T = 64K, V = 32K rows (cp 1 and 4) to the JSON
    python bench/bench_draft_step.py --vocab_ratio --T 512 --repeats 2 [--chunk_mib 256]
                                                # step_fused at V = 151936 and 32768, interleaved (a fresh pair of
                                                # processes per repeat, the order alternating): seconds and their ratio
                                                # -> bench/results/draft_step_vocab_ratio_<M>mib.json

Letters: T tokens (all ranks), T_l = T / cp, H hidden, V vocabulary, P passes, cp CP size.
"""
from __future__ import annotations

import ctypes
import gc
import json
import os
import platform
import statistics
import sys
import tempfile
import time
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from branch_mask import cu_seqlens_from_lengths, zigzag_index, zigzag_shard, zigzag_unshard  # noqa: E402
from draft import DraftConfig, Eagle3Draft  # noqa: E402
from backends.fused_logprob import token_logp  # noqa: E402
from branch_mask import cp_shift  # noqa: E402
from draft_loss import chunk_rows, dense_pass_losses, make_teacher, pass_targets, streaming_pass_losses  # noqa: E402
from parallel.cli import parser  # noqa: E402
from parallel.ring import as_ring  # noqa: E402

H, HEADS, HEAD_DIM, INTER, P, TAPS = 128, (2, 1), 32, 256, 3, (1, 2, 3)
CHUNK_MIB = [256.0]  # the byte budget of one (rows, V) fp32 block (--chunk_mib); set in each rank from its arguments
DRAFT_METHODS = ("old", "stream", "fused", "gather")


def _status(key):
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(key))


def reset_peak() -> int:
    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)  # hand free heap pages back: the baseline is live memory only
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # VmHWM := VmRSS
    return _status("VmRSS:")


# ------------------------------------------------------------------------------------------------------ one rank
def build(T, V, seq_len, cp, rank, seed=0):
    """This rank's inputs: draft, policy head W (V, H), taps, tokens, teacher hidden / logits, masks, its zigzag
    rows."""
    torch.manual_seed(seed)
    cfg = DraftConfig(vocab_size=V, hidden_size=H, intermediate_size=INTER, num_attention_heads=HEADS[0],
                      num_key_value_heads=HEADS[1], head_dim=HEAD_DIM, tap_layers=TAPS, target_num_layers=8)
    draft = Eagle3Draft(cfg, torch.randn(V, H) * 0.02)
    W = (torch.randn(V, H) * 0.05).requires_grad_()  # the policy's LM head (a parameter of the last stage)
    cu = cu_seqlens_from_lengths([seq_len] * (T // seq_len))
    g = torch.Generator().manual_seed(100 + rank)
    Tl = T // cp
    mask = torch.ones(T, dtype=torch.bool)
    mask[(cu[1:] - 1).long()] = False  # position j predicts x_{j+1}: none at a sequence's end
    return dict(draft=draft, W=W, cu=cu, Tl=Tl, taps={l: torch.randn(Tl, H, generator=g) for l in TAPS},
                tokens=torch.randint(V, (Tl,), generator=g), hidden=torch.randn(Tl, H, generator=g),
                mask=zigzag_shard(mask, cu, cp, rank), tgt=torch.randint(V, (Tl,), generator=g),
                w=torch.randn(Tl, generator=g) / T)


def draft_step(x, group, method, teacher_logits=None):
    d, kw = x["draft"], dict(loss_mask=x["mask"], num_passes=P, group=group)
    if method in ("old", "stream"):
        kw.update(teacher_logits=teacher_logits, chunk=0 if method == "old" else chunk_rows(x["W"].shape[0],
                                                                                             chunk_mib=CHUNK_MIB[0]))
    else:
        kw.update(teacher_hidden=x["hidden"], teacher_head=x["W"], chunk=chunk_rows(x["W"].shape[0],
                                                                                      chunk_mib=CHUNK_MIB[0]))
    loss, _ = d.ttt_loss(x["taps"], x["tokens"], x["cu"], **kw)
    loss.backward()


def gather_step(x, group, cp):
    """All-gather every per-token input, unshard to the packed order, run the draft at full length on every rank."""
    def full(t):
        parts = [torch.empty_like(t) for _ in range(cp)]
        dist.all_gather(parts, t.contiguous(), group=group)
        return zigzag_unshard(parts, x["cu"])
    d, cu = x["draft"], x["cu"]
    loss, _ = d.ttt_loss({l: full(t) for l, t in x["taps"].items()}, full(x["tokens"]), cu,
                         teacher_hidden=full(x["hidden"]), teacher_head=x["W"], loss_mask=full(x["mask"]),
                         num_passes=P)
    (loss / cp).backward()


def policy_step(x, fused):
    h = x["hidden"].detach().requires_grad_()  # stands in for the policy trunk's output (its grad flows back)
    if fused:
        logp = token_logp(h, x["W"], x["tgt"], chunk=chunk_rows(x["W"].shape[0], chunk_mib=CHUNK_MIB[0]))
    else:
        z = F.linear(h, x["W"])  # (T_l, V): the logits of today's path
        logp = z.gather(-1, x["tgt"][:, None])[:, 0] - torch.logsumexp(z, -1)
    (logp * x["w"]).sum().backward()


def loss_only(x, method, group, t):
    """The loss alone (the issue's first target): the TTT states are leaves, the teacher logits an input."""
    d, ring = x["draft"], as_ring(group)
    with torch.no_grad():
        hs = d.ttt_forward(x["taps"], x["tokens"], x["cu"], P, group=group)
    hs = [h.requires_grad_() for h in hs]
    valid, labels, count = pass_targets(x["tokens"], x["cu"], x["mask"], P, ring, hard_labels=False, t2d=d.t2d)
    base = reset_peak()
    t0 = time.perf_counter()
    if method == "loss_old":
        shifted = lambda v, k, fill: cp_shift(v, x["cu"], k, group=ring, fill=fill)[0]  # noqa: E731
        loss, _ = dense_pass_losses(hs, d.logits, d.draft_to_target, t, valid, None, count, pass_weight=0.8,
                                    shifted=shifted)
    else:
        teacher = make_teacher(t, None, None, t.shape[0], t.shape[1], x["cu"], P, ring)
        loss, _ = streaming_pass_losses(hs, d.norm, d.lm_head.weight, None, teacher, valid, None, count,
                                        pass_weight=0.8, cp=ring.size, local_cu=x["cu"] // ring.size,
                                        chunk=chunk_rows(t.shape[1], chunk_mib=CHUNK_MIB[0]))
    loss.backward()
    return base, t0


def run_method(x, method, group, cp):
    if method.startswith("loss_"):
        with torch.no_grad():
            t = F.linear(x["hidden"], x["W"])
        base, t0 = loss_only(x, method, group, t)
    elif method in ("old", "stream"):
        with torch.no_grad():  # the teacher logits are an input (the policy's forward made them): not counted
            t = F.linear(x["hidden"], x["W"])
        base = reset_peak()
        t0 = time.perf_counter()
        draft_step(x, group, method, t)
    else:
        base = reset_peak()
        t0 = time.perf_counter()
        if method == "gather":
            gather_step(x, group, cp)
        elif method in ("fused", "step_fused"):
            if method == "step_fused":
                policy_step(x, True)
            draft_step(x, group, "fused")
        else:
            policy_step(x, method == "policy_fused")
    return dict(peak=_status("VmHWM:") - base, total=_status("VmHWM:"), seconds=time.perf_counter() - t0)


def rank_main(rank, cp, store_path, jobs, q_out, chunk_mib=256.0):
    try:
        CHUNK_MIB[0] = chunk_mib
        torch.set_num_threads(1)  # ranks share the cores
        dist.init_process_group("gloo", store=dist.FileStore(store_path, cp), rank=rank, world_size=cp)
        group = dist.group.WORLD
        for method in sorted({m for m, *_ in jobs}):  # warm-up on every rank: imports, gloo links, caches
            run_method(build(64 * cp, 512, 64 * cp, cp, rank), method, group, cp)
        for method, T, V, seq_len in jobs:
            x = build(T, V, seq_len, cp, rank)
            dist.barrier()
            try:
                res = dict(run_method(x, method, group, cp), status="ok")
            except (RuntimeError, MemoryError) as e:
                res = dict(peak=None, total=None, seconds=None, status=f"error: {str(e)[:80]}")
            q_out.put((rank, (method, T, V), res))
            del x
            dist.barrier()
        dist.destroy_process_group()
    except BaseException:  # noqa: BLE001 - reported to the parent
        q_out.put((rank, None, traceback.format_exc()))


def run_group(cp, jobs, timeout_s, chunk_mib=256.0):
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    rows = {}
    with tempfile.TemporaryDirectory() as tmp:
        procs = [ctx.Process(target=rank_main, args=(r, cp, os.path.join(tmp, "store"), jobs, q, chunk_mib),
                             daemon=True)
                 for r in range(cp)]
        for p in procs:
            p.start()
        got, deadline = {}, time.monotonic() + timeout_s
        try:
            while len(got) < cp * len(jobs):
                try:
                    rank, key, res = q.get(timeout=1.0)
                except Exception:  # queue.Empty: dead ranks (the OOM killer) or the deadline
                    dead = [p.exitcode for p in procs if p.exitcode not in (None, 0)]
                    if dead or time.monotonic() > deadline:
                        print(f"cp={cp}: {'timeout' if not dead else f'died {dead}'}", file=sys.stderr)
                        break
                    continue
                if key is None:
                    print(res, file=sys.stderr)
                    break
                got[(rank, key)] = res
        finally:
            for p in procs:
                p.join(timeout=2.0)
                if p.is_alive():
                    p.kill()
    for method, T, V, seq_len in jobs:
        per = [got.get((r, (method, T, V))) for r in range(cp)]
        ok = all(p is not None and p["status"] == "ok" for p in per)
        rows[(method, T, V)] = dict(method=method, T=T, V=V, cp=cp, seq_len=seq_len, H=H, P=P,
                                    chunk=chunk_rows(V, chunk_mib=chunk_mib)
                                    if method not in ("old", "loss_old", "policy") else 0,
                                    growth_mib=round(max(p["peak"] for p in per) / 2**20, 1) if ok else None,
                                    total_mib=round(max(p["total"] for p in per) / 2**20, 1) if ok else None,
                                    seconds=round(max(p["seconds"] for p in per), 3) if ok else None,
                                    status="ok" if ok else next((p["status"] for p in per if p), "not run"))
    return rows


# --------------------------------------------------------------------------------------------------------- the grid
def grid(quick):
    """(cp, [(method, T, V, seq_len)]), sized for a shared 2-core machine: the V-wide elementwise work (T * V * P) and
    the attention (sequences of 4096) are what limit T and V here, not memory."""
    if quick:
        return [(cp, [(m, 1024, 8192, 512) for m in ("loss_old", "loss_stream", "old", "stream", "fused",
                                                         "step_fused", "policy", "policy_fused")]) for cp in (1, 2)]
    V = 32768
    big = ("fused", 65536, 1024, 2048)  # the whole step's CP scaling at T = 64K (V small: CPU time, see docs/memory.md)
    return [(1, [(m, 2048, V, 2048) for m in ("loss_old", "loss_stream")]),
            (1, [(m, 2048, V, 2048) for m in ("old", "stream", "fused", "policy", "policy_fused", "step_fused")]),
            (1, [("step_fused", 2048, 151936, 2048)]),
            (1, [big]), (2, [big]), (4, [big, ("fused", 16384, 1024, 2048), ("gather", 16384, 1024, 2048)]),
            (8, [big])]


LONG_VOCAB = [(1, [("fused", 65536, 32768, 2048)]), (4, [("fused", 65536, 32768, 2048)])]  # the issue's own row


def markdown(rows, cmd, machine):
    lines = [f"`{cmd}` on {machine}", "",
             "| method | T | cp | V | chunk rows | growth MiB / rank | total MiB / rank | seconds | status |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---|"]
    for r in sorted(rows, key=lambda r: (r["method"], r["V"], r["T"], r["cp"])):
        lines.append(f"| {r['method']} | {r['T']} | {r['cp']} | {r['V']} | {r['chunk']} | {r['growth_mib']} | "
                     f"{r['total_mib']} | {r['seconds']} | {r['status']} |")
    return "\n".join(lines + [""] + [f"- {k}: {v}" for k, v in claims(rows).items()]) + "\n"


def claims(rows):
    """The headline numbers the docs quote (None where a row is missing)."""
    def g(method, T, V, cp, key="growth_mib"):
        return next((r[key] for r in rows if (r["method"], r["T"], r["V"], r["cp"]) == (method, T, V, cp)
                     and r[key] is not None), None)

    ratio = lambda a, b: None if a is None or b is None or b == 0 else round(a / b, 2)  # noqa: E731
    heads_aside = lambda x, V: None if x is None else x - 4 * V * H * 4 / 2**20  # noqa: E731
    T, V, TV = 2048, 32768, 2048 * 32768 * 4 / 2**20  # one (T, V) fp32 tensor, MiB
    return {
        "loss fwd+bwd growth in (T, V) fp32 tensors, T=2048 V=32768 P=3: old": ratio(g("loss_old", T, V, 1), TV),
        "loss fwd+bwd growth in (T, V) fp32 tensors, T=2048 V=32768 P=3: stream": ratio(g("loss_stream", T, V, 1), TV),
        "seconds loss stream / old": ratio(g("loss_stream", T, V, 1, "seconds"), g("loss_old", T, V, 1, "seconds")),
        "seconds draft step stream / old": ratio(g("stream", T, V, 1, "seconds"), g("old", T, V, 1, "seconds")),
        "loss share of the streamed draft step's growth": ratio(g("loss_stream", T, V, 1), g("stream", T, V, 1)),
        "growth(cp1)/growth(cp4), fused draft step, T=65536 V=1024": ratio(g("fused", 65536, 1024, 1),
                                                                           g("fused", 65536, 1024, 4)),
        "growth(cp1)/growth(cp4), fused draft step, T=65536 V=32768": ratio(g("fused", 65536, 32768, 1),
                                                                            g("fused", 65536, 32768, 4)),
        "growth(cp1)/growth(cp8), fused draft step, T=65536 V=1024": ratio(g("fused", 65536, 1024, 1),
                                                                           g("fused", 65536, 1024, 8)),
        "gather / fused growth, T=16384 V=1024 cp=4": ratio(g("gather", 16384, 1024, 4), g("fused", 16384, 1024, 4)),
        "step_fused growth V=151936 / V=32768, T=2048 cp=1": ratio(g("step_fused", T, 151936, 1),
                                                                   g("step_fused", T, V, 1)),
        "the same, LM-head gradients aside (4 x V*H fp32: two heads' .grad + accumulation buffer each)":
            ratio(heads_aside(g("step_fused", T, 151936, 1), 151936), heads_aside(g("step_fused", T, V, 1), V)),
        "policy_fused / policy growth, T=2048 V=32768": ratio(g("policy_fused", T, V, 1), g("policy", T, V, 1)),
    }


def plot(rows, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.3))
    ax = axes[0]  # the CP scaling of the whole draft step
    for (T, V) in sorted({(r["T"], r["V"]) for r in rows if r["method"] in ("fused", "gather")}):
        for m in ("fused", "gather"):
            pts = sorted((r["cp"], r["growth_mib"]) for r in rows if (r["method"], r["T"], r["V"]) == (m, T, V)
                         and r["growth_mib"] is not None)
            if pts:
                ax.plot(*zip(*pts), marker="o" if m == "fused" else "s", label=f"{m} T={T} V={V}")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("cp")
    ax.set_ylabel("peak growth MiB / rank")
    ax.set_title(f"whole draft step (streamed loss, fused teacher), H={H}, P={P}")
    ax.legend(fontsize=7)
    ax = axes[1]  # the methods at cp = 1, smallest T, largest common V
    one = [r for r in rows if r["cp"] == 1 and r["T"] == min(x["T"] for x in rows) and r["growth_mib"] is not None]
    one.sort(key=lambda r: (r["V"], r["method"]))
    ax.barh([f"{r['method']} V={r['V']}" for r in one], [r["growth_mib"] for r in one], color="tab:blue")
    ax.set_xscale("log")
    ax.set_xlabel("peak growth MiB (cp = 1)")
    ax.set_title(f"T = {min(x['T'] for x in rows)}: old vs streamed vs fused")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def vocab_ratio(T: int, repeats: int, chunk_mib: float, machine: str):
    """step_fused at V = 151936 and 32768 on the same T, cp = 1: one fresh pair of rank processes per repeat, the two
    vocabularies interleaved inside it (their order alternating), so a change in the shared CPU's load hits both.
    Writes bench/results/draft_step_vocab_ratio_<chunk_mib>mib.json; returns the per-repeat seconds and the median
    ratio."""
    Vs, runs = (151936, 32768), []
    for i in range(repeats):
        jobs = [("step_fused", T, V, T) for V in (Vs if i % 2 == 0 else Vs[::-1])]
        rows = run_group(1, jobs, timeout_s=3600, chunk_mib=chunk_mib)
        sec = {V: rows[("step_fused", T, V)]["seconds"] for V in Vs}
        runs.append(dict(seconds=sec, chunk={V: rows[("step_fused", T, V)]["chunk"] for V in Vs},
                         ratio=None if None in sec.values() else round(sec[Vs[0]] / sec[Vs[1]], 2)))
        print(f"repeat {i}: {runs[-1]}", flush=True)
    ok = [r["ratio"] for r in runs if r["ratio"] is not None]
    res = dict(cmd=f"python bench/bench_draft_step.py --vocab_ratio --T {T} --repeats {repeats} --chunk_mib "
                   f"{chunk_mib}", machine=machine, T=T, chunk_mib=chunk_mib, V_ratio=round(Vs[0] / Vs[1], 2),
               runs=runs, median_ratio=round(statistics.median(ok), 2) if ok else None)
    with open(os.path.join(ROOT, "bench", "results", f"draft_step_vocab_ratio_{chunk_mib:g}mib.json"), "w") as f:
        json.dump(res, f, indent=1)
    print(json.dumps(res, indent=1))
    return res


def main(argv):
    ap = parser(__doc__, __file__)
    ap.add_argument("--quick", action="store_true", help="the small grid (~1 min): draft_step_quick.{json,md,png}")
    ap.add_argument("--replot", action="store_true", help="only the table and plot again, from the JSON")
    ap.add_argument("--long_vocab", action="store_true", help="add the T = 64K, V = 32K rows to the full run's JSON")
    ap.add_argument("--vocab_ratio", action="store_true", help="step_fused at V = 151936 vs 32768, interleaved")
    ap.add_argument("--T", type=int, default=2048, help="--vocab_ratio: tokens of the step")
    ap.add_argument("--repeats", type=int, default=2, help="--vocab_ratio: pairs of runs")
    ap.add_argument("--chunk_mib", type=float, default=256.0, help="--vocab_ratio: MiB of fp32 logits per chunk")
    a = ap.parse_args(argv)
    quick, replot, long_vocab = a.quick, a.replot, a.long_vocab
    machine = f"{platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}, gloo CPU processes"
    if a.vocab_ratio:
        os.environ["MALLOC_MMAP_THRESHOLD_"] = str(128 << 10)  # as below: inherited by the spawned ranks
        return vocab_ratio(a.T, a.repeats, a.chunk_mib, machine)
    name = "draft_step_quick" if quick else "draft_step"
    out = os.path.join(ROOT, "bench", "results")
    os.makedirs(out, exist_ok=True)
    cmd = "python bench/bench_draft_step.py" + (" --quick" if quick else " (then --long_vocab)" if long_vocab else "")
    if replot or long_vocab:
        with open(os.path.join(out, name + ".json")) as f:
            rows = json.load(f)["rows"]
    if not replot:
        os.environ["MALLOC_MMAP_THRESHOLD_"] = str(128 << 10)  # inherited by the spawned ranks
        if long_vocab:  # added to the full run's rows (replacing earlier ones of the same key)
            keys = {(m, T, V, cp) for cp, jobs in LONG_VOCAB for m, T, V, _ in jobs}
            rows = [r for r in rows if (r["method"], r["T"], r["V"], r["cp"]) not in keys]
        else:
            rows = []
        for cp, jobs in (LONG_VOCAB if long_vocab else grid(quick)):  # the JSON is rewritten after every group:
            t0 = time.time()  # a cut run keeps what it measured
            rows += list(run_group(cp, jobs, timeout_s=1800).values())
            print(f"cp={cp}: {len(jobs)} rows in {time.time() - t0:.0f} s", flush=True)
            with open(os.path.join(out, name + ".json"), "w") as f:
                json.dump({"cmd": cmd, "machine": machine, "rows": rows, "claims": claims(rows)}, f, indent=1)
    text = markdown(rows, cmd, machine)
    with open(os.path.join(out, name + ".md"), "w") as f:
        f.write(text)
    plot(rows, os.path.join(out, name + ".png"))
    print(text)


if __name__ == "__main__":
    from parallel.cli import run_main  # an error: one line, exit 1 (COSPEC_TRACEBACK=1: the traceback)
    run_main(main, __file__, sys.argv[1:])
