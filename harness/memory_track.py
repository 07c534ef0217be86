"""What a real step holds, counted: the check of the memory plan (harness/memory_plan.py) against live tensors.

Two ways of counting, both deterministic on the CPU (unlike RSS, which the allocator's caching and the interpreter
blur):

  * walking the known objects after the step (`held`): the pipeline stage's parameters, their gradients (.grad or the
    fp32 .main_grad), the optimizer's state (AdamW's m, v, ZeRO-1's master slice), every full copy a rank keeps (the
    rollout policy, the frozen reference, each draft arm without the embedding it shares with the policy), the drafts'
    optimizers and TapChannel's landing slots. Each storage is counted once, under the first component that names it.
  * a storage tracker over a phase (`StorageTracker`, a TorchDispatchMode): every op's output that owns a storage no
    input of the op owns (views, in-place ops and collectives alias an input, so they allocate nothing) is added to
    the live bytes when it appears and taken off when its storage dies (a weakref finalizer on the untyped storage,
    which torch keeps alive while any tensor uses it: views are never double counted). The phase's transient peak is
    the largest live total of the storages that did not survive the phase (those that did are the step's persistent
    state, counted by `held`), also per category (KV caches by shape, vocabulary-sized tensors).

KV caches grow in blocks (modeling/kv_cache.py): `kv_peaks()` records each generate call's largest allocation of its
two caches (decoding/spec_stats.SpecStats.kv_peak_bytes).

    with kv_peaks() as kv, StorageTracker(classify) as tr:   # a rollout phase
        ...
    tr.peak(), tr.peak("logits"), max(kv.peaks)

Letters: V vocabulary, H hidden.
"""
from __future__ import annotations

import contextlib
import itertools
import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves


def _storage(t: torch.Tensor):
    try:
        return t.untyped_storage()
    except (RuntimeError, NotImplementedError):  # sparse, meta-less wrappers: nothing to count
        return None


class StorageTracker(TorchDispatchMode):
    """Live bytes of the storages ops create while active; classify(tensor) -> a category name (None: "other")."""

    def __init__(self, classify=None):
        super().__init__()
        self.classify = classify or (lambda t: None)
        self._uid = itertools.count()
        self._live = {}  # id(storage) -> uid, for the aliasing test
        self.events = []  # (uid, +bytes at creation / -bytes at death, category), in order
        self._alive = set()  # uids not yet freed

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {id(s) for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)
                  for s in [_storage(t)] if s is not None}
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                s = _storage(t)
                if s is not None and id(s) not in inputs and id(s) not in self._live and s.nbytes():
                    self._add(s, self.classify(t) or "other")
        return out

    def _add(self, s, cat: str):
        uid, n = next(self._uid), s.nbytes()
        self._live[id(s)] = uid
        self._alive.add(uid)
        self.events.append((uid, n, cat))
        weakref.finalize(s, self._free, id(s), uid, n, cat)

    def _free(self, key, uid, n, cat):
        if self._live.get(key) == uid:
            del self._live[key]
        if uid in self._alive:
            self._alive.discard(uid)
            self.events.append((uid, -n, cat))

    def peak(self, category: str = None) -> int:
        """The largest live total of the transient storages (freed before now), all or one category's."""
        live = best = 0
        for uid, n, cat in self.events:
            if uid not in self._alive and (category is None or cat == category):
                live += n
                best = max(best, live)
        return best

    def survivors(self) -> int:
        """Bytes still alive now that were made while tracking (the phase's persistent state)."""
        return sum(n for uid, n, _ in self.events if n > 0 and uid in self._alive)


def vocab_classifier(vocab_size: int, hidden_size: int, kv_heads: int, head_dim: int):
    """classify(tensor): "kv" for a KV cache layer (B, Hkv, L, D), "logits" for a tensor with a dimension of size V
    that is not shaped like the LM head (V, H), else None."""
    def classify(t):
        shape = tuple(t.shape)
        if t.dim() == 4 and shape[1] == kv_heads and shape[3] == head_dim:
            return "kv"
        if vocab_size in shape and shape not in ((vocab_size, hidden_size), (hidden_size, vocab_size)):
            return "logits"
        return None
    return classify


@contextlib.contextmanager
def kv_peaks():
    """Records, per speculative.generate call made inside, the most bytes its two KV caches held together
    (SpecStats.kv_peak_bytes: read at each step's poll)."""
    import speculative
    rec = type("KVRecord", (), {})()
    rec.peaks = []
    generate = speculative.generate

    def recording(*a, **k):
        r = generate(*a, **k)
        rec.peaks.append(r.stats.kv_peak_bytes)
        return r

    speculative.generate = recording
    try:
        yield rec
    finally:
        speculative.generate = generate


def nbytes(*tensors, seen: set = None) -> int:
    """Bytes of the distinct storages under `tensors` (views of one storage count once); `seen` (ids) carries across
    calls so that a storage is counted under one component only."""
    seen = set() if seen is None else seen
    total = 0
    for t in tensors:
        if isinstance(t, torch.Tensor):
            s = _storage(t)
            if s is not None and id(s) not in seen:
                seen.add(id(s))
                total += s.nbytes()
    return total


def optimizer_tensors(opt) -> list:
    """The state an optimizer holds: AdamW's per-parameter tensors, and ZeRO-1's master slice (parallel/zero1.py)."""
    inner = getattr(opt, "inner", opt)
    out = [t for st in inner.state.values() for t in st.values() if isinstance(t, torch.Tensor)]
    master = getattr(opt, "master", None)
    return out + ([master] if master is not None else [])


def grads(params) -> list:
    """The gradient each parameter holds between steps: the fp32 .main_grad (mixed precision) and/or .grad."""
    return [g for p in params for g in (getattr(p, "main_grad", None), p.grad) if g is not None]


def held(s) -> dict:
    """Component -> bytes this rank holds after a step of harness.experiment's Setup `s`, each storage counted
    once (the stage first: the rollout policy's layers of this stage are its parameters); names as
    memory_model.rank_plan's persistent components."""
    seen, ct = set(), s.cotrainer
    stage = list(ct.stage.parameters()) + list(ct.stage.buffers())
    flat = [ct.opt.flat] if hasattr(ct.opt, "flat") else []  # ZeRO-1 / bf16: the parameters are views of it
    out = {"weights": nbytes(*flat, *stage, seen=seen),
           "grads": nbytes(*grads(ct.stage.parameters()), seen=seen),
           "optimizer": nbytes(*optimizer_tensors(ct.opt), seen=seen)}
    for name, m in copies(s).items():  # the policy first: the drafts' attached embedding is its storage
        out[f"copy:{name}"] = nbytes(*m.parameters(), *m.buffers(), seen=seen)
    trainers = list(s.drafts.values()) + ([s.offline.tr] if s.offline is not None else [])
    out["draft_optim"] = nbytes(*[t for tr in trainers if tr.opt is not None for t in grads(tr.draft.parameters())
                                  + optimizer_tensors(tr.opt) + ([tr.opt.flat] if hasattr(tr.opt, "flat") else [])],
                                seen=seen)
    ch = ct.sched.channel
    out["tap_slots"] = nbytes(*(ch._slots.values() if ch is not None else ()), seen=seen)
    # gradients nothing steps: on the full copies (a warm-up's last ones, say); the plan has none
    out["stray_grads"] = nbytes(*[g for m in copies(s).values() for g in grads(m.parameters())], seen=seen)
    return out


def copies(s) -> dict:
    """name -> module of every full copy this rank holds, the names memory_model.held_copies gives them."""
    out = {"policy": s.policy, "reference": s.ref, "frozen": s.frozen,
           **{name: tr.draft for name, tr in s.drafts.items()},
           "offline": s.offline.draft if s.offline is not None else None}
    return {k: m for k, m in out.items() if m is not None}


def rss_bytes() -> int:
    """This process's resident set size now (Linux; 0 elsewhere): a secondary figure, never asserted."""
    try:
        with open("/proc/self/status") as f:
            return next(int(l.split()[1]) * 1024 for l in f if l.startswith("VmRSS:"))
    except (OSError, StopIteration):
        return 0
