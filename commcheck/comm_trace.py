"""The communication a training step issues, per rank, as a trace that nccl_check.py replays under NCCL's rules; from
the schedule's own plan (fast, any layout) or recorded from the real code under gloo (the tests show both equal).

A trace is a list of events per rank:

    ("call", id, kind, group, ops)    kind "p2p" (a single isend/irecv/send/recv), "batch" (one batch_isend_irecv)
                                      or "coll"; group = (name, ranks); ops = ((op, peer, bytes), ...), op "send" or
                                      "recv" with a global peer, or a collective's name with peer None
    ("wait", id)                      the compute stream waits for that call (NCCL: the host runs on)
    ("host",)                         a host sync point (.item(), .tolist(), a copy to the host, an object
                                      collective): the host waits for every call this rank has waited on
    ("sync",)                         a device-wide synchronisation (cudaDeviceSynchronize; the caching allocator's
                                      retry after an out-of-memory): waits for every call this rank has issued

Under CP the ring attention's exchanges inside one action are written as one "batch" on the cp group: all of them are
batched, and every CP rank of a stage issues the same ones at the same point; `comparable` folds the recorded runs
alike.

    layout_traces(2, 2, 1, "1f1b", 4, taps=(-1, 1, 2, 4))      # {rank: events} of one step on a pp2 x cp2 mesh
    with CommRecorder() as rec: ...                            # the real code's events on this rank, under gloo

Letters: pp / cp / dp mesh sizes, s stage, c CP rank, d DP replica, M microbatches, m microbatch.
"""
from __future__ import annotations

import functools
import inspect

import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

from parallel.grid import warm_up_plan
from parallel.pp_schedule import p2p_plan, schedule_actions, split_layers, tap_depth
from tapchannel import tap_owners


# ------------------------------------------------------------------------------------- traces from the schedule's plan
class _Trace:
    def __init__(self, rank):
        self.rank, self.events, self.n = rank, [], 0

    def call(self, kind, group, ops):
        self.n += 1
        self.events.append(("call", self.n, kind, group, tuple(ops)))
        return self.n

    def wait(self, cid):
        if cid is not None:
            self.events.append(("wait", cid))

    def sync(self):
        self.events.append(("sync",))

    def host(self):
        self.events.append(("host",))


def layout_traces(pp, cp, dp, schedule, M, *, taps=(), n_layers=None, draft_cp=False, tied=True, warm=True,
                  fused=True, tokens=None, hidden=8, itemsize=8, device_sync=False, post_ahead=False) -> dict:
    """{global rank: events} of one training step (after the mesh warm-up if warm) on every rank of the layout.
    fused=False replays the old schedule (single blocking recv, single isend per action, pair communicators; warm-up
    then covers its pipeline links too). tokens[m]: rows of microbatch m on a rank (the same on every CP rank);
    bytes = rows * hidden * itemsize. device_sync: a device-wide sync inside every action on every rank (where the
    stage's forward or backward allocates) and after the draft. post_ahead replays the old TapChannel, whose last
    stage pre-posted the receives of microbatches 0..depth-1 and re-posted m + depth when done with m."""
    n_layers = n_layers or 2 * pp
    tokens = tokens or [4] * M
    return {(d * pp + s) * cp + c: step_trace(pp, cp, dp, d, s, c, schedule, M, taps, n_layers, draft_cp, tied,
                                              warm, fused, tokens, hidden * itemsize, (device_sync, post_ahead))
            for d in range(dp) for s in range(pp) for c in range(cp)}


def _groups(pp, cp, dp, d, s, c):
    at = lambda d_, p_, c_: (d_ * pp + p_) * cp + c_  # noqa: E731  (grid.py's layout)
    pipe = tuple(at(d, s_, c) for s_ in range(pp))
    return pipe, {"world": ("world", tuple(range(pp * cp * dp))), "pp": ("pp", pipe), "tap": ("tap", pipe),
                  "embed": ("embed", (pipe[0], pipe[-1])), "cp": ("cp", tuple(at(d, s, c_) for c_ in range(cp))),
                  "dp": ("dp", tuple(at(d_, s, c) for d_ in range(dp)))}


def _warm_up(t, pp, cp, dp, fused, pipe, G):
    plan = warm_up_plan(pp, cp, dp)
    if not fused:  # the old schedule's single P2P used a pair communicator per pipeline link
        plan += [("link", "pp", (ranks[s], ranks[s + 1])) for kind, name, ranks in plan
                 if kind == "coll" and name == "pp" for s in range(len(ranks) - 1)]
    for kind, name, ranks in plan:
        if t.rank not in ranks:
            continue
        if kind == "coll":
            t.wait(t.call("coll", (name, tuple(ranks)), [("all_reduce", None, None)]))
        else:
            a, b = ranks
            op = ("send", b, 4) if t.rank == a else ("recv", a, 4)
            t.wait(t.call("p2p", (name, tuple(pipe)), [op]))


def step_trace(pp, cp, dp, d, s, c, schedule, M, taps, n_layers, draft_cp, tied, warm, fused, tokens, row_bytes,
               tap_flags=(False, False)):
    """The events of rank (d, s, c), in the order of PipelineSchedule.step, TapChannel and the reductions;
    tap_flags = (device_sync, post_ahead) as in layout_traces."""
    pipe, G = _groups(pp, cp, dp, d, s, c)
    t = _Trace(pipe[s])
    if warm and pp * cp * dp > 1:
        _warm_up(t, pp, cp, dp, fused, pipe, G)
    g = _StepGen(t, pp, cp, s, c, schedule, M, taps, n_layers, draft_cp, pipe, G, tokens, row_bytes, *tap_flags)
    g.run_fused() if fused else g.run_old()
    for cid in g.tap_sends:
        t.wait(cid)  # TapChannel.finish
    if pp > 1 and tied and s in (0, pp - 1):
        t.wait(t.call("coll", G["embed"], [("all_reduce", None, None)]))
    for _ in ("grads", "loss scalars"):  # _reduce_grads (one bucket per group), then _reduce_scalars
        for name, n in (("cp", cp), ("dp", dp)):
            if n > 1:
                t.wait(t.call("coll", G[name], [("all_reduce", None, None)]))
    if pp > 1:
        t.wait(t.call("coll", G["pp"], [("broadcast", None, None)]))
    t.host()  # the step's losses, read on the host
    return t.events


class _StepGen:
    """One rank's pipeline step as events: the schedule's actions, its P2P, TapChannel's ring, the CP exchanges."""

    def __init__(self, t, pp, cp, s, c, schedule, M, taps, n_layers, draft_cp, pipe, G, tokens, row_bytes,
                 device_sync=False, post_ahead=False):
        self.t, self.pp, self.cp, self.s, self.c, self.M, self.pipe, self.G = t, pp, cp, s, c, M, pipe, G
        self.tokens, self.row_bytes, self.last = tokens, row_bytes, pp - 1
        self.acts = schedule_actions(schedule, pp, s, M)
        owners = tap_owners(split_layers(n_layers, pp), taps) if taps and pp > 1 else {}
        self.channel = bool(taps) and pp > 1  # PipelineSchedule builds a TapChannel
        self.layers_of = [[l for l in sorted(owners) if owners[l] == s_] for s_ in range(pp)]
        self.sources = [s_ for s_ in range(self.last) if self.layers_of[s_]]
        self.depth = max(1, min(tap_depth(schedule, pp, M), M))
        self.draft_ring = draft_cp and bool(taps) and cp > 1
        self.posted, self.tap_sends, self.device_sync, self.post_ahead = {}, [], device_sync, post_ahead
        if self.channel and s == self.last and post_ahead:
            for m in range(self.depth):  # the old TapChannel.begin
                self.post(m)

    def bytes(self, m):
        return self.tokens[m] * self.row_bytes

    def post(self, m):  # TapChannel._post: one single irecv per (source, layer) into m's slot
        self.posted[m] = [self.t.call("p2p", self.G["tap"], [("recv", self.pipe[src], self.bytes(m))])
                          for src in self.sources for _ in self.layers_of[src]]

    def ring(self):  # one action's CP ring exchanges (ring attention, cp_shift): batched on the cp group
        if self.cp > 1:
            ranks = self.G["cp"][1]
            nxt, prv = ranks[(self.c + 1) % self.cp], ranks[(self.c - 1) % self.cp]
            self.t.wait(self.t.call("batch", self.G["cp"], [("send", nxt, None), ("recv", prv, None)]))

    def compute(self, kind, m):  # the action itself: stage forward/backward; on the last stage F(m)'s taps + draft
        tapped = kind == "F" and self.s == self.last and self.channel
        if tapped and not self.post_ahead:
            self.post(m)  # TapChannel.post(m), as F(m) starts
        self.ring()
        if self.device_sync:
            self.t.sync()  # e.g. an out-of-memory retry while the stage's forward or backward allocates
        if tapped:
            for cid in self.posted.pop(m):  # TapChannel.recv(m)
                self.t.wait(cid)
            if self.draft_ring:
                self.ring()
            self.t.host()  # the draft's metrics, read on the host (one tolist per draft per microbatch)
            if self.device_sync:
                self.t.sync()  # ... or while the draft's loss and backward allocate
            if self.post_ahead and m + self.depth < self.M:  # the old TapChannel.release(m)
                self.post(m + self.depth)

    def send_taps(self, kind, m):  # TapChannel.send after F(m) on a source
        if kind == "F" and self.channel and self.s < self.last:
            for _ in self.layers_of[self.s]:
                self.tap_sends.append(self.t.call("p2p", self.G["tap"], [("send", self.pipe[self.last],
                                                                            self.bytes(m))]))

    def _batch(self, ops):
        if not ops:
            return None
        return self.t.call("batch", self.G["pp"], [(op, self.pipe[peer], self.bytes(m)) for op, _, m, peer in ops])

    def run_fused(self):  # PipelineSchedule.step today
        plan = p2p_plan(self.acts, self.s, self.pp)
        pending = self._batch(plan[0])
        for i, (kind, m) in enumerate(self.acts):
            self.t.wait(pending)
            self.compute(kind, m)
            pending = self._batch(plan[i + 1])
            self.send_taps(kind, m)
        self.t.wait(pending)

    def run_old(self):  # the earlier schedule: blocking single recv before an action, single isend after it
        sends = []
        for kind, m in self.acts:
            peer = self.s - 1 if kind == "F" else self.s + 1
            if 0 <= peer <= self.last:
                self.t.wait(self.t.call("p2p", self.G["pp"], [("recv", self.pipe[peer], self.bytes(m))]))
            self.compute(kind, m)
            peer = self.s + 1 if kind == "F" else self.s - 1
            if 0 <= peer <= self.last:
                sends.append(self.t.call("p2p", self.G["pp"], [("send", self.pipe[peer], self.bytes(m))]))
            self.send_taps(kind, m)
        for cid in sends:
            self.t.wait(cid)


# ------------------------------------------------------------------------------------- traces from the real code
class CommRecorder:
    """Logs this process's torch.distributed calls as trace events while active (patching both namespaces, so that
    P2POp's identity check still holds). Group names are resolved at the end from `names` {process group: name}
    (Grid.handles gives them; the default group is "world"). Works are wrapped so that their first wait is logged.
    The object collectives and barrier block the host on NCCL too: a host sync follows them; host_sync() logs one
    from outside (tests/comm_record.py calls it from a dispatch mode at every op that reads the device).

        with CommRecorder() as rec:
            grid = Grid.build(pp=2, cp=2); PipelineSchedule(...).step(...)
        events = rec.events({pg: name for (name, _), pg in grid.handles.items()})"""
    P2P = ("isend", "irecv", "send", "recv")
    COLL = ("all_reduce", "broadcast", "all_gather", "all_gather_into_tensor", "reduce_scatter_tensor", "reduce",
            "barrier", "all_gather_object", "broadcast_object_list", "gather_object")
    HOST = ("barrier", "all_gather_object", "broadcast_object_list", "gather_object")  # block the host on NCCL too

    def __init__(self):
        self.raw, self.n, self.depth, self.waited = [], 0, 0, set()
        self.wait_timeouts = {}  # call id -> the timeout of each wait() on its works (None: a stream wait on NCCL)

    def __enter__(self):
        self.saved = {op: getattr(c10d, op) for op in self.P2P + self.COLL + ("batch_isend_irecv",)}
        for op, fn in self.saved.items():
            wrapper = functools.partial(self._call, op, fn, inspect.signature(fn))
            setattr(dist, op, wrapper)
            setattr(c10d, op, wrapper)
        return self

    def __exit__(self, *exc):
        for op, fn in self.saved.items():
            setattr(dist, op, fn)
            setattr(c10d, op, fn)

    def _log_call(self, kind, group, ops):
        self.n += 1
        group = None if group is dist.group.WORLD else group  # named now: WORLD is None after destroy_process_group
        ranks = tuple(dist.get_process_group_ranks(group)) if group is not None else tuple(
            range(dist.get_world_size()))
        self.raw.append(("call", self.n, kind, (group, ranks), tuple(ops)))
        return self.n

    def _wait(self, cid):
        if cid not in self.waited:
            self.waited.add(cid)
            self.raw.append(("wait", cid))

    def _call(self, op, fn, sig, /, *args, **kw):  # positional-only: the wrapped call may pass op=
        if self.depth:  # inside batch_isend_irecv or a collective built on others: logged by the outer call
            return fn(*args, **kw)
        a = sig.bind(*args, **kw).arguments
        if op == "batch_isend_irecv":
            kind = lambda f: f.args[0] if isinstance(f, functools.partial) else f.__name__  # noqa: E731  isend/irecv
            ops = [("send" if kind(p.op) == "isend" else "recv", p.peer, p.tensor.numel() * p.tensor.element_size())
                   for p in a["p2p_op_list"]]
            cid = self._log_call("batch", a["p2p_op_list"][0].group, ops)
        elif op in self.P2P:
            peer = next(a[k] for k in ("dst", "src") if a.get(k) is not None)
            t = a["tensor"]
            cid = self._log_call("p2p", a.get("group"), [("send" if "send" in op else "recv", peer,
                                                          t.numel() * t.element_size())])
        else:
            cid = self._log_call("coll", a.get("group"), [(op, None, None)])
        self.depth += 1
        try:
            out = fn(*args, **kw)
        finally:
            self.depth -= 1
        if op in ("send", "recv") or (op in self.COLL and not a.get("async_op", False)):
            self._wait(cid)
            if op in self.HOST:
                self.host_sync()
            return out
        if op == "batch_isend_irecv":
            return [_Work(w, self, cid) for w in out]
        return _Work(out, self, cid)

    def host_sync(self):
        """Log a host sync point (("host",)) here, unless inside a logged call or right after another one."""
        if not self.depth and (not self.raw or self.raw[-1] != ("host",)):
            self.raw.append(("host",))

    def events(self, names: dict) -> list:
        """The trace with every group as (name, ranks)."""
        name = lambda g: "world" if g is None else names.get(g, "?")  # noqa: E731
        return [ev[:3] + ((name(ev[3][0]), ev[3][1]), ev[4]) if ev[0] == "call" else ev for ev in self.raw]


class _Work:
    def __init__(self, work, rec, cid):
        self._work, self._rec, self._cid = work, rec, cid

    def wait(self, *args, **kw):
        self._rec._wait(self._cid)
        self._rec.wait_timeouts.setdefault(self._cid, []).append(args[0] if args else kw.get("timeout"))
        return self._work.wait(*args, **kw)

    def __getattr__(self, name):
        return getattr(self._work, name)


def comparable(events) -> list:
    """A trace reduced to what recorded and generated traces must share: each run of CP-group events (the ring's
    exchanges and their waits inside one action) becomes one "cp" mark; the waits on TapChannel's sends are dropped
    (the real code skips those it has seen complete, a matter of timing); host syncs dropped (a recorded draft hook may
    be a stand-in); collectives' bytes dropped; ids renumbered."""
    ids, out, cp_calls = {}, [], set()
    tap_sends = {ev[1] for ev in events if ev[0] == "call" and ev[3][0] == "tap" and ev[4][0][0] == "send"
                 and ev[2] == "p2p"}
    for ev in events:
        if ev[0] == "host":
            continue
        if ev[0] == "sync":
            item = ev
        elif ev[0] == "call" and ev[3][0] == "cp" and ev[2] == "batch":
            cp_calls.add(ev[1])
            item = ("cp",)
        elif ev[0] == "wait":
            if ev[1] in tap_sends:
                continue
            item = ("cp",) if ev[1] in cp_calls else ("wait", ids[ev[1]])
        else:
            ids[ev[1]] = len(ids) + 1
            ops = tuple((op, peer, None if ev[2] == "coll" else b) for op, peer, b in ev[4])
            item = ("call", ids[ev[1]], ev[2], ev[3], ops)
        if not (item == ("cp",) and out and out[-1] == ("cp",)):
            out.append(item)
    return out
