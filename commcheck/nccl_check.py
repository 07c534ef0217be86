"""Prove the training step deadlock-free under NCCL's rules, on CPU: record (or generate) the communication ops each
rank issues, then replay them on a model of NCCL.

gloo forgives what NCCL does not: it connects every group at new_group and buffers sends. NCCL (PyTorch's lazy mode):

    1. a communicator is created on first use and creation blocks the host until every member joins: one per group
       for collectives and batched P2P (batch_isend_irecv), one per (group, pair) for a single isend/irecv;
    2. a rank runs the ops of one communicator in issue order (one stream);
    3. a send may wait until its receive is running, whatever its size (NVIDIA/nccl#479, #783): every send is a
       rendezvous with the matching receive (the k-th send a -> b on a communicator matches the k-th receive);
       a batch (one NCCL group) runs all its ops at once and completes when all have matched; a collective
       completes when every member runs it;
    4. a rank's later ops wait for what it has waited on (host wait = the compute stream waits), so an op issued
       after wait(x) starts only once x is complete;
    5. a device-wide synchronisation (cudaDeviceSynchronize; the caching allocator's retry after an out-of-memory,
       which can strike wherever a rank allocates) waits for every call the rank has issued, its receives included:
       nothing after it is issued until all of them are complete.

simulate() runs these rules to a fixed point; ranks left blocked are a deadlock, reported with the ops that wait on
each other. Traces come from two places that the tests show equal: comm_trace.CommRecorder logs what the real code
issues under gloo (torch.distributed patched), and comm_trace.layout_traces generates it from the schedule's own plan
(pp_schedule.p2p_plan, grid.warm_up_plan, TapChannel's ring), which is fast enough to sweep every layout.

The trace format (("call", id, kind, group, ops) and ("wait", id) per rank) is comm_trace.py's.

    python -m commcheck.nccl_check   # sweep pp 2-4 x M 1-8 x cp 1-2 x dp 1-2 x drafts (with device syncs too), then
                                     # the old bugs
"""
from __future__ import annotations

from collections import defaultdict, deque

from commcheck.comm_trace import layout_traces
from model import EMBED_TAP, default_tap_layers


# ------------------------------------------------------------------------------------------------ the NCCL model
def comm_of(rank: int, kind: str, group, ops):
    """(key, members) of the communicator a call runs on (rule 1)."""
    if kind == "p2p":
        pair = tuple(sorted((rank, ops[0][1])))
        return (group, pair), pair
    return (group,), tuple(group[1])


def _describe(ev):
    if ev[0] == "wait":
        return f"wait #{ev[1]}"
    if ev[0] == "sync":
        return "device sync"
    _, cid, kind, (name, ranks), ops = ev
    body = ", ".join(f"{op} {'->' if op == 'send' else '<-' if op == 'recv' else ''}"
                     f"{'' if peer is None else f' rank {peer}'}".strip() for op, peer, _ in ops)
    return f"#{cid} {kind} [{body}] on {name}{list(ranks)}"


def simulate(traces: dict) -> list:
    """Replay {rank: events} under the rules above. Returns [] if every rank finishes, else one line per blocked rank
    (and per mismatch) naming what it waits for and where the partner op is."""
    pc = {r: 0 for r in traces}
    created, want = set(), {}  # communicators made; rank -> communicator it blocks on creating (rule 1)
    queue = defaultdict(deque)  # (rank, communicator) -> issued, unfinished calls, in issue order (rule 2)
    seq = defaultdict(int)  # ops issued so far per (communicator, src, dst, op) or (communicator, rank, "coll")
    done, errors = set(), []
    members = {comm_of(r, *ev[2:5])[0]: comm_of(r, *ev[2:5])[1] for r, evs in traces.items() for ev in evs
               if ev[0] == "call"}
    moved = True
    while moved:
        moved = False
        for r, evs in traces.items():
            while pc[r] < len(evs):
                ev = evs[pc[r]]
                if ev[0] == "wait":
                    if (r, ev[1]) not in done:
                        break  # rule 4: nothing after a wait is issued before it returns
                elif ev[0] == "sync":
                    if any(q for (r_, _), q in queue.items() if r_ == r):
                        break  # rule 5: a device sync waits for everything this rank has issued
                else:
                    key, who = comm_of(r, *ev[2:5])
                    if key not in created:
                        want[r] = key
                        if not all(want.get(m) == key for m in who):
                            break
                        created.add(key)
                        for m in who:
                            want.pop(m)
                    queue[(r, key)].append(_issue(r, ev, key, seq))
                pc[r] += 1
                moved = True
        moved = _match(queue, members, done, errors) or moved
    return errors + _blocked(traces, pc, want, queue)


def _issue(r, ev, key, seq) -> dict:
    """A call as it sits in its communicator's queue: its ops, each named by its place in the matching order."""
    call = {"rank": r, "cid": ev[1], "ev": ev, "key": key, "ids": []}
    for op, peer, nbytes in ev[4]:
        if op in ("send", "recv"):
            src, dst = (r, peer) if op == "send" else (peer, r)
            ident = (key, src, dst, seq[(key, src, dst, op)])  # the k-th send a -> b meets the k-th receive
            seq[(key, src, dst, op)] += 1
        else:
            ident = (key, "coll", seq[(key, r, "coll")])
            seq[(key, r, "coll")] += 1
        call["ids"].append((ident, op, nbytes))
    return call


def _match(queue, members, done, errors) -> bool:
    """Rule 3 on the calls at the head of their queues; completes calls whose ops have all met. True if any op met."""
    active = defaultdict(dict)  # op identity -> {"send"/"recv" or member rank: (call, op, bytes)}
    for q in queue.values():
        if q:
            for ident, op, nbytes in q[0]["ids"]:
                active[ident][op if op in ("send", "recv") else q[0]["rank"]] = (q[0], op, nbytes)
    progressed = False
    for ident, sides in active.items():
        if ident[1] == "coll" and len(sides) < len(members[ident[0]]) or ident[1] != "coll" and len(sides) < 2:
            continue
        sizes = {b for _, _, b in sides.values() if b is not None}
        if len(sizes) > 1 or len({o for _, o, _ in sides.values()}) > 1 + (ident[1] != "coll"):
            errors.append(f"mismatch on {ident[0]}: {[_describe(c['ev']) for c, _, _ in sides.values()]} "
                          f"(bytes {sorted(sizes)})")
        for call, _, _ in sides.values():
            call["ids"] = [x for x in call["ids"] if x[0] != ident]
        progressed = True
    for (r, _), q in queue.items():
        while q and not q[0]["ids"]:
            done.add((r, q.popleft()["cid"]))
    return progressed


def _blocked(traces, pc, want, queue) -> list:
    """The deadlock, rank by rank: what each blocked rank waits for, and where its partners are."""
    lines = []
    pending = {(c["rank"], c["cid"]): c for q in queue.values() for c in q}
    for r, evs in traces.items():
        if pc[r] == len(evs) and not any(k[0] == r for k, q in queue.items() if q):
            continue
        at = evs[pc[r]] if pc[r] < len(evs) else None
        if r in want:
            key = want[r]
            others = [m for m in comm_of(r, at[2], at[3], at[4])[1] if want.get(m) != key]
            lines.append(f"rank {r}: blocks creating the communicator {key} for {_describe(at)}; rank(s) "
                         f"{others} never join: " + "; ".join(f"rank {m} is at {_where(traces, pc, m)}"
                                                              for m in others))
        elif at is not None and at[0] == "sync":
            lines.append(f"rank {r}: device sync waits for " + "; ".join(
                f"{_describe(q[0]['ev'])}: {_why(r, q[0], queue, traces, pc)}" for k, q in queue.items()
                if k[0] == r and q))
        elif at is not None:
            call = pending.get((r, at[1]))
            why = _why(r, call, queue, traces, pc) if call else "?"
            lines.append(f"rank {r}: {_describe(at)} of {_describe(call['ev']) if call else '?'}: {why}")
        else:
            lines.append(f"rank {r}: finished with ops never matched: "
                         + "; ".join(_describe(c["ev"]) for k, q in queue.items() if k[0] == r for c in q))
    return lines


def _where(traces, pc, r):
    return _describe(traces[r][pc[r]]) if pc[r] < len(traces[r]) else "the end of its trace"


def _why(r, call, queue, traces, pc):
    q = queue[(r, call["key"])]
    if q[0] is not call:
        return f"queued behind {_describe(q[0]['ev'])} on the same communicator"
    out = []
    for ident, op, _ in call["ids"]:
        if ident[1] == "coll":
            out.append(f"{op} waits for the other members")
            continue
        peer = ident[2] if op == "send" else ident[1]
        partner = next((c for c in queue[(peer, ident[0])] if any(x[0] == ident for x in c["ids"])), None)
        if partner is None:
            out.append(f"its {op} with rank {peer} is not issued there yet (rank {peer} is at "
                       f"{_where(traces, pc, peer)})")
        else:
            head = queue[(peer, ident[0])][0]
            out.append(f"its {op} with rank {peer} is queued there behind {_describe(head['ev'])}")
    return "; ".join(out)


# ------------------------------------------------------------------------------------------------------------- demo
def sweep(pps=(2, 3, 4), Ms=range(1, 9), cps=(1, 2), dps=(1, 2), **old) -> dict:
    """{(pp, cp, dp, schedule, drafts): [M that deadlock]} over the grid; old = layout_traces flags (warm, fused,
    device_sync, post_ahead)."""
    n = max(pps) * 2
    taps = default_tap_layers(n) + (EMBED_TAP,)
    out = {}
    for pp in pps:
        for cp in cps:
            for dp in dps:
                for schedule in ("1f1b", "afab"):
                    for draft in (False, True):
                        out[(pp, cp, dp, schedule, draft)] = [
                            M for M in Ms if simulate(layout_traces(pp, cp, dp, schedule, M, n_layers=n,
                                                                    taps=taps if draft else (), draft_cp=draft,
                                                                    **old))]
    return out


if __name__ == "__main__":
    from parallel.cli import answer_help
    answer_help(__doc__, __file__)  # -h / --help: usage and summary from the docstring, exit 0
    for title, flags in (("today (warm-up, batched 1F1B)", {}), ("today, a device sync in every action",
                                                                  dict(device_sync=True)),
                         ("old TapChannel posting ahead, a device sync in every action",
                          dict(device_sync=True, post_ahead=True)),
                         ("old 1F1B, warmed up", dict(fused=False)),
                         ("old, no warm-up", dict(fused=False, warm=False, post_ahead=True))):
        res = sweep(**flags)
        bad = {k: v for k, v in res.items() if v}
        print(f"{title}: {len(res) - len(bad)} of {len(res)} layouts deadlock-free for every M in 1..8")
        for (pp, cp, dp, schedule, draft), Ms in list(bad.items())[:4]:
            print(f"  pp={pp} cp={cp} dp={dp} {schedule} drafts={draft}: deadlocks at M = {Ms}")
    taps = default_tap_layers(4) + (EMBED_TAP,)
    for title, flags in (("old crossed init (pp=2, M=2, no warm-up)", dict(warm=False, fused=False, post_ahead=True)),
                         ("old 1F1B send/send (pp=2, M=2)", dict(fused=False))):
        print(f"\n{title}:")
        for line in simulate(layout_traces(2, 1, 1, "1f1b", 2, taps=taps, n_layers=4, **flags)):
            print("  " + line)
