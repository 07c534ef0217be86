"""The cost model's communication term (harness/cost_model.py): the exchanges and collectives one rank issues in one
update on a pp x cp x dp mesh, counted from the code that issues them, and their seconds from two device figures.

    n = comm_counts(a, w)            # {"stage": (ops, bytes) per stage pass, "post": (ops, bytes) per update, ...}
    seconds = ops o_comm + bytes / BW_comm                                  (0 on one process: no peer)

Per stage pass (one micro-batch's F and B on one stage; L_s = L / pp layers, T tokens of the micro-batch on this
rank, kv = n_kv d, H hidden, b bytes per activation value, 4 for the fp32 gradient accumulators):

    context ring (cp > 1; attention_cp._RingBranchAttention, per layer): forward cp - 1 K/V hops, backward cp - 1
        K/V hops and cp dK/dV hops (the last brings each block home); activation checkpointing runs the forward
        twice: + (cp - 1) hops.  ops  = L_s (3 cp - 2 [+ cp - 1])
                                  bytes = L_s (2 (cp - 1) [+ (cp - 1)] 2 T kv b + cp 2 T kv 4)      (sent by this rank)
    pipeline (pp > 1; pipeline.p2p_plan, one batch_isend_irecv per plan entry, a send fused with the next
        receive): on the last stage, the receive of F(m)'s input and the send of B(m)'s output go in one batch, one
        per micro-batch, and one more for the last send (counted after the pipeline); stage 0 alike, a middle stage
        more.  ops = 1, bytes = T H b
    TapChannel (updates that train the drafts; tapchannel.py): the last stage receives each tap held by another
        stage (the embedding and EAGLE-3's low / mid / high layers: those not on the last stage), one receive per tap
        and micro-batch.  ops = taps off the last stage, bytes = that x T H b

Per update, after the pipeline (every rank at once):

    gradients (pipeline._reduce_grads): the tied embedding summed between the first and last stage (pp > 1, tied;
        V H 4 bytes), buckets of 64 MiB (pipeline.grad_buckets) all-reduced over CP (cp > 1) and over DP (dp > 1), the
        stage's P_s weights x 4 bytes,
        x 2 (a ring all-reduce sends each byte about twice)
    scalars (pipeline._reduce_scalars, dist_step._clip_policy_grads, parallel/consistency.check_same_cu_seqlens):
        the loss over CP, DP and a broadcast over PP; the gradient norm's squares over PP; the micro-batches'
        boundaries' fingerprint gathered over CP                               one op each where that group has > 1
    statistics (dist_step.DistCotrainer.step): one all-reduce and one all_gather_object (two gathers: sizes, then
        the pickled metrics) on the world                                      W > 1
Per later update's pi_old, a stage pass forward only ("forward"): the forward's K/V hops and the activations' send.

Per RL step ("step"): one all-reduce of the phases' CPU seconds (harness/update.world_cpu, W > 1) and the refit after
the last update (dist_step.DistCotrainer.refit): pp broadcasts of the stages' weights and one of each trained draft
over the pipeline group (pp > 1; a rank sends its own stage and receives the rest: (P + drafts P_d) b bytes moved per
rank), then one all_gather of the models' fingerprints (8 bytes each) on the world. Runs made before it refitted
after every update, unchecked (Workload.refit_once false: the broadcasts in "post").


Left out: ZeRO-1's traffic (--zero1: the stage's gradients reduce-scattered over its DP x CP ranks instead of
all-reduced, the updated weights all-gathered after the step), the drafts' own CP traffic inside TTT (cp_shift, the
loss's halo rows, ring_sum: in draft_train), the rollout phase's gathers, and overlap (a hop posted before the block
it feeds is computed: the model charges it in full, which on a CPU -- gloo's transport threads share the cores with
the compute -- is about what happens).
"""
from __future__ import annotations

import math

from harness.cost_inputs import Arch, Device
from pipeline import REDUCE_BUCKET_MIB


def remote_taps(layers: int, pp: int) -> int:
    """Taps TapChannel carries to the last stage: the embedding (stage 0's) and EAGLE-3's three layers, those not on
    the last stage (model.default_tap_layers, pipeline's even split)."""
    if pp <= 1:
        return 0
    from model import default_tap_layers
    from parallel.pp_schedule import split_layers
    first_last = split_layers(layers, pp)[-1][0]
    return 1 + sum(1 for i in default_tap_layers(layers) if i < first_last)


def comm_counts(a: Arch, w, T: float, act_bytes: float = 4.0) -> dict:
    """(ops, bytes sent by this rank) per stage pass ("stage"), per update for the taps ("taps", on updates that
    train the drafts) and after the pipeline ("post"), and per RL step ("step"); w a cost_model.Workload, T its tokens
    per micro-batch and rank."""
    Ls, kv, cp, pp, dp = a.layers / w.pp, a.kv_dim, w.cp, w.pp, w.dp  # T: per micro-batch, M_r = w.mb per rank
    stage_ops = stage_bytes = 0.0
    fwd_ops = fwd_bytes = 0.0  # a no-grad forward's (pi_old): its K/V hops and the activations' send
    if cp > 1:
        fwd = (cp - 1) * (2 if w.checkpointing else 1)  # K/V hops of the forward (twice with checkpointing)
        stage_ops += Ls * (fwd + (cp - 1) + cp)
        stage_bytes += Ls * ((fwd + cp - 1) * 2 * T * kv * act_bytes + cp * 2 * T * kv * 4)
        fwd_ops, fwd_bytes = Ls * (cp - 1), Ls * (cp - 1) * 2 * T * kv * act_bytes
    if pp > 1:
        stage_ops += 1
        stage_bytes += T * a.hidden * act_bytes
        fwd_ops, fwd_bytes = fwd_ops + 1, fwd_bytes + T * a.hidden * act_bytes
    n_taps = remote_taps(a.layers, pp)
    stage_params = a.params / pp
    post_ops = post_bytes = 0.0
    if pp > 1 and a.tied:
        post_ops, post_bytes = post_ops + 1, post_bytes + 2 * a.vocab * a.hidden * 4
    for n in (cp, dp):
        if n > 1:
            buckets = math.ceil(stage_params * 4 / (REDUCE_BUCKET_MIB * 2**20))
            post_ops, post_bytes = post_ops + buckets, post_bytes + 2 * stage_params * 4
    post_ops += 2 * (cp > 1) + (dp > 1) + 3 * (pp > 1)  # the loss over CP, DP, PP; the gradient norm over PP;
    # the micro-batches' boundaries checked alike over CP; the pipeline's last batch
    if w.world > 1:
        post_ops += 3  # the statistics: one all-reduce, one all_gather_object (two gathers)
    step_ops, step_bytes = (1.0 if w.world > 1 else 0.0), 0.0  # the phases' CPU seconds
    refit_ops, refit_bytes = (pp + w.drafts, (a.params + w.drafts * Arch.draft_of(a, 3, w.draft_vocab).params)
                              * act_bytes) if pp > 1 else (0, 0.0)
    if w.refit_once:  # one refit per RL step, then its check: one fingerprint per model on the world
        step_ops, step_bytes = step_ops + refit_ops + (w.world > 1), step_bytes + refit_bytes + 8 * (1 + w.drafts) * (
            w.world > 1)
    else:  # a refit after every update
        post_ops, post_bytes = post_ops + refit_ops, post_bytes + refit_bytes
    return {"stage": (stage_ops, stage_bytes), "taps": (n_taps * w.mb, n_taps * w.mb * T * a.hidden * act_bytes),
            "post": (post_ops, post_bytes), "step": (step_ops, step_bytes), "forward": (fwd_ops, fwd_bytes)}


def comm_seconds(dev: Device, ops_bytes: tuple) -> float:
    """ops o_comm + bytes / BW_comm (0 where the device gives no BW_comm)."""
    ops, byts = ops_bytes
    return ops * dev.o("o_comm") + (byts / dev.BW_comm if dev.BW_comm else 0.0)
