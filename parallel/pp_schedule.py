"""The order of a pipeline stage's work: the layer split, the actions of AFAB and 1F1B, and their point-to-point plan.

The n layers are cut into P stages ([a_s, b_s) on stage s, split_layers); the batch into M microbatches. Stage s runs
two actions per microbatch, exchanging activations and their gradients with its neighbours on the pipeline group:

    F(m):  x = recv h_{s-1}(m) (tokens on stage 0);  h_s(m) = stage_s(x);  send h_s(m) to s+1   (last: loss_m, draft)
    B(m):  g = recv dL/dh_s(m) from s+1 (last: 1);    backprop through stage_s;  send dL/dx to s-1

Two orders of the same 2M actions (schedule_actions; picotron's pipeline_parallel.py keeps both side by side too):

    AFAB   F0 F1 .. F(M-1)  B0 B1 .. B(M-1)         the reference; every microbatch's activations alive at once
    1F1B   F0 .. F(w-1), then F(m+w) B(m) pairs, then the last w B's,  w = min(P-s-1, M)
           same bubble (P-1)/(M+P-1), but stage s never holds more than P-s microbatches' activations

p2p_plan turns an order into the batches of sends and receives that pipeline.PipelineSchedule issues; tap_depth counts
the taps a source may have in flight to the last stage. Pure functions of (schedule, P, s, M): commcheck/ replays them
without processes.

Letters: P stages, s stage, M microbatches, m microbatch.
"""
from __future__ import annotations

SCHEDULES = ("afab", "1f1b")


def split_layers(n_layers: int, n_stages: int, sizes=None) -> list:
    """[(a_s, b_s)] layer range per stage. Even by default, the remainder going to the earliest stages (the last one
    also carries the LM head and the draft); `sizes` = explicit layers per stage."""
    if n_stages < 1:
        raise ValueError(f"n_stages={n_stages}: expected >= 1")
    if sizes is None:
        if n_stages > n_layers:
            raise ValueError(f"cannot split {n_layers} layers into {n_stages} pipeline stages: every stage needs "
                             f">= 1 layer (use pp <= {n_layers})")
        q, r = divmod(n_layers, n_stages)
        sizes = [q + (s < r) for s in range(n_stages)]
    sizes = [int(k) for k in sizes]
    if len(sizes) != n_stages or sum(sizes) != n_layers or min(sizes) < 1:
        raise ValueError(f"layer split {sizes}: expected {n_stages} stage sizes, each >= 1, summing to "
                         f"num_hidden_layers={n_layers}")
    bounds = [0]
    for k in sizes:
        bounds.append(bounds[-1] + k)
    return list(zip(bounds[:-1], bounds[1:]))


def schedule_actions(schedule: str, n_stages: int, stage: int, M: int) -> list:
    """The ordered actions [("F" | "B", m)] of one stage.

    Deadlock freedom needs more than the data dependencies under NCCL (a send may wait for its receive; one
    communicator runs in order): see p2p_plan and nccl_check.py. Matching: on each directed link
    only one kind of message travels (activations s -> s+1, gradients s+1 -> s), in increasing m under both orders, so
    the in-order matching of P2P messages per (peer, group) pairs every receive with the right send -- no tags."""
    if schedule not in SCHEDULES:
        raise ValueError(f"schedule={schedule!r}: expected one of {SCHEDULES}")
    if M < 1:
        raise ValueError(f"M={M} microbatches: expected >= 1")
    if schedule == "afab":
        return [("F", m) for m in range(M)] + [("B", m) for m in range(M)]
    w = min(n_stages - stage - 1, M)  # warm-up: fill the pipe below me
    acts = [("F", m) for m in range(w)]
    for m in range(M - w):  # steady state: one forward, one backward
        acts += [("F", m + w), ("B", m)]
    return acts + [("B", m) for m in range(M - w, M)]  # cool-down: drain


def tap_depth(schedule: str, n_stages: int, M: int) -> int:
    """Microbatches in flight between a source stage and the last: the tap sends a source may have pending until the
    last stage posts their receives (see tapchannel.py)."""
    return M if schedule == "afab" else min(M, n_stages)


def p2p_plan(acts, stage: int, n_stages: int) -> list:
    """The schedule's P2P as batches: plan[i] is issued just before action i (plan[len(acts)] after the last one) and
    holds the send of action i-1's output and the receive of action i's input, as (op, what, m, peer stage):

        F(m) needs ("recv", "act", m, s-1) (not on stage 0)      and yields ("send", "act", m, s+1) (not on the last)
        B(m) needs ("recv", "grad", m, s+1) (not on the last)    and yields ("send", "grad", m, s-1) (not on stage 0)

    One batch = one batch_isend_irecv = one NCCL group on the pipeline group's communicator. Fusing the send with the
    next receive is what keeps 1F1B alive under NCCL: there, stage s's "send act(m+w)" and stage s+1's "send grad(m)"
    would each wait, in order on one stream, for a receive queued behind the other's send (a send may block until its
    receive is posted, whatever its size: NVIDIA/nccl#479); in one group both progress (torch.distributed.pipelining
    fuses them alike). nccl_check.py proves every layout deadlock-free under these rules."""
    last = n_stages - 1

    def recv(a):
        kind, m = a
        if kind == "F":
            return [("recv", "act", m, stage - 1)] if stage > 0 else []
        return [("recv", "grad", m, stage + 1)] if stage < last else []

    def send(a):
        kind, m = a
        if kind == "F":
            return [("send", "act", m, stage + 1)] if stage < last else []
        return [("send", "grad", m, stage - 1)] if stage > 0 else []

    return [(send(acts[i - 1]) if i else []) + (recv(acts[i]) if i < len(acts) else []) for i in range(len(acts) + 1)]
