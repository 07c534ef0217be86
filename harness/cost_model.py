"""A cost model of one RL step, plain GRPO vs GRPO with speculative rollouts and draft co-training: seconds per
component and the end-to-end speedup, from acceptance, model sizes, token counts and device figures. A MODEL: its
numbers are predictions, checked against measured runs by harness/cost_check.py (docs/cost_model.md).

    python -m harness.cost_model --model mini --device cpu --rows 256 --resp_len 50 --k 4 --accept_len 4.0
    python -m harness.cost_model --model docs/examples/qwen3_8b/config.json --device h100 --resp_len 8192 ...
    python -m harness.cost_check RUN_DIR [--device cpu]              # measured vs predicted per component

Every input is checked before anything is predicted (the policy's config by model.ModelConfig, as every reader of one
is; the device's figures by Device.check; the workload's fields by CHECKS; 0 is a value, not "unset"): one line
naming the flag, field or file and what was expected.

Inputs (harness/cost_inputs.py: Arch, Device): the policy (L layers, H, heads, I, V) and its draft (one layer, fc over
3 taps, head over V_d); the device (F FLOP/s, BW bytes/s, bytes per weight b_w, fixed seconds per call o_*, cores);
the workload (Workload below). Letters: B rows per generate call (rollout_batch), p prompt and r response tokens, c the
mean context while decoding (p + r/2), k draft tokens per verify step, P TTT passes, u updates, M micro-batches
per update (all DP replicas together, as --micro_batches; each rank runs M_r = max(M / dp, 1)), pp / cp / dp the mesh
(W = pp cp dp ranks), S sequences and T tokens per rank and micro-batch.

Acceptance. alpha_j = P(draft token j kept | tokens 1..j-1 kept); tokens kept per verify step (the bonus included)

    E[kept] = 1 + sum_{i=1..k} prod_{j<=i} alpha_j                         (k = 0: 1, autoregressive)

Decode calls (t_x: one call's seconds; a layer call over n new tokens of R rows is memory- or compute-bound):

    t_layer(n, R) = max(flops_layer(c) n / F, (P_layer b_w + R c 2 n_kv d b_kv) / BW) + o_dec
    t_head(n)     = max(2 H V n / F, H V b_w / BW)
    AR step       = o_step + L t_layer(B, B) + t_head(B)
    verify step   = o_vstep + L t_layer(B(k+1), B) + t_head(B(k+1)) + (k-1) t_draft(B) + t_ext(B(k+1))
    t_draft(n)    = max(draft_flops(n) / F, draft bytes / BW) + o_dstep;   t_ext(n) = draft_flops_fc(n) / F + o_dext

Rollout (one block of B rows runs until its longest row is done: tail = E[longest] / E[r] in a block; 1 for an
engine that refills its batch, continuous batching):

    steps_AR   = tail r - 1,            steps_spec = (tail r - 1) / E[kept]
    prefill    = L t_layer(B p, B) (+ the draft's trunk over the prompts, t_ext(B p))
    reference  = L (dense B (p + r) / F + 4 n_q d B (p + tail r)^2 / F_pad + o_layer_pad) + t_head(B (p + r)) + o_ref
                 (no-grad; its attention padded to the block's longest row p + tail r, the full square, at F_pad;
                  a device with F_pad = 0: varlen, flops_layer((p + r)/2) B (p + r) / F)
    score      = B o_row                (the host: the task's scoring, packing the block, the gather's concatenation
                                         and the group advantages, per row)
    rollout    = ceil(blocks / W) (prefill + steps x step + reference + score) x C(W)
    C(A)       = 1 if A <= cores, else A / cores x oversub        (A processes sharing the cores; oversub: the CPU
                                                                   time's inflation under time slicing, probed)

Policy update (GRPO: forward + backward ~ 3x the forward FLOPs, 4x with activation checkpointing), per micro-batch on
one stage rank: T = rows (p + r) / (u M_r dp cp) tokens, S = rows / (u M_r dp) sequences, L / pp layers:

    t_stage = (L/pp) (x (dense T / F_t + attn((p+r)/2) T / F_a) + o_layer_fb + cp S o_seq_fb) + [last] 3 head(T) / F_t
              + T o_tok_fb
              (dense = 2 P_layer per token, attn = 4 n_q d c per token: F_a, the per-sequence attention blocks' rate;
               o_tok_fb: per token outside the layers -- embedding, final norm, LM-head log-probs, GRPO loss)
    update  = u ((M_r + pp - 1) t_stage + AdamW 28 bytes / weight / BW + o_upd) x C(A)  A = dp cp (M_r = 1:
              + u ((M_r + pp - 1) comm_stage + comm_post + share comm_taps)     one stage at a time), W (M_r > 1)
              + (u - 1) ((M_r + pp - 1) (t_fwd x C(A) + comm_fwd)) + comm_step
              (t_fwd: a stage's no-grad forward, pi_old of every update but the first, taken before it:
               (L/pp) (dense T / F_t + attn T / F_a + o_layer + cp S o_seq) + [last] head(T) / F_t; comm_fwd the
               forward's share of comm_stage. Workload.pi_old_forward False: runs that read pi_old from the rollout)
              (o_upd: per optimisation step, the host's: GRPO weights and packing, zero_grad, grad clip, the
               optimizer's own work, the refit of the rollout copy)
    comm_x  = ops o_comm + bytes / BW_comm, counted per rank from the mesh (harness/cost_comm.py): comm_stage the
              context ring's hops and the pipeline's exchanges of a stage pass; comm_post the gradients'
              all-reduces, the scalars, the statistics and the refit's broadcasts; comm_taps TapChannel's
              receives; 0 on one process. No C(): o_comm and BW_comm are measured with the run's processes sharing
              the cores (bench/probe_cost_comm.py: a waiting peer must first be scheduled)

Draft training (TTT, on the last stage, every trained draft, per micro-batch; F_t):

    pass 1  = (3 draft_flops_fc(T) + 2 H V T) / F_t + o_pass1 + cp S o_pass1_seq + T o_pass1_tok  (the teacher's
                                                                                    head: no grad)
    pass d  = (3 draft_flops(T) + 2 H V T) / F_t + o_pass + cp S o_pass_seq + T o_pass_tok  (d = 2..P: the branch)
              (the attention's share of draft_flops at F_a instead of F_t)
    draft   = share u M_r drafts (pass 1 + (P - 1) pass d) x C(dp cp)      (share: updates that train the drafts)
    d_opt   = share u drafts o_dopt x C(dp cp)          (each trained draft's grad clip + AdamW step; a run's timers
                                                         count it in policy_train, the check does too)

The step and the speedup (the controls a run may add -- watched drafts, the offline arm, eval -- are not the step):

    plain   = rollout_AR + reference + score + update
    cospec  = rollout_spec + reference + score + update + draft(1 draft) + d_opt(1 draft)
    speedup = plain / cospec          (rollout speedup: rollout_AR / rollout_spec)

What it leaves out (so a check can fail on them): the drafts' own CP traffic in TTT and the rollout phase's gathers
(harness/cost_comm.py), the tokenisation of prompts, the verify steps' count beyond E[kept] (the block's longest row,
which sets it, keeps fewer tokens per step than the mean row), and any difference between the probe's and the run's
shapes.
"""
from __future__ import annotations

import math
import sys
from dataclasses import dataclass, fields, replace

from parallel.cli import parser, run_main
from harness.cost_comm import comm_counts, comm_seconds
from harness.cost_inputs import (Arch, Device, attn_flops, dense_flops, draft_pass_flops, head_flops, layer_bytes,
                                 layer_flops, pad_attn_flops)


def expected_kept(k: int, alpha=(), accept_len: float = 0.0) -> float:
    """E[kept] per verify step: from per-position alpha_j (the last one repeats past its end), or an accept length
    given directly; k = 0: 1."""
    if k == 0:
        return 1.0
    if accept_len:
        if not 1 <= accept_len <= k + 1:
            raise ValueError(f"accept_len={accept_len}: expected in [1, k + 1 = {k + 1}]")
        return float(accept_len)
    if not alpha or any(not 0 <= a <= 1 for a in alpha):
        raise ValueError(f"alpha={alpha}: expected per-position acceptances in [0, 1] (or an accept_len)")
    a = list(alpha) + [alpha[-1]] * max(0, k - len(alpha))
    return 1 + sum(math.prod(a[:i + 1]) for i in range(k))


@dataclass
class Workload:
    """One RL step's shape. Every field is an input of the model (the CLI has a flag per field)."""
    rows: int = 256  # sequences per step: prompts_per_step x group_size
    prompt_len: float = 10.6  # mean prompt tokens
    resp_len: float = 50.0  # mean response tokens
    tail: float = 1.0  # E[longest response in a generate call] / E[response]: 1 for continuous batching
    rollout_batch: int = 32  # rows per generate call
    k: int = 4  # draft tokens per verify step (0: autoregressive rollouts)
    accept_len: float = 0.0  # E[kept] per verify step; 0: from alpha
    alpha: tuple = (0.8,)  # per-position acceptance alpha_j (the last repeats)
    updates: int = 2  # optimisation steps per RL step
    micro_batches: int = 1  # per update, all DP replicas together (--micro_batches): each runs M / dp of them
    ttt_passes: int = 3
    drafts: int = 1  # trained drafts in the measured step (a run with --cold_arm trains 2); the speedup uses 1
    pp: int = 1
    cp: int = 1
    dp: int = 1
    checkpointing: bool = False  # activation checkpointing: the update's forward runs twice
    draft_vocab: int = 0  # the draft head's vocabulary (0: the policy's)
    draft_share: float = 1.0  # share of the updates that train the drafts (a draft-training budget, --draft_every)
    pi_old_forward: bool = True  # updates after the first read pi_old from a no-grad forward (DistCotrainer.old_logp)
    refit_once: bool = True  # one refit per RL step, its fingerprints checked (false: one per update, unchecked)

    def __post_init__(self):
        """Every field in its range (CHECKS), all problems in one line: `--dp=-2: expected an integer >= 1`."""
        bad = [f"--{k}={v!r}: expected {want}" for k, (ok, want) in CHECKS.items()
               if not ok(v := getattr(self, k), self)]
        if bad:
            raise ValueError("; ".join(bad))

    @property
    def world(self) -> int:
        return self.pp * self.cp * self.dp

    @property
    def mb(self) -> float:
        """M_r: micro-batches each rank runs per update (dist_step.microbatches deals them out over DP; >= 1)."""
        return max(self.micro_batches / self.dp, 1.0)

    @property
    def kept(self) -> float:
        return expected_kept(self.k, self.alpha, self.accept_len)


def _int(lo):
    return (lambda v, w: isinstance(v, int) and not isinstance(v, bool) and v >= lo), f"an integer >= {lo}"


def _real(lo, hi=math.inf, what=""):
    return ((lambda v, w: isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
             and lo <= v <= hi), what or f"a finite number >= {lo}")


CHECKS = {  # Workload's fields: (test(value, workload), what is expected); 0 is a value wherever it is allowed
    "rows": _int(1), "prompt_len": _real(1), "resp_len": _real(1), "tail": _real(1), "rollout_batch": _int(1),
    "k": _int(0), "accept_len": ((lambda v, w: v == 0 or (isinstance(v, (int, float)) and 1 <= v <= w.k + 1)),
                                 "0 (from --alpha) or in [1, k + 1]"),
    "alpha": ((lambda v, w: isinstance(v, tuple) and len(v) >= 1 and all(
        isinstance(a, (int, float)) and 0 <= a <= 1 for a in v)), "per-position acceptances in [0, 1], e.g. 0.8,0.7"),
    "updates": _int(1), "micro_batches": _int(1), "ttt_passes": _int(1), "drafts": _int(0),
    "pp": _int(1), "cp": _int(1), "dp": _int(1), "checkpointing": ((lambda v, w: isinstance(v, bool)), "true or false"),
    "draft_vocab": _int(0), "draft_share": _real(0, 1, "in [0, 1]"),
    "pi_old_forward": ((lambda v, w: isinstance(v, bool)), "true or false"),
    "refit_once": ((lambda v, w: isinstance(v, bool)), "true or false"),
}


def _layer(a: Arch, dev: Device, tokens: float, rows: float, ctx: float) -> float:
    """One decode layer call: t_layer."""
    return max(layer_flops(a, tokens, ctx) / dev.F,
               layer_bytes(a, rows, ctx, dev.wbytes, dev.kvbytes) / dev.BW) + dev.o("o_dec")


def _head(a: Arch, dev: Device, tokens: float) -> float:
    return max(head_flops(a, tokens) / dev.F, a.hidden * a.vocab * dev.wbytes / dev.BW)


def _draft_step(d: Arch, dev: Device, rows: float, ctx: float) -> float:
    byts = (d.layer_params + d.hidden * d.vocab) * dev.wbytes + rows * ctx * 2 * d.kv_dim * dev.kvbytes
    return max(draft_pass_flops(d, rows, ctx, fc=False) / dev.F, byts / dev.BW) + dev.o("o_dstep")


def _draft_ext(d: Arch, dev: Device, tokens: float, ctx: float) -> float:
    return draft_pass_flops(d, tokens, ctx, fc=True) / dev.F + dev.o("o_dext")


def rollout_block(a: Arch, d: Arch, dev: Device, w: Workload, k: int) -> dict:
    """Seconds of one generate call (B rows) and of its reference log-probs, on one process at full speed."""
    B, p, r = min(w.rollout_batch, w.rows), w.prompt_len, w.resp_len  # a call holds at most the step's rows
    c = p + r / 2
    longest = max(w.tail * r, 1.0)
    prefill = a.layers * _layer(a, dev, B * p, B, p / 2) + _head(a, dev, B)
    if k == 0:
        steps = longest - 1
        step = dev.o("o_step") + a.layers * _layer(a, dev, B, B, c) + _head(a, dev, B)
    else:
        prefill += _draft_ext(d, dev, B * p, p / 2)
        steps = (longest - 1) / w.kept
        step = (dev.o("o_vstep") + a.layers * _layer(a, dev, B * (k + 1), B, c) + _head(a, dev, B * (k + 1))
                + (k - 1) * _draft_step(d, dev, B, c) + _draft_ext(d, dev, B * (k + 1), c))
    n = B * (p + r)
    if dev.F_pad:  # padded to the block's longest row, p + tail r, the full square
        att = dense_flops(a, n) / dev.F + pad_attn_flops(a, B, p + longest) / dev.F_pad
    else:  # a varlen kernel: each row's own causal half
        att = layer_flops(a, n, (p + r) / 2) / dev.F
    ref = a.layers * (att + dev.o("o_layer_pad")) + _head(a, dev, n) + dev.o("o_ref")
    return {"generate": prefill + steps * step, "reference": ref, "steps": steps, "step_s": step,
            "score": B * dev.o("o_row")}


def _contention(active: float, dev: Device) -> float:
    """Wall seconds per solo CPU second when `active` processes share dev.cores: 1 up to one process a core, else
    active / cores time slices, each slower by oversub."""
    return 1.0 if active <= dev.cores else active / dev.cores * dev.oversub


def rollout(a: Arch, d: Arch, dev: Device, w: Workload, k: int) -> dict:
    """The rollout phase's wall seconds: every rank runs ceil(blocks / W) generate calls at once."""
    blk = rollout_block(a, d, dev, w, k)
    n = math.ceil(math.ceil(w.rows / w.rollout_batch) / w.world) * _contention(w.world, dev)
    return {"generate": n * blk["generate"], "reference": n * blk["reference"], "score": n * blk["score"],
            "steps_per_block": blk["steps"]}


def _per_rank(w: Workload) -> tuple[float, float, float]:
    """(T tokens, S sequences, mean context) of one micro-batch on one rank."""
    tokens = w.rows * (w.prompt_len + w.resp_len) / (w.updates * w.mb * w.dp * w.cp)
    return tokens, w.rows / (w.updates * w.mb * w.dp), (w.prompt_len + w.resp_len) / 2


def update(a: Arch, dev: Device, w: Workload) -> float:
    """The policy update's wall seconds (GRPO forward + backward through the pipeline, AdamW), without the drafts."""
    T, S, ctx = _per_rank(w)
    x = 4 if w.checkpointing else 3
    per_layer = (x * (dense_flops(a, T) / dev.Ft + attn_flops(a, T, ctx) / dev.Fa) + dev.o("o_layer_fb")
                 + w.cp * S * dev.o("o_seq_fb"))
    if w.checkpointing:
        per_layer += dev.o("o_layer") + w.cp * S * dev.o("o_seq")
    stage = a.layers / w.pp * per_layer + 3 * head_flops(a, T) / dev.Ft + T * dev.o("o_tok_fb")
    adam = 28 * a.params / w.pp / dev.BW + dev.o("o_upd")
    active = w.dp * w.cp * (1 if w.mb == 1 else w.pp)
    n = comm_counts(a, w, T, dev.wbytes)  # 0 on one process; o_comm, BW_comm are probed at the run's process count
    comm = ((w.mb + w.pp - 1) * comm_seconds(dev, n["stage"]) + comm_seconds(dev, n["post"])
            + w.draft_share * comm_seconds(dev, n["taps"]))
    total = w.updates * (((w.mb + w.pp - 1) * stage + adam) * _contention(active, dev) + comm) + comm_seconds(
        dev, n["step"])
    if w.pi_old_forward and w.updates > 1:  # pi_old: one no-grad forward per later update, before the first
        fwd = (a.layers / w.pp * (dense_flops(a, T) / dev.Ft + attn_flops(a, T, ctx) / dev.Fa + dev.o("o_layer")
                                  + w.cp * S * dev.o("o_seq")) + head_flops(a, T) / dev.Ft)
        fwd_comm = comm_seconds(dev, n["forward"])
        total += (w.updates - 1) * (w.mb + w.pp - 1) * (fwd * _contention(active, dev) + fwd_comm)
    return total


def draft_opt(dev: Device, w: Workload, drafts: int) -> float:
    """The drafts' optimizer steps (grad clip, AdamW): one per trained draft and update that trains them, on the last
    stage (a run times them in policy_train)."""
    return w.draft_share * w.updates * drafts * dev.o("o_dopt") * _contention(w.dp * w.cp, dev)


def draft_train(a: Arch, d: Arch, dev: Device, w: Workload, drafts: int) -> float:
    """TTT's wall seconds: `drafts` drafts, P passes each, every micro-batch of every update, on the last stage."""
    T, S, ctx = _per_rank(w)
    teacher, att = head_flops(a, T), 3 * attn_flops(d, T, ctx)
    first = ((3 * draft_pass_flops(d, T, ctx, fc=True) - att + teacher) / dev.Ft + att / dev.Fa + dev.o("o_pass1")
             + w.cp * S * dev.o("o_pass1_seq") + T * dev.o("o_pass1_tok"))
    later = ((3 * draft_pass_flops(d, T, ctx, fc=False) - att + teacher) / dev.Ft + att / dev.Fa + dev.o("o_pass")
             + w.cp * S * dev.o("o_pass_seq") + T * dev.o("o_pass_tok"))
    per = first + (w.ttt_passes - 1) * later
    return w.draft_share * w.updates * w.mb * drafts * per * _contention(w.dp * w.cp, dev)


def kv_cache_bytes(a: Arch, dev: Device, w: Workload) -> float:
    """One generate call's policy KV cache at its longest: B rows x (p + tail r) positions x L layers x 2 n_kv d."""
    return w.rollout_batch * (w.prompt_len + w.tail * w.resp_len) * a.layers * 2 * a.kv_dim * dev.kvbytes


def predict(a: Arch, dev: Device, w: Workload) -> dict:
    """Every component (s) of both steps, the measured step's draft training (w.drafts drafts) and the speedups."""
    if w.draft_vocab > a.vocab:
        raise ValueError(f"--draft_vocab={w.draft_vocab}: expected <= the policy's vocabulary, {a.vocab} (0: all "
                         "of it)")
    d = Arch.draft_of(a, 3, w.draft_vocab)
    spec = rollout(a, d, dev, w, w.k) if w.k else None
    ar = rollout(a, d, dev, w, 0)
    up = update(a, dev, w)
    one = draft_train(a, d, dev, w, 1) + draft_opt(dev, w, 1)  # TTT and the optimizer step of one draft
    plain = ar["generate"] + ar["reference"] + ar["score"] + up
    out = {"rollout_ar": ar["generate"], "reference": ar["reference"], "score": ar["score"], "policy_train": up,
           "draft_train_1": one, "draft_train": draft_train(a, d, dev, w, w.drafts),
           "draft_opt": draft_opt(dev, w, w.drafts), "e_kept": w.kept, "steps_per_block_ar": ar["steps_per_block"],
           "step_plain": plain, "kv_gib": kv_cache_bytes(a, dev, w) / 2 ** 30}
    if spec is not None:
        cospec = spec["generate"] + spec["reference"] + spec["score"] + up + one
        out.update(rollout_spec=spec["generate"], steps_per_block_spec=spec["steps_per_block"], step_cospec=cospec,
                   rollout_speedup=ar["generate"] / spec["generate"], e2e_speedup=plain / cospec)
    return out


HELP = {  # the CLI's flags: Workload's fields
    "rows": "sequences per RL step (prompts_per_step x group_size)", "prompt_len": "mean prompt tokens",
    "resp_len": "mean response tokens", "tail": "E[longest response of a generate call] / E[response] (1: all equal)",
    "rollout_batch": "rows per generate call (per engine)", "k": "draft tokens per verify step (0: autoregressive)",
    "accept_len": "E[kept tokens] per verify step, the bonus included (0: from --alpha)",
    "alpha": "per-position acceptance alpha_1,alpha_2,... (the last repeats to k)",
    "updates": "optimisation steps per RL step",
    "micro_batches": "micro-batches per update, all DP replicas together (each runs M / dp)",
    "ttt_passes": "TTT passes of the draft", "drafts": "drafts trained in the step (the speedup uses 1)",
    "pp": "pipeline stages", "cp": "context-parallel ranks", "dp": "data-parallel replicas (W = pp cp dp processes)",
    "checkpointing": "activation checkpointing in the update (4x instead of 3x the forward)",
    "draft_vocab": "the draft head's vocabulary (0: the policy's)",
    "draft_share": "share of the updates that train the drafts (1: every update)",
    "pi_old_forward": "updates after the first take pi_old from one no-grad forward each (false: from the rollout)",
    "refit_once": "one refit per RL step, its fingerprints compared across the ranks (false: one per update)",
}


def parse(argv: list) -> tuple[Arch, Device, Workload]:
    ap = parser(__doc__, __file__)
    ap.add_argument("--model", default="mini", help="a model.ModelConfig preset, an HF config.json or its directory")
    ap.add_argument("--device", default="cpu", help="a device preset (cpu: this machine's probe; h100) or a JSON file")
    ap.add_argument("--flops", type=float, default=0, help="override the device's F (FLOP/s; 0: the device's)")
    ap.add_argument("--bw", type=float, default=0, help="override the device's BW (bytes/s; 0: the device's)")
    ap.add_argument("--cores", type=float, default=0, help="override the device's cores (processes at full speed; "
                                                           "0: the device's)")
    ap.add_argument("--overhead_scale", type=float, default=1.0, help="multiply every o_* (sensitivity; >= 0)")
    for f in fields(Workload):
        kind = {"bool": None, "tuple": str}.get(str(f.type), {"int": int, "float": float}.get(str(f.type), float))
        if kind is None:  # default None, not False: only a flag given on the command line replaces the default
            ap.add_argument(f"--{f.name}", action="store_true", default=None, help=HELP[f.name])
        else:
            ap.add_argument(f"--{f.name}", type=kind, default=None, help=f"{HELP[f.name]} (default {f.default})")
    a = ap.parse_args(argv)
    for k in ("flops", "bw", "cores", "overhead_scale"):
        if not (math.isfinite(getattr(a, k)) and getattr(a, k) >= 0):
            raise ValueError(f"--{k}={getattr(a, k)!r}: expected a finite number >= 0 (0: the device's own)"
                             if k != "overhead_scale" else f"--{k}={a.overhead_scale!r}: expected a finite number >= 0")
    dev = Device.load(a.device)
    dev = replace(dev, F=a.flops or dev.F, BW=a.bw or dev.BW, cores=a.cores or dev.cores,
                  overheads={k: v * a.overhead_scale for k, v in dev.overheads.items()})
    kw = {f.name: getattr(a, f.name) for f in fields(Workload) if getattr(a, f.name) is not None}  # 0 is a value
    if "alpha" in kw:
        try:
            kw["alpha"] = tuple(float(x) for x in kw["alpha"].split(","))
        except ValueError:
            raise ValueError(f"--alpha={kw['alpha']!r}: expected comma-separated numbers in [0, 1]") from None
    w = Workload(**kw)
    w.kept  # noqa: B018  (checks k, alpha, accept_len)
    return Arch.load(a.model), dev, w


def report(a: Arch, dev: Device, w: Workload, out: dict) -> str:
    """The prediction as text: inputs, then seconds per component for both steps, then the speedups."""
    lines = [f"A MODEL, not a measurement. policy: {a.layers} layers, H {a.hidden}, {a.params / 1e9:.3g}B weights; "
             f"device {dev.name} (F {dev.F:.3g} FLOP/s, BW {dev.BW:.3g} B/s, {dev.cores:g} cores)",
             f"workload: {w.rows} rows x ({w.prompt_len:g} + {w.resp_len:g}) tokens, tail {w.tail:g}, batch "
             f"{w.rollout_batch}, k {w.k}, E[kept] {out['e_kept']:.3f}, mesh pp {w.pp} cp {w.cp} dp {w.dp}; "
             f"KV cache per generate call at its longest {out['kv_gib']:.3g} GiB", "",
             f"{'component':<22}{'plain GRPO s':>14}{'co-trained spec s':>20}"]
    spec = out.get("rollout_spec")
    rows = [("rollout (generate)", out["rollout_ar"], spec), ("reference log-probs", out["reference"],
            out["reference"]), ("scoring, packing", out["score"], out["score"]),
            ("policy update", out["policy_train"], out["policy_train"]),
            ("draft training (TTT)", 0.0, out["draft_train_1"] if spec is not None else None),
            ("step", out["step_plain"], out.get("step_cospec"))]
    for name, p, s in rows:
        lines.append(f"{name:<22}{p:>14.4g}{'-' if s is None else format(s, '.4g'):>20}")
    if spec is not None:
        lines += ["", f"rollout speedup {out['rollout_speedup']:.3f}x, end-to-end step speedup "
                      f"{out['e2e_speedup']:.3f}x (rollout share of the plain step "
                      f"{out['rollout_ar'] / out['step_plain']:.0%})"]
    return "\n".join(lines)


def main(argv=None) -> int:
    a, dev, w = parse(sys.argv[1:] if argv is None else list(argv))
    print(report(a, dev, w, predict(a, dev, w)))
    return 0


if __name__ == "__main__":
    run_main(main, __file__)  # an error: one line naming the flag, field or file, exit 1
