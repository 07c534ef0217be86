"""The draft step's memory per draft family (EAGLE-3, DFlash, DSpark), cp 1 vs cp 4, counted in live tensor bytes.

One training step of a draft on T packed tokens (sequences of `seq_len`), vocabulary V, under context parallelism
(gloo CPU processes, the zigzag layout): the family's own loss through the drafter protocol (`draft.loss`) on detached
taps, the teacher fused (the policy's final hidden (T_l, H) and its LM head: no (T, V) tensor as input), backward.
Every family is built by harness/drafters.build_draft from the same policy (H = 128, 8 layers, vocabulary V):

  eagle3   TTT, P = 3 passes over every position (its own LM head copy: a (V, H) gradient)
  dflash   one block of W slots per anchor, `anchors` per sequence (the policy's head shared, detached)
  dspark   the same blocks, plus the Markov head (rank 16) and the confidence head

Memory is counted by harness/memory_track.StorageTracker around the step: every storage an op creates while the step
runs, added when it appears and taken off when it dies. `live` is the largest total alive at once (the gradients
that outlive the step included), `transient` the same over the storages freed before the step ends, `grads` what
survives it. Deterministic: the same shapes give the same bytes on any load. Inputs (taps, tokens, the teacher's
hidden) are built before and not counted. `rss` is the growth of the process's peak RSS over the step (VmHWM reset
first, as bench/bench_draft_step.py counts it), a secondary figure. Each number is the max over the cp ranks.

    python bench/bench_draft_families.py --families dflash,dspark --T 65536 --V 151936   # the block drafters at 64K
    python bench/bench_draft_families.py --families eagle3 --T 65536 --V 1024 --name draft_families_eagle3
    python bench/bench_draft_families.py --families eagle3 --T 4096,8192 --V 151936 --name draft_families_eagle3 \
        --append                                      # EAGLE-3 at the real vocabulary, smaller T (its loss is T*V*P)
    python bench/bench_draft_families.py --quick       # ~1 min: T 1024, V 4096, cp 1 and 2, every family
    python bench/bench_draft_families.py --replot      # the table again from the JSON

Writes bench/results/draft_families.{json,md} (--quick: draft_families_quick); --append merges the new rows into
the JSON (a row of the same family, T, V and cp is replaced).

Letters: T tokens (all ranks), T_l = T / cp, H hidden, V vocabulary, W block size, P TTT passes.
"""
from __future__ import annotations

import gc
import json
import os
import platform
import sys
import tempfile
import time
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(1, os.path.dirname(os.path.abspath(__file__)))  # its sibling bench_draft_step, however it is run
from bench_draft_step import _status, reset_peak  # noqa: E402
from branch_mask import cu_seqlens_from_lengths, zigzag_shard  # noqa: E402
from harness.drafters import FAMILIES, build_draft, family_list  # noqa: E402
from harness.memory_track import StorageTracker  # noqa: E402
from model import ModelConfig, Transformer  # noqa: E402
from parallel.cli import parser  # noqa: E402

H, HEADS, HEAD_DIM, INTER, LAYERS, P = 128, (2, 1), 32, 256, 8, 3
RESULTS = os.path.join(ROOT, "bench", "results")


def family_options(V: int, block_size: int, anchors: int) -> dict:
    """build_draft's and the loss's options for every family (each family reads its own; the MASK id is V - 1, an id
    the random tokens below never take)."""
    return dict(mask_token_id=V - 1, block_size=block_size, num_layers=1, markov_rank=16, anchors=anchors,
                gamma=None, seed=0)


def loss_kwargs(name: str, opts: dict) -> dict:
    if name == "eagle3":
        return dict(num_passes=P, pass_weight=0.8)
    return {k: opts[k] for k in FAMILIES[name].loss_keys}


# ------------------------------------------------------------------------------------------------------ one rank
def build(name, T, V, seq_len, cp, rank, block_size, anchors, seed=0):
    """This rank's draft and inputs: taps {layer: (T_l, H)}, tokens (T_l,), the teacher's hidden (T_l, H), the loss
    mask (no prediction at a sequence's end), all its zigzag rows."""
    torch.manual_seed(seed)
    policy = Transformer(ModelConfig(vocab_size=V, hidden_size=H, intermediate_size=INTER, num_hidden_layers=LAYERS,
                                     num_attention_heads=HEADS[0], num_key_value_heads=HEADS[1], head_dim=HEAD_DIM,
                                     max_position_embeddings=max(seq_len, 4096)))
    for p in policy.parameters():
        p.requires_grad_(False)  # the policy is not trained by the draft step
    opts = family_options(V, block_size, anchors)
    draft = build_draft(name, policy, opts)
    cu = cu_seqlens_from_lengths([seq_len] * (T // seq_len))
    g = torch.Generator().manual_seed(100 + rank)
    Tl = T // cp
    mask = torch.ones(T, dtype=torch.bool)
    mask[(cu[1:] - 1).long()] = False  # position j predicts x_{j+1}: none at a sequence's end
    return dict(name=name, draft=draft, policy=policy, opts=opts, cu=cu,
                taps={l: torch.randn(Tl, H, generator=g) for l in draft.tap_layers},
                tokens=torch.randint(V - 1, (Tl,), generator=g), hidden=torch.randn(Tl, H, generator=g),
                mask=zigzag_shard(mask, cu, cp, rank))


def live_peak(tr: StorageTracker) -> int:
    """The largest total of the tracked storages alive at once, the step's survivors (its gradients) included."""
    live = best = 0
    for _, n, _ in tr.events:
        live += n
        best = max(best, live)
    return best


def measure(x, group) -> dict:
    d = x["draft"]
    base = reset_peak()
    t0 = time.perf_counter()
    with StorageTracker() as tr:
        loss, _ = d.loss(x["taps"], x["tokens"], x["cu"], teacher_hidden=x["hidden"],
                         teacher_head=x["policy"].head_weight.detach(), loss_mask=x["mask"], group=group,
                         **loss_kwargs(x["name"], x["opts"]))
        loss.backward()
        del loss
        gc.collect()
    return dict(live=live_peak(tr), transient=tr.peak(), grads=tr.survivors(), rss=_status("VmHWM:") - base,
                seconds=time.perf_counter() - t0)


def rank_main(rank, cp, store_path, jobs, q_out, block_size, anchors):
    try:
        torch.set_num_threads(1)  # ranks share the cores
        dist.init_process_group("gloo", store=dist.FileStore(store_path, cp), rank=rank, world_size=cp)
        group = dist.group.WORLD
        for name in sorted({j[0] for j in jobs}):  # warm-up: imports, gloo links, caches (16 sequences: anchors on
            measure(build(name, 512 * cp, 512, 32 * cp, cp, rank, block_size, anchors), group)  # every rank)
        for name, T, V, seq_len in jobs:
            x = build(name, T, V, seq_len, cp, rank, block_size, anchors)
            dist.barrier()
            try:
                res = dict(measure(x, group), status="ok")
            except (RuntimeError, MemoryError, ValueError) as e:
                res = dict(status=f"error: {str(e)[:100]}")
            q_out.put((rank, (name, T, V), res))
            del x
            dist.barrier()
        dist.destroy_process_group()
    except BaseException:  # noqa: BLE001 - reported to the parent
        q_out.put((rank, None, traceback.format_exc()))


def collect(q, procs, n, timeout_s) -> dict:
    got, deadline = {}, time.monotonic() + timeout_s
    while len(got) < n:
        try:
            rank, key, res = q.get(timeout=1.0)
        except Exception:  # queue.Empty: dead ranks (the OOM killer) or the deadline
            dead = [p.exitcode for p in procs if p.exitcode not in (None, 0)]
            if dead or time.monotonic() > deadline:
                print("timeout" if not dead else f"ranks died: {dead}", file=sys.stderr)
                break
            continue
        if key is None:
            print(res, file=sys.stderr)
            break
        got[(rank, key)] = res
    return got


def run_group(cp, jobs, block_size, anchors, timeout_s=3600) -> list:
    """The jobs [(family, T, V, seq_len)] on cp fresh rank processes -> one row per job (max over ranks)."""
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        procs = [ctx.Process(target=rank_main, args=(r, cp, os.path.join(tmp, "store"), jobs, q, block_size, anchors),
                             daemon=True) for r in range(cp)]
        for p in procs:
            p.start()
        try:
            got = collect(q, procs, cp * len(jobs), timeout_s)
        finally:
            for p in procs:
                p.join(timeout=2.0)
                if p.is_alive():
                    p.kill()
    rows = []
    for name, T, V, seq_len in jobs:
        per = [got.get((r, (name, T, V))) for r in range(cp)]
        ok = all(p is not None and p["status"] == "ok" for p in per)
        mib = lambda k: round(max(p[k] for p in per) / 2**20, 1) if ok else None  # noqa: E731
        rows.append(dict(family=name, T=T, V=V, cp=cp, seq_len=seq_len, H=H, block_size=block_size,
                         anchors=anchors, P=P, live_mib=mib("live"), transient_mib=mib("transient"),
                         grads_mib=mib("grads"), rss_mib=mib("rss"),
                         seconds=round(max(p["seconds"] for p in per), 2) if ok else None,
                         status="ok" if ok else next((p["status"] for p in per if p), "not run")))
    return rows


# ------------------------------------------------------------------------------------------------------ the table
def ratios(rows) -> dict:
    """live(cp 1) / live(cp c) per (family, T, V) for every c > 1 measured beside cp 1."""
    out = {}
    one = {(r["family"], r["T"], r["V"]): r["live_mib"] for r in rows if r["cp"] == 1 and r["live_mib"]}
    for r in rows:
        base = one.get((r["family"], r["T"], r["V"]))
        if r["cp"] > 1 and base and r["live_mib"]:
            out[f"{r['family']} T={r['T']} V={r['V']}: live cp1/cp{r['cp']}"] = round(base / r["live_mib"], 2)
    return out


def markdown(rows, cmds, machine) -> str:
    lines = [f"{machine}; " + "; ".join(f"`{c}`" for c in cmds), "",
             "| family | T | V | cp | live MiB / rank | transient MiB | grads MiB | RSS growth MiB | seconds | "
             "status |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    for r in sorted(rows, key=lambda r: (r["family"], r["V"], r["T"], r["cp"])):
        lines.append(f"| {r['family']} | {r['T']} | {r['V']} | {r['cp']} | {r['live_mib']} | {r['transient_mib']} | "
                     f"{r['grads_mib']} | {r['rss_mib']} | {r['seconds']} | {r['status']} |")
    return "\n".join(lines + [""] + [f"- {k}: **{v}**" for k, v in ratios(rows).items()]) + "\n"


def parse(argv):
    ap = parser(__doc__, __file__)
    ap.add_argument("--families", default="eagle3,dflash,dspark", help="comma-separated: " + ", ".join(FAMILIES))
    ap.add_argument("--T", default="65536", help="comma-separated token counts (all ranks)")
    ap.add_argument("--V", default="151936", help="comma-separated vocabulary sizes")
    ap.add_argument("--cps", default="1,4", help="comma-separated CP sizes (each must divide T / seq_len * 2)")
    ap.add_argument("--seq_len", type=int, default=2048, help="tokens per packed sequence")
    ap.add_argument("--block_size", type=int, default=8, help="dflash / dspark: W slots per block")
    ap.add_argument("--anchors", type=int, default=8, help="dflash / dspark: blocks per sequence")
    ap.add_argument("--quick", action="store_true", help="T 1024, V 4096, cp 1 and 2, seq_len 512 (~1 min)")
    ap.add_argument("--append", action="store_true", help="merge the new rows into the JSON")
    ap.add_argument("--name", default="", help="bench/results/<name>.{json,md} (default: draft_families[_quick])")
    ap.add_argument("--replot", action="store_true", help="only the table again, from the JSON")
    a = ap.parse_args(argv)
    if a.quick:
        a.T, a.V, a.cps, a.seq_len = "1024", "4096", "1,2", 512
    ints = lambda flag, s: [int(v) for v in s.split(",")] if all(v.strip().isdigit() for v in s.split(",")) else \
        ap.error(f"--{flag}={s!r}: expected comma-separated positive integers")  # noqa: E731
    a.T, a.V, a.cps = ints("T", a.T), ints("V", a.V), ints("cps", a.cps)
    try:
        fams = family_list(a.families, "families")
    except ValueError as e:
        ap.error(str(e))
    a.families = fams
    for T in a.T:
        if T % a.seq_len or any((T // a.seq_len) * a.seq_len % (2 * cp) or a.seq_len % (2 * cp) for cp in a.cps):
            ap.error(f"--T={T}, --seq_len={a.seq_len}, --cps: expected T a multiple of seq_len and seq_len a "
                     "multiple of 2 cp (the zigzag halves)")
    return a


def main(argv):
    a = parse(argv)
    name = a.name or ("draft_families_quick" if a.quick else "draft_families")
    path = os.path.join(RESULTS, name + ".json")
    machine = f"{platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}, gloo CPU processes"
    old = json.load(open(path)) if (a.append or a.replot) and os.path.isfile(path) else dict(rows=[], cmds=[])
    rows, cmds = old["rows"], old["cmds"]
    if not a.replot:
        cmds = cmds + ["python bench/bench_draft_families.py " + " ".join(argv)]
        os.environ["MALLOC_MMAP_THRESHOLD_"] = str(128 << 10)  # inherited by the ranks: RSS follows live tensors
        for cp in a.cps:
            jobs = [(f, T, V, a.seq_len) for f in a.families for T in a.T for V in a.V]
            t0 = time.time()
            new = run_group(cp, jobs, a.block_size, a.anchors)
            keys = {(r["family"], r["T"], r["V"], r["cp"]) for r in new}
            rows = [r for r in rows if (r["family"], r["T"], r["V"], r["cp"]) not in keys] + new
            print(f"cp={cp}: {len(jobs)} rows in {time.time() - t0:.0f} s", flush=True)
            os.makedirs(RESULTS, exist_ok=True)
            with open(path, "w") as f:  # rewritten after every group: a cut run keeps what it measured
                json.dump(dict(cmds=cmds, machine=machine, rows=rows, ratios=ratios(rows)), f, indent=1)
    text = markdown(rows, cmds, machine)
    with open(os.path.join(RESULTS, name + ".md"), "w") as f:
        f.write(text)
    print(text)
    return rows


if __name__ == "__main__":
    from parallel.cli import run_main  # an error: one line, exit 1 (COSPEC_TRACEBACK=1: the traceback)
    run_main(main, __file__, sys.argv[1:])
