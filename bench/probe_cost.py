"""Device figures for harness/cost_model.py, measured on THIS machine by small probes on random weights (never a run).

    python bench/probe_cost.py        # ~1.5 min (140-154 s with --rounds 5): bench/results/cost_device_cpu.json
    python bench/probe_cost.py --out /tmp/dev.json --model mini --batch 32
    python bench/probe_cost.py --only oversub --out bench/results/cost_device_cpu_quiet.json   # that figure alone

Every figure is CPU seconds (time.process_time) of one process at --threads (1: what each rank of the default run
uses), the median of --repeats calls in each of --rounds rounds of the whole suite, pooled (--stat best: the least);
the cost model turns CPU seconds into wall seconds with the run's processes per core. The median, not the least: a
run's phase is one execution of each call, so it costs a typical call; with the least of 35 calls the default run's
predicted rollout came out 12-22% lower (docs/cost_model.md).
CPU seconds are less sensitive to other processes than wall seconds
but not immune (cache and time-slice sharing): on this 2-core machine at a load average of ~6 the TTT figures came out
up to ~2x higher than at ~2 (time slices shared with other processes refill caches), so the probe runs at niceness
--nice (-20: other processes then take ~1% of its core) and records the niceness and load it ran at. The probes run
the project's own code paths at shapes like the run's, on random weights of the --model preset:

  F            FLOP/s of fp32 matmuls at the policy's layer shapes (T x H) @ (H x I), T = 2048
  BW           bytes/s of a 256 MiB copy (read + write)
  F_attn       FLOP/s of the packed attention (per-sequence tiles), from the per-sequence cost at --seq_len and twice it
  o_layer      per layer-forward call, packed varlen forward (ring attention, torch blocks, no CP), past flops / F:
  o_seq          plus this much per sequence in the call (the attention's per-sequence segments)
  o_layer_fb   the same for forward + backward, and o_seq_fb per sequence
  F_pad        FLOP/s of the reference's attention padded to the block's longest row (nominal: the full square),
               from the padded forward at --seq_len and 3x it tokens per row
  o_layer_pad  per layer-forward call of the padded batched no-grad forward (the reference log-probs of a rollout
               block), and o_ref per reference_logp call outside its layers (embedding, padding, the head's log-probs)
  o_dec        per layer-forward call in cached decoding (one layer, B rows, 1..k+1 new tokens each)
  o_step       per autoregressive decode step, outside the layers (embedding, head, sampling, commit, the host sync)
  o_vstep      per speculative verify step, outside the policy's layers and the draft's calls (verify rule, commit)
  o_dstep      per draft forward step in cached decoding (its layer, norm, head, sampling)
  o_dext       per draft trunk extension after a verify (fc over the taps, its layer over k + 1 entries)
  o_pass       per TTT pass, forward + backward (draft layer over the packed batch, its head and loss), past flops / F
  o_pass_seq     plus this much per sequence, o_pass_tok per token (and o_pass1_seq, o_pass1_tok for pass 1)
  o_ttt        per TTT loss call outside the passes (the fc over the taps, the teacher's softmax)
  o_row, o_upd, o_tok_fb, o_dopt   the host's work around the calls: bench/probe_cost_host.py
  oversub      CPU seconds of an autoregressive generate when 2 x cores unpinned processes share the cores, over
               the same alone (the median round's ratio, at least 1: below is noise, and the loader refuses it;
               --only oversub re-probes it alone into an existing --out)

Layers are isolated as the difference between a 5-layer and a 1-layer model (/ 4); per-sequence terms as the
difference between two sequence counts. The fits are exact solves of 2 x 2 systems on the probe's own timings; a
fixed overhead a fit puts below 0 (under the noise) is written as 0 and named in the file's source.
"""
from __future__ import annotations

import functools
import json
import os
import platform
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(1, os.path.dirname(os.path.abspath(__file__)))  # bench/: probe_cost_host beside this file

import torch  # noqa: E402

import speculative  # noqa: E402
from attention_cp import ring_branch_attention  # noqa: E402
from backends.attention_padded import padded_causal_attention  # noqa: E402
from branch_mask import cu_seqlens_from_lengths  # noqa: E402
from decoding.row_streams import RowStreams, row_keys  # noqa: E402
from draft import Eagle3Draft  # noqa: E402
from backends.fused_logprob import budget_rows  # noqa: E402
from rl_loop import RolloutBatch, reference_logp  # noqa: E402
from harness.cost_inputs import (Arch, Device, attn_flops, clamp_fixed, dense_flops, draft_pass_flops,  # noqa: E402
                                 head_flops, layer_flops, pad_attn_flops)
import probe_cost_host as host  # noqa: E402
from probe_cost_host import cpu_times, models  # noqa: E402
from parallel.cli import parser  # noqa: E402


BEST, CALL, STAT = {}, [0], ["median"]  # the k-th timing of a round -> its timings so far; the round's call counter



def cpu_s(fn, repeats: int) -> float:
    """CPU seconds of one call of fn() (after a warm-up call), over `repeats` calls in this round and the same call
    of every earlier round (rounds run the same probes in the same order). STAT "median" (--stat): the median of every
    timing so far -- a typical call, what a run's phase, one execution of each call, costs on average; "best": the
    least -- the luckiest call, which a burst of load cannot raise but which under-states a typical one."""
    ts = cpu_times(fn, repeats)
    i = CALL[0]
    CALL[0] += 1
    BEST[i] = BEST.get(i, []) + ts
    return min(BEST[i]) if STAT[0] == "best" else statistics.median(BEST[i])


def packed(cfg, S: int, T: int):  # S sequences of T tokens
    cu = cu_seqlens_from_lengths(torch.full((S,), T))
    return torch.randint(0, cfg.vocab_size, (S * T,)), cu


def probe_gemm(arch: Arch, repeats: int) -> float:
    a, b = torch.randn(2048, arch.hidden), torch.randn(arch.hidden, arch.intermediate)
    return 2 * 2048 * arch.hidden * arch.intermediate / cpu_s(lambda: a @ b, repeats * 5)


def probe_bw(repeats: int) -> float:
    src = torch.empty(64 * 2 ** 20)  # 256 MiB fp32
    dst = torch.empty_like(src)
    return 2 * src.numel() * 4 / cpu_s(lambda: dst.copy_(src), repeats)


def probe_train_layer(m1, m5, arch: Arch, F: float, seqs: tuple, T: int, repeats: int) -> dict:
    """F_attn (the packed attention's FLOP/s, from the per-sequence cost at T and 2T tokens), o_layer, o_seq (forward)
    and o_layer_fb, o_seq_fb (forward + backward) of the packed varlen layer, past dense flops / F and attention flops
    / F_attn (x 3 with the backward)."""
    att = functools.partial(ring_branch_attention, group=None, backend="torch")
    per = {}
    for n in (T, 2 * T):
        for S in seqs:
            x, cu = packed(m1.cfg, S, n)

            def fwd(m):
                with torch.no_grad():
                    m(x, cu, attn_fn=att, logits=False)

            def fb(m):
                m(x, cu, attn_fn=att, logits=False).hidden.sum().backward()

            fl = dense_flops(arch, S * n)
            per[n, S] = ((cpu_s(lambda: fwd(m5), repeats) - cpu_s(lambda: fwd(m1), repeats)) / 4 - fl / F,
                         (cpu_s(lambda: fb(m5), repeats) - cpu_s(lambda: fb(m1), repeats)) / 4 - 3 * fl / F)
    s1, s2 = sorted(seqs)
    slope = {n: [(per[n, s2][i] - per[n, s1][i]) / (s2 - s1) for i in (0, 1)] for n in (T, 2 * T)}  # s / sequence
    a1, a2 = attn_flops(arch, T, T / 2), attn_flops(arch, 2 * T, T)  # one sequence's attention FLOPs
    F_attn = 3 * (a2 - a1) / (slope[2 * T][1] - slope[T][1])
    o = {"F_attn": F_attn, "o_seq": slope[T][0] - a1 / F_attn, "o_seq_fb": slope[T][1] - 3 * a1 / F_attn}
    o["o_layer"] = per[T, s1][0] - s1 * slope[T][0]
    o["o_layer_fb"] = per[T, s1][1] - s1 * slope[T][1]
    return o


def probe_reference(m1, m5, arch: Arch, F: float, B: int, lens: tuple, repeats: int) -> dict:
    """F_pad (the padded attention's rate, 4 n_q d B L^2 nominal FLOPs per layer: the full square of the block padded
    to its longest row L), o_layer_pad (per layer of the padded batched no-grad forward, past dense flops / F and that
    attention / F_pad) and o_ref (per reference_logp call outside its layers: embedding, padding, the head's chunked
    log-probs) of rl_loop.reference_logp, as a rollout block calls it, at two lengths L (exact 2 x 2 solve)."""
    per, base = {}, {}
    for T in lens:
        x, cu = packed(m1.cfg, B, T)
        batch = RolloutBatch(x, cu, torch.ones_like(x, dtype=torch.bool), torch.zeros(B * T), torch.zeros(B),
                             torch.ones(B, dtype=torch.bool))
        t = [cpu_s(lambda: reference_logp(m, batch, attn_fn=padded_causal_attention, logprob_chunk=budget_rows(
            arch.vocab, 256.0), seqs=B), repeats) for m in (m1, m5)]
        per[T] = (t[1] - t[0]) / 4 - dense_flops(arch, B * T) / F  # = pad_attn_flops(T) / F_pad + o_layer_pad
        base[T] = t[0] - (t[1] - t[0]) / 4 - head_flops(arch, B * T) / F
    (l1, l2), sq = sorted(lens), lambda L: pad_attn_flops(arch, B, L)  # noqa: E731
    F_pad = (sq(l2) - sq(l1)) / (per[l2] - per[l1])
    return {"F_pad": F_pad, "o_layer_pad": per[l1] - sq(l1) / F_pad, "o_ref": base[l1]}


def timed_generate(m, d, prompts, new: int, k: int, repeats: int) -> tuple:
    """(best CPU seconds, verify / decode forwards after the prefill) of speculative.generate (no EOS)."""
    keys = row_keys(0, torch.arange(len(prompts)), torch.zeros(len(prompts), dtype=torch.long))
    run = lambda: speculative.generate(m, d, prompts, max_new_tokens=new, num_draft_tokens=k,  # noqa: E731
                                       temperature=1.0, generator=RowStreams(keys))  # per-row streams, as the run
    return cpu_s(run, repeats), run().stats.policy_forwards


def probe_decode(m1, m5, arch: Arch, F: float, B: int, prompt: int, new: int, repeats: int) -> dict:
    """o_dec, o_step from autoregressive generate (no EOS: every row runs `new` tokens, new - 1 decode steps)."""
    prompts = [torch.randint(0, m1.cfg.vocab_size, (prompt,)) for _ in range(B)]
    (t1, n), (t5, _) = (timed_generate(m, None, prompts, new, 0, repeats) for m in (m1, m5))
    per_layer = (t5 - t1) / 4 / (n + 1)  # n decode calls per layer, and the prefill's call
    o_dec = per_layer - layer_flops(arch, B, prompt + new / 2) / F
    o_step = (t1 - per_layer * (n + 1)) / n
    return {"o_dec": o_dec, "o_step": o_step}


def probe_spec(m5, arch: Arch, F: float, dev: dict, B: int, prompt: int, new: int, k: int, repeats: int) -> dict:
    """o_dstep, o_dext from the draft's own calls; o_vstep from speculative generate on random weights (acceptance
    ~ 1/V: one kept token per step, so `new` verify steps)."""
    torch.manual_seed(1)
    d = Eagle3Draft.from_target(m5, tap_layers=(0, 1, 2))
    darch = Arch.draft_of(arch, 3)
    with torch.no_grad():
        cache = d.new_cache(B, prompt + 4 * new)
        taps = {l: torch.randn(B, prompt, arch.hidden) for l in d.tap_layers}
        toks = torch.randint(0, arch.vocab, (B, prompt))
        last = torch.full((B,), prompt - 1)
        h, _ = d.extend(cache, toks, taps, last)
        L0 = cache.lengths.clone()

        def ext():
            cache.rollback(L0)
            tk = {l: torch.randn(B, k + 1, arch.hidden) for l in d.tap_layers}
            d.extend(cache, torch.randint(0, arch.vocab, (B, k + 1)), tk, torch.full((B,), k))

        def step():
            cache.rollback(L0)
            d.step(cache, torch.randint(0, arch.vocab, (B,)), h)
        o_dext = cpu_s(ext, repeats * 5) - draft_pass_flops(darch, B * (k + 1), prompt, fc=True) / F
        o_dstep = cpu_s(step, repeats * 5) - draft_pass_flops(darch, B, prompt, fc=False) / F
    prompts = [torch.randint(0, arch.vocab, (prompt,)) for _ in range(B)]
    t, steps = timed_generate(m5, d, prompts, new, k, repeats)
    layers = 5 * (dev["o_dec"] + layer_flops(arch, B * (k + 1), prompt + new / 2) / F)
    drafts = (k - 1) * (o_dstep + draft_pass_flops(darch, B, prompt, fc=False) / F) + o_dext \
        + draft_pass_flops(darch, B * (k + 1), prompt, fc=True) / F
    o_vstep = (t - 5 * dev["o_dec"] - o_dext) / steps - layers - drafts  # the prefill ~ one call per layer + extend
    return {"o_dstep": o_dstep, "o_dext": o_dext, "o_vstep": o_vstep}


def _work(model: str, B: int, new: int, repeats: int, q) -> None:
    """Child process: one thread, unpinned, the median CPU seconds of an autoregressive generate -> q."""
    torch.set_num_threads(1)
    m1, _ = models(model)
    prompts = [torch.randint(0, m1.cfg.vocab_size, (11,)) for _ in range(B)]
    q.put(host.median_cpu_s(lambda: speculative.generate(m1, None, prompts, max_new_tokens=new, temperature=1.0),
                            repeats))


def probe_oversub(model: str, B: int, repeats: int) -> float:
    """oversub: CPU seconds of the same work when A = 2 x cores processes share the cores, unpinned, as a run's ranks
    do (the default run: 4 ranks on 2 cores), over the same work in one process alone (the cost of time slices:
    caches refilled, switches). The model applies A / cores x oversub where a phase has more processes than cores.
    (The earlier probe pinned two processes to one core: 1.31-1.35. This one, on this VM: 0.96-1.67 per round; the
    main job's own records, its ranks' CPU seconds summed against the model's one process, ~1.17.)"""
    import multiprocessing as mp
    ctx = mp.get_context("spawn")

    def run(n):
        q = ctx.Queue()
        ps = [ctx.Process(target=_work, args=(model, B, 48, repeats, q)) for _ in range(n)]
        for p in ps:
            p.start()
        out = [q.get(timeout=600) for _ in ps]
        for p in ps:
            p.join()
        return sum(out) / len(out)
    return run(2 * len(os.sched_getaffinity(0))) / run(1)


def probe_ttt(m5, arch: Arch, F: float, F_attn: float, seqs: tuple, T: int, repeats: int) -> dict:
    """o_pass1, o_pass1_seq, o_pass1_tok (TTT pass 1, forward + backward: fixed, per sequence, per token) and o_pass,
    o_pass_seq, o_pass_tok (each later pass) from draft_ttt.ttt_loss on random taps, with the fused teacher (the
    policy's final hidden and head) as the run has; at (s1, T), (s2, T) and (s2, 2T) sequences x tokens (an exact
    3 x 3 solve past the FLOPs: the dense share / F, the attention's / F_attn)."""
    torch.manual_seed(2)
    d = Eagle3Draft.from_target(m5, tap_layers=(0, 1, 2))
    darch = Arch.draft_of(arch, 3)
    (s1, s2), t = sorted(seqs), {}
    for S, n in ((s1, T), (s2, T), (s2, 2 * T)):
        x, cu = packed(m5.cfg, S, n)
        taps = {l: torch.randn(S * n, arch.hidden) for l in d.tap_layers}
        hid = torch.randn(S * n, arch.hidden)

        def loss(P):
            L, _ = d.ttt_loss(taps, x, cu, teacher_hidden=hid, teacher_head=m5.head_weight.detach(), num_passes=P,
                              backend="torch")
            L.backward()
        for P in (1, 3):
            t[S, n, P] = cpu_s(lambda: loss(P), repeats)
    first, later = {}, {}
    for S, n in ((s1, T), (s2, T), (s2, 2 * T)):  # pass 1: fc over the taps, the trunk, the head, the teacher;
        att = 3 * attn_flops(darch, S * n, n / 2)  # passes 2..P add the branch
        later[S, n] = (t[S, n, 3] - t[S, n, 1]) / 2 - (3 * draft_pass_flops(darch, S * n, n / 2, fc=False) - att
                                                       + head_flops(arch, S * n)) / F - att / F_attn
        first[S, n] = t[S, n, 1] - (3 * draft_pass_flops(darch, S * n, n / 2, fc=True) - att
                                    + head_flops(arch, S * n)) / F - att / F_attn
    o = {}
    for name, v in (("o_pass1", first), ("o_pass", later)):
        tok = (v[s2, 2 * T] - v[s2, T]) / (s2 * T)
        seq = (v[s2, T] - v[s1, T]) / (s2 - s1) - T * tok
        o.update({name: v[s1, T] - s1 * (seq + T * tok), name + "_seq": seq, name + "_tok": tok})
    return o


def only_oversub(a) -> None:
    """--only oversub: the median of --rounds ratios written into --out's "oversub" (the other figures kept), its
    source noted."""
    if not os.path.isfile(a.out):
        raise SystemExit(f"--only oversub --out {a.out}: expected an existing device file to update")
    with open(a.out) as f:
        dev = json.load(f)
    load0, t0 = os.getloadavg()[0], time.perf_counter()
    ratios = sorted(probe_oversub(a.model, a.batch, a.repeats) for _ in range(a.rounds))
    dev["oversub"] = max(1.0, ratios[len(ratios) // 2])
    dev["source"] = dev.get("source", "").split("; oversub re-probed by")[0] + (
        f"; oversub re-probed by python bench/probe_cost.py --only oversub --rounds {a.rounds} (rounds "
        f"{[round(r, 3) for r in ratios]}; {time.perf_counter() - t0:.0f} s wall, load average {load0:.2f} at the "
        f"start and {os.getloadavg()[0]:.2f} at the end)")
    with open(a.out, "w") as f:
        json.dump(dev, f, indent=1)
    print(f"oversub {dev['oversub']:.3f} (rounds {[round(r, 3) for r in ratios]}) -> {a.out}")


def main(argv=None):
    ap = parser(__doc__, __file__)
    ap.add_argument("--model", default="mini", help="model.ModelConfig preset the probes' random weights take")
    ap.add_argument("--batch", type=int, default=32, help="rows per decode call (the run's --rollout_batch)")
    ap.add_argument("--k", type=int, default=4, help="draft tokens per verify step")
    ap.add_argument("--seq_len", type=int, default=32, help="tokens per packed training sequence (and twice it)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (the run's --threads)")
    ap.add_argument("--repeats", type=int, default=7, help="best of this many timings per probe")
    ap.add_argument("--rounds", type=int, default=3, help="the whole suite this many times, each timing's calls pooled")
    ap.add_argument("--stat", default="median", choices=("median", "best"),
                    help="each timing's figure: the median of its calls (a typical call) or the least (the luckiest)")
    ap.add_argument("--nice", type=int, default=-20,
                    help="run at this niceness (needs privileges; else the current one): other processes barely time-"
                         "slice the probe, as the figures assume a core of its own")
    ap.add_argument("--quiet", type=float, default=1e9,
                    help="first wait until the 1-minute load average is below this (default: no wait)")
    ap.add_argument("--wait", type=float, default=600, help="give up waiting for --quiet after this many seconds")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results",
                                                  "cost_device_cpu.json"))
    ap.add_argument("--only", default="", choices=("", "oversub"),
                    help="oversub: re-probe the contention figure alone and update it in an existing --out")
    a = ap.parse_args(argv)
    torch.set_num_threads(a.threads)
    STAT[0] = a.stat
    try:
        os.setpriority(os.PRIO_PROCESS, 0, a.nice)  # the oversub probe's children inherit it
    except OSError as e:
        print(f"--nice={a.nice}: not permitted here ({e}); probing at niceness {os.getpriority(os.PRIO_PROCESS, 0)}")
    if a.only:
        return only_oversub(a)
    arch = Arch.load(a.model)
    m1, m5 = models(a.model)
    t0 = time.perf_counter()
    while os.getloadavg()[0] >= a.quiet and time.perf_counter() - t0 < a.wait:
        time.sleep(5)
    load0, t0 = os.getloadavg()[0], time.perf_counter()
    ratios = []
    for _ in range(a.rounds):
        CALL[0] = 0
        F, BW = probe_gemm(arch, a.repeats), probe_bw(a.repeats)
        o = probe_train_layer(m1, m5, arch, F, (16, 64), a.seq_len, a.repeats)
        o.update(probe_reference(m1, m5, arch, F, a.batch, (a.seq_len, 3 * a.seq_len), a.repeats))
        o.update(probe_decode(m1, m5, arch, F, a.batch, 11, 48, a.repeats))
        o.update(probe_spec(m5, arch, F, o, a.batch, 11, 48, a.k, a.repeats))
        o.update(probe_ttt(m5, arch, F, o["F_attn"], (16, 64), a.seq_len, a.repeats))
        o.update(host.probe_update(m1, arch, F, BW, o, (16, 64), a.seq_len, cpu_s, a.repeats))
        o.update(host.probe_draft_opt(m5, cpu_s, a.repeats))
        o.update(host.probe_rows(a.batch, 8, 8, cpu_s, a.repeats))
        ratios.append(probe_oversub(a.model, a.batch, a.repeats))
    oversub = max(1.0, sorted(ratios)[len(ratios) // 2])  # a ratio of two timings: the median round's, not a best
    cmd = "python bench/probe_cost.py " + " ".join(argv if argv is not None else sys.argv[1:])
    F_attn, F_pad = o.pop("F_attn"), o.pop("F_pad")
    o, clamped = clamp_fixed(o)  # a residual below 0 (a noisy machine): 0, named in the source
    dev = {"name": f"cpu-{platform.machine()}-{a.threads}thread", "F": F, "F_attn": F_attn, "F_pad": F_pad, "BW": BW,
           "wbytes": 4,
           "kvbytes": 4,
           "cores": os.cpu_count(), "oversub": oversub, "overheads": o,
           "source": f"{cmd.strip()} (CPU seconds, {a.stat} of {a.repeats} x {a.rounds} rounds; "
                     f"{os.cpu_count()} cores, "
                     f"{platform.processor() or platform.machine()}, torch {torch.__version__}, "
                     f"{time.perf_counter() - t0:.0f} s wall, niceness {os.getpriority(os.PRIO_PROCESS, 0)}, "
                     f"load average {load0:.2f} at the start and "
                     f"{os.getloadavg()[0]:.2f} at the end; oversub rounds {[round(r, 3) for r in ratios]}"
                     f"{'; ' + clamped if clamped else ''})"}
    Device(**dev).check()  # what harness.cost_check will load
    os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
    with open(a.out, "w") as f:
        json.dump(dev, f, indent=1)
    print(json.dumps(dev, indent=1))
    print(f"wrote {a.out}")


if __name__ == "__main__":
    from parallel.cli import run_main  # an error: one line, exit 1 (COSPEC_TRACEBACK=1: the traceback)
    run_main(main, __file__)
