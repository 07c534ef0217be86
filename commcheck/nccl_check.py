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
    4. a wait is a stream wait (parallel/waits.py: Work.wait() without a timeout): the compute stream waits for the
       call and the host runs on. A call issued after it queues behind it on the device (its NCCL stream waits for the
       compute stream's state at issue), so it starts only once every call the rank had waited on is complete;
    5. what blocks the host: a host sync point (("host",): .item(), a copy to the host, an object collective; it waits
       for every call the rank has waited on), and a device-wide synchronisation (("sync",): cudaDeviceSynchronize,
       the caching allocator's retry after an out-of-memory, which can strike wherever a rank allocates; it waits for
       every call the rank has issued, its unwaited receives included). Nothing after either is issued until then.

waits="host" replays rule 4 as the host waiting at every wait (gloo's bounded waits; NCCL's with a timeout, which
poll). It never passes a trace that waits="stream" fails: a host that blocks less issues the same calls in the same
order, no later, under the same device-side rules; so a trace that passes under "host" passes under "stream", and
"stream" differs only where a host-blocking event (a creation, a sync) follows a wait.

simulate() runs these rules to a fixed point; ranks left blocked are a deadlock, reported with the ops that wait on
each other. Traces come from two places that the tests show equal: comm_trace.CommRecorder logs what the real code
issues under gloo (torch.distributed patched), and comm_trace.layout_traces generates it from the schedule's own plan
(pp_schedule.p2p_plan, grid.warm_up_plan, TapChannel's ring), which is fast enough to sweep every layout.
Whole train.py runs (warm-ups, rollout, updates, refit, eval, checkpoint), recorded, are kept and replayed by
recorded.py.

The trace format (("call", id, kind, group, ops), ("wait", id), ("host",) and ("sync",) per rank) is comm_trace.py's.

    python -m commcheck.nccl_check   # sweep pp 2-4 x M 1-8 x cp 1-2 x dp 1-2 x drafts (with device syncs too), then
                                     # the old bugs
"""
from __future__ import annotations

from collections import defaultdict, deque

from commcheck.comm_trace import layout_traces
from model import EMBED_TAP, default_tap_layers

WAITS = ("stream", "host")


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
    if ev[0] in ("sync", "host"):
        return {"sync": "device sync", "host": "host sync"}[ev[0]]
    _, cid, kind, (name, ranks), ops = ev
    body = ", ".join(f"{op} {'->' if op == 'send' else '<-' if op == 'recv' else ''}"
                     f"{'' if peer is None else f' rank {peer}'}".strip() for op, peer, _ in ops)
    return f"#{cid} {kind} [{body}] on {name}{list(ranks)}"


class _Rank:
    """One rank's host and device state: where its host is, its issued calls per communicator, the calls it waited
    on (rule 4) and those still open."""

    def __init__(self, r, events):
        self.r, self.events, self.pc, self.waited, self.open = r, events, 0, [], 0


def simulate(traces: dict, waits: str = "stream") -> list:
    """Replay {rank: events} under the rules above (waits: "stream", NCCL's, or "host", every wait blocking the
    host). Returns [] if every rank finishes, else one line per blocked rank (and per mismatch) naming what it waits
    for and where the partner op is."""
    if waits not in WAITS:
        raise ValueError(f"waits={waits!r}: expected one of {WAITS}")
    st = {r: _Rank(r, evs) for r, evs in traces.items()}
    created, want = set(), {}  # communicators made; rank -> communicator it blocks on creating (rule 1)
    queue = defaultdict(deque)  # (rank, communicator) -> issued, unfinished calls, in issue order (rule 2)
    seq = defaultdict(int)  # ops issued so far per (communicator, src, dst, op) or (communicator, rank, "coll")
    done, errors = set(), []
    members = {comm_of(r, *ev[2:5])[0]: comm_of(r, *ev[2:5])[1] for r, evs in traces.items() for ev in evs
               if ev[0] == "call"}
    moved = True
    while moved:
        moved = False
        for r, me in st.items():
            while me.pc < len(me.events):
                ev = me.events[me.pc]
                if ev[0] != "call":
                    if _host_blocked(me, ev, waits, done):
                        break
                else:
                    key, who = comm_of(r, *ev[2:5])
                    if key not in created:
                        want[r] = key
                        if not all(want.get(m) == key for m in who):
                            break
                        created.add(key)
                        for m in who:
                            want.pop(m)
                    me.waited = [c for c in me.waited if (r, c) not in done]
                    queue[(r, key)].append(_issue(r, ev, key, seq, list(me.waited)))
                    me.open += 1
                me.pc += 1
                moved = True
        moved = _match(queue, members, done, errors, st) or moved
    return errors + _blocked(st, want, queue, done)


def _host_blocked(me, ev, waits, done) -> bool:
    """Rules 4 and 5 on the host: does the event stop it here? A stream wait only records the call waited on."""
    if ev[0] == "wait":
        if waits == "host":
            return (me.r, ev[1]) not in done
        me.waited.append(ev[1])
        return False
    if ev[0] == "host":
        me.waited = [c for c in me.waited if (me.r, c) not in done]
        return bool(me.waited)
    return me.open > 0  # "sync": everything issued


def _issue(r, ev, key, seq, after) -> dict:
    """A call as it sits in its communicator's queue: its ops, each named by its place in the matching order, and the
    waited calls it queues behind on the device (rule 4)."""
    call = {"rank": r, "cid": ev[1], "ev": ev, "key": key, "ids": [], "after": after}
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


def _ready(call, done) -> bool:
    call["after"] = [c for c in call["after"] if (call["rank"], c) not in done]
    return not call["after"]


def _match(queue, members, done, errors, st) -> bool:
    """Rule 3 on the calls at the head of their queues whose stream waits are over (rule 4); completes calls whose
    ops have all met. True if any op met."""
    active = defaultdict(dict)  # op identity -> {"send"/"recv" or member rank: (call, op, bytes)}
    for q in queue.values():
        if q and _ready(q[0], done):
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
            st[r].open -= 1
    return progressed


def _blocked(st, want, queue, done) -> list:
    """The deadlock, rank by rank: where each blocked rank's host is, what its calls wait for, where the partners
    are."""
    lines = []
    pending = defaultdict(list)  # rank -> its unfinished calls, in issue order
    for (r, _), q in queue.items():
        pending[r] += q
    for r, me in st.items():
        mine = sorted(pending[r], key=lambda c: c["cid"])
        at = me.events[me.pc] if me.pc < len(me.events) else None
        if at is None and not mine:
            continue
        if r in want:
            key = want[r]
            others = [m for m in comm_of(r, at[2], at[3], at[4])[1] if want.get(m) != key]
            lines.append(f"rank {r}: blocks creating the communicator {key} for {_describe(at)}; rank(s) "
                         f"{others} never join: " + "; ".join(f"rank {m} is at {_where(st, m)}" for m in others))
        elif at is not None and at[0] == "sync":
            lines.append(f"rank {r}: device sync waits for " + _calls(r, [q[0] for k, q in queue.items()
                                                                          if k[0] == r and q], queue, st, done))
        elif at is not None and at[0] == "host":
            lines.append(f"rank {r}: host sync waits for " + _calls(r, [c for c in mine if c["cid"] in me.waited],
                                                                    queue, st, done))
        elif at is not None:
            lines.append(f"rank {r}: {_describe(at)} of " + _calls(r, [c for c in mine if c["cid"] == at[1]], queue,
                                                                   st, done))
        else:
            lines.append(f"rank {r}: finished issuing, ops never matched: " + _calls(r, mine, queue, st, done))
    return lines


def _calls(r, calls, queue, st, done, most=3) -> str:
    """Each call and why it has not completed; the calls that could run first (not queued behind a wait), at most
    `most` of them."""
    calls = sorted(calls, key=lambda c: not _ready(c, done))
    more = f"; and {len(calls) - most} more" if len(calls) > most else ""
    return "; ".join(f"{_describe(c['ev'])}: {_why(r, c, queue, st, done)}" for c in calls[:most]) + more or "?"


def _where(st, r):
    me = st[r]
    return _describe(me.events[me.pc]) if me.pc < len(me.events) else "the end of its trace"


def _why(r, call, queue, st, done):
    if not _ready(call, done):
        return f"queued on the stream behind its wait #{call['after'][0]}"
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
            out.append(f"its {op} with rank {peer} is not issued there yet (rank {peer} is at {_where(st, peer)})")
        else:
            head = queue[(peer, ident[0])][0]
            out.append(f"its {op} with rank {peer} is queued there behind {_describe(head['ev'])}")
    return "; ".join(dict.fromkeys(out))  # once each


# ------------------------------------------------------------------------------------------------------------- demo
def sweep(pps=(2, 3, 4), Ms=range(1, 9), cps=(1, 2), dps=(1, 2), waits="stream", **old) -> dict:
    """{(pp, cp, dp, schedule, drafts): [M that deadlock]} over the grid, replayed with `waits` (simulate's); old =
    layout_traces flags (warm, fused, device_sync, post_ahead)."""
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
                                                                    **old), waits)]
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
        for waits in WAITS:
            res = sweep(waits=waits, **flags)
            bad = {k: v for k, v in res.items() if v}
            print(f"{title}, {waits} waits: {len(res) - len(bad)} of {len(res)} layouts deadlock-free for every M "
                  "in 1..8")
            for (pp, cp, dp, schedule, draft), Ms in list(bad.items())[:2]:
                print(f"  pp={pp} cp={cp} dp={dp} {schedule} drafts={draft}: deadlocks at M = {Ms}")
    taps = default_tap_layers(4) + (EMBED_TAP,)
    for title, flags in (("old crossed init (pp=2, M=2, no warm-up)", dict(warm=False, fused=False, post_ahead=True)),
                         ("old 1F1B send/send (pp=2, M=2)", dict(fused=False))):
        print(f"\n{title}:")
        for line in simulate(layout_traces(2, 1, 1, "1f1b", 2, taps=taps, n_layers=4, **flags)):
            print("  " + line)
