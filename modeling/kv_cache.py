"""The KV cache of batched generation: per-layer K/V for B rows, each row with its own length.

Speculative decoding appends k+1 entries to every row per step and keeps a different number per row, so lengths are
per row: `write` appends S entries to every row at its current length (rows that need fewer roll back afterwards),
`rollback(lengths)` shortens rows in O(1) (entries past a row's length are never attended), and `keep_rows` drops
finished rows from the batch. model.Transformer.forward_cached drives it: begin(S) -> write per layer -> commit().

No host sync: the lengths live on the device, and a forward attends over the first Lk = min(bound + S, max_len) slots,
where `bound` is a host int >= every row's length that the cache keeps without reading the lengths (it grows by S at
each commit and shrinks only when the caller knows a tighter one: rollback(bound=), speculative.poll). Reading
max(lengths) instead would stall the GPU once per forward; the price is attending to slots past the longest row (the
causal mask hides them), which speculative.poll avoids by tightening the bound in the decode loop's one sync per step.
The range checks are device-side asserts (torch._assert_async: an error on CPU, a device assert on GPU), not host
reads.

Growth in blocks. max_len is the LIMIT (rows past it are an overflow), not what is allocated: the cache holds `cap`
slots per row, a multiple of `block` (or max_len), and every forward first makes room for what it attends,
need = Lk = min(bound + S, max_len), from the host's bound alone (no host sync):
    need > cap                                    -> grow to  ceil(need / block) * block      (clamped to max_len)
    cap > need + block  and  cap > 1.1 * need     -> shrink to the same (the longest row finished; bound fell)
so after begin  cap <= max(need + block, 1.1 * need): the allocation tracks the longest live row, within 10% or one
block. keep_rows (finished rows leave) reallocates only the kept rows and the same fit for bound. A resize copies only
the filled prefix (slots < bound; the rest is zeros, as a fresh preallocated cache's would be -- past a row's length a
slot is masked and never changes a result), one layer's K or V at a time (K and V are per-layer tensors), so the
transient is one layer's tensor, not a second cache. `allocated_bytes()` is what the cache holds now.

Tree drafts (speculative_tree.py) append tree nodes instead of a chain: a `TreeLayout`, built once per step, gives
node s the position base + depth[s] and lets it see the rows' committed prefix plus its own ancestors; `begin_nodes`
appends its nodes lo..hi-1 (the policy all at once, the draft level by level, each level a slice of the one layout);
after verification `keep_path` moves each row's accepted root-to-leaf path to the front of the block, so the cache
again holds one sequence per row.

Letters: B rows, S new entries per row, L = cap (allocated slots per row), Hkv heads, D head dim.
"""
from __future__ import annotations

from typing import NamedTuple

import torch

BLOCK = 64  # default growth step of a cache, in positions per row


class KVCache:
    """Per-layer K/V for B rows, each row with its own length (see the module docstring)."""

    def __init__(self, cfg, batch: int, max_len: int, layers=None, dtype=torch.float32, device=None,
                 block: int = None):
        """max_len: the most entries a row may hold; block: the growth step (None: BLOCK; >= max_len: preallocated)."""
        block = BLOCK if block is None else block
        if batch < 1 or max_len < 1 or block < 1:
            raise ValueError(f"KVCache: batch={batch}, max_len={max_len} and block={block} must be >= 1")
        self.layers = list(range(cfg.num_hidden_layers)) if layers is None else list(layers)
        self.max_len, self.block = max_len, block
        self._row_shape = (cfg.num_key_value_heads, cfg.head_dim)  # (Hkv, D)
        cap = min(block, max_len)
        self.k = [torch.zeros((batch, cfg.num_key_value_heads, cap, cfg.head_dim), dtype=dtype, device=device)
                  for _ in self.layers]  # per layer (B, Hkv, L, D)
        self.v = [torch.zeros_like(t) for t in self.k]
        self.lengths = torch.zeros(batch, dtype=torch.long, device=device)  # (B,) committed entries per row
        self._slot = {l: i for i, l in enumerate(self.layers)}
        self._pending = None  # (S, positions, rows, mask) of the forward in progress; lengths advance at commit
        self.bound = 0  # host int >= max(lengths): what a forward attends up to, known without a host sync

    @property
    def cap(self) -> int:
        """Slots allocated per row now (<= max_len)."""
        return self.k[0].shape[2]

    @property
    def slot_bytes(self) -> int:
        """Bytes of one row's K and V at one position over all layers."""
        t = self.k[0]
        return 2 * len(self.k) * self._row_shape[0] * self._row_shape[1] * t.element_size()

    def allocated_bytes(self) -> int:
        """Bytes the cache's K and V hold now (batch x cap x slot_bytes); lengths and masks excluded."""
        return self.batch * self.cap * self.slot_bytes

    def _fit(self, need: int) -> int:
        """The capacity for a forward that attends `need` slots (module docstring: grow / shrink in blocks)."""
        want = min(self.max_len, max(1, -(-need // self.block)) * self.block)  # never below one block
        if need > self.cap or (self.cap > need + self.block and self.cap > 1.1 * need):
            return want
        return self.cap

    def _resize(self, cap: int, rows=None):
        """Reallocate to cap slots per row (and only `rows`, if given), copying the filled prefix, layer by layer."""
        L = min(self.bound, self.cap, cap)  # the filled prefix, or a little more: no host sync
        B = self.batch if rows is None else rows.numel()
        for ts in (self.k, self.v):
            for i, old in enumerate(ts):
                new = old.new_zeros((B, old.shape[1], cap, old.shape[3]))
                new[:, :, :L] = old[:, :, :L] if rows is None else old[rows, :, :L]
                ts[i] = new  # the old layer is freed before the next is allocated

    @property
    def batch(self) -> int:
        return self.k[0].shape[0]

    def positions(self, S: int) -> torch.Tensor:  # (B, S) absolute positions of the next S tokens of each row
        return self.lengths[:, None] + torch.arange(S, device=self.lengths.device)

    def begin(self, S: int, tree=None, causal: bool = True) -> torch.Tensor:
        """Start a forward that appends S entries to every row -> their positions (B, S). What every layer's write
        shares (positions, row ids) is built here once, not per layer; the causal mask is not: `visible` builds it a
        block of query rows at a time (a prefill's whole (B, S, Lk) mask would be O(L^2)).
        tree: the S entries are tree nodes instead, a TreeNodes (begin_nodes) or (depth, visible, base) (begin_tree).
        causal False: the S entries form a block that sees all of itself (a block drafter's, draft_dflash.py)."""
        if tree is not None:
            return self.begin_nodes(tree) if isinstance(tree, TreeNodes) else self.begin_tree(*tree)
        self._check_room(S)
        Lk = min(self.bound + S, self.max_len)  # >= every row's length + S; no host sync
        self._reserve(Lk)
        pos = self.positions(S)  # (B, S)
        rows = torch.arange(self.batch, device=pos.device)[:, None].expand(-1, S)  # (B, S)
        self._see = pos if causal else pos[:, -1:].expand(-1, S)  # (B, S) the last slot each entry sees
        self._pending = (S, pos, rows, None, Lk)  # None: that mask, built per block by `visible`
        return pos

    def begin_tree(self, depth, visible, base) -> torch.Tensor:
        """Start a forward that appends S tree nodes to every row -> their RoPE positions (B, S).

        base (B,): where each row's tree began (the nodes appended since then are earlier nodes of the same tree);
        depth (S,) long: node s sits at position base + depth[s]; visible (S, M) bool with M = lengths - base + S (the
        same for every row): node s attends to every slot < base (the row's sequence) and to the tree slot base + m iff
        visible[s, m] (its ancestors and itself: branch_mask.tree_mask). The nodes are written at slots
        lengths + 0..S-1. (A tree appended in several forwards builds one TreeLayout and calls begin_nodes.)"""
        depth, visible = torch.as_tensor(depth, dtype=torch.long), torch.as_tensor(visible, dtype=torch.bool)
        S, M = visible.shape
        if depth.shape != (S,) or M < S:
            raise ValueError(f"begin_tree: depth {tuple(depth.shape)} / visible {tuple(visible.shape)}: expected "
                             f"({S},) and (S, M >= S)")
        full = torch.zeros(M, M, dtype=torch.bool, device=visible.device)
        full[M - S:] = visible  # the earlier nodes' rows are never used
        base = torch.as_tensor(base, dtype=torch.long, device=self.lengths.device)
        layout = TreeLayout(torch.cat([depth.new_zeros(M - S), depth]), full, base, self.max_len)
        return self.begin_nodes(layout.nodes(M - S, M))

    def begin_nodes(self, nodes: "TreeNodes") -> torch.Tensor:
        """Start a forward that appends nodes lo..hi-1 of a TreeLayout to every row (every row must hold exactly the
        layout's nodes 0..lo-1 past its base) -> their RoPE positions (B, hi - lo)."""
        t, lo, hi = nodes
        if t.base.shape != self.lengths.shape:
            raise ValueError(f"begin_nodes: the layout has {t.base.shape[0]} rows, the cache {self.batch}")
        torch._assert_async((self.lengths - t.base == lo).all(), f"begin_tree: visible has {hi} columns for {hi - lo} "
                            f"new nodes, so every row must hold the {lo} earlier tree nodes past its base")
        Lk, S = min(t.top + hi, self.max_len), hi - lo
        self._check_room(S)
        self._reserve(Lk)
        slots = t.base[:, None] + t.slot[lo:hi]  # (B, S) where the nodes are written
        self._pending = (S, slots, t.rows[:, :S], t.mask[:, lo:hi, :Lk], Lk)
        return t.pos[:, lo:hi]

    def keep_path(self, base, path):
        """Keep one root-to-leaf path per row of the tree appended after `base` (B,): tree slot path[b, j] (B, m)
        moves to slot base[b] + j and every row's length becomes base + m (entries past a row's accepted length are
        junk that the caller's rollback drops). A gather, then a scatter: the sources are read before any is
        overwritten."""
        base = torch.as_tensor(base, dtype=torch.long, device=self.lengths.device)
        m = path.shape[1]
        src = base[:, None] + path  # (B, m)
        dst = base[:, None] + torch.arange(m, device=path.device)
        rows = torch.arange(self.batch, device=path.device)[:, None]
        for t in self.k + self.v:  # (B, Hkv, L, D) per layer; the indexed view is (B, m, Hkv, D)
            t[rows, :, dst] = t[rows, :, src]
        self.lengths = base + m

    def write(self, layer: int, k, v):
        """k, v (B, S, Hkv, D) -> this layer's K, V (B, Hkv, Lk, D) up to the longest row (views, not copies; the
        new entries' visibility: `visible`)."""
        if self._pending is None:
            raise RuntimeError("KVCache.write outside a forward: call begin(S) first")
        _, pos, rows, _, Lk = self._pending
        i = self._slot[layer]
        K, V = self.k[i], self.v[i]  # (B, Hkv, L, D)
        K[rows, :, pos] = k.to(K.dtype)  # advanced indices first: (B, S, Hkv, D)
        V[rows, :, pos] = v.to(V.dtype)
        return K[:, :, :Lk], V[:, :, :Lk]

    def visible(self, lo: int, hi: int) -> torch.Tensor:
        """(B, hi - lo, Lk) bool: which slots new entries lo..hi-1 of the forward in progress attend to -- a chain's
        own slot and every slot before it (causal per row), a block's every slot up to its last, a tree node's the
        row's prefix and its ancestors. Built per block of rows, so a prefill never holds its (B, S, Lk) mask at
        once."""
        _, pos, _, mask, Lk = self._pending
        if mask is not None:
            return mask[:, lo:hi]
        return torch.arange(Lk, device=pos.device)[None, None, :] <= self._see[:, lo:hi, None]  # (B, hi - lo, Lk)

    @property
    def key_len(self) -> int:
        """Lk of the forward in progress: its keys are slots 0..Lk-1 and its positions lie below Lk (a host int)."""
        return self._pending[4]

    def _check_room(self, S: int):  # device-side: no host sync
        torch._assert_async(self.lengths.max() + S <= self.max_len,
                            f"KV cache overflow: a row would pass max_len={self.max_len} with {S} more entries")

    def _reserve(self, need: int):  # room for a forward over slots 0..need-1, from host ints only
        cap = self._fit(need)
        if cap != self.cap:
            self._resize(cap)

    def commit(self):
        self.lengths += self._pending[0]
        self.bound += self._pending[0]
        self._pending = None

    def keep_rows(self, rows: torch.Tensor):
        """Shrink the cache to `rows` (B',) (finished rows leave the batch), and its slots to fit `bound` (_fit).
        Copies only the filled prefix; the rest stays zero (never attended, but finite: a masked NaN would still
        poison the attention)."""
        self._resize(self._fit(min(self.bound, self.max_len)), rows)
        self.lengths = self.lengths[rows]

    def rollback(self, lengths: torch.Tensor, bound: int = None):
        """Shorten each row to lengths (B,) (each in [0, its current length]). bound: a host int >= every new length
        that the caller knows (e.g. self.bound before the forwards it undoes); the cache's own bound is kept
        otherwise."""
        lengths = torch.as_tensor(lengths, dtype=torch.long, device=self.lengths.device)
        if lengths.shape != self.lengths.shape:
            raise ValueError(f"rollback lengths: expected shape {tuple(self.lengths.shape)}, "
                             f"got {tuple(lengths.shape)}")
        torch._assert_async(((lengths >= 0) & (lengths <= self.lengths)).all(),
                            "rollback lengths: each must lie in [0, the row's current length]")
        self.lengths = lengths.clone()
        if bound is not None:
            self.bound = min(self.bound, int(bound))


class TreeLayout:
    """A tree of S nodes appended to every row after base (B,), built once and appended by begin_nodes in one or
    several forwards: node s is written at slot base + s, sits at RoPE position base + depth[s] (depth (S,) long), and
    attends to the row's prefix (slots < base) and to the tree slots m with visible[s, m] (visible (S, S) bool:
    ancestors and self). What every forward over its nodes needs is built here once: positions, slots, the mask."""

    def __init__(self, depth, visible, base, max_len: int, top: int = None):
        """top: a host int >= max(base) (the cache's bound); None reads max(base), a host sync."""
        base = torch.as_tensor(base, dtype=torch.long)
        dev = base.device
        S = visible.shape[0]
        if visible.shape != (S, S) or depth.shape != (S,):
            raise ValueError(f"TreeLayout: depth {tuple(depth.shape)} / visible {tuple(visible.shape)}: expected "
                             f"({S},) and ({S}, {S})")
        self.base, self.top = base, int(base.max()) if top is None else int(top)
        Lk = min(self.top + S, max_len)  # past max_len begin_nodes refuses the forward
        self.slot = torch.arange(S, device=dev)
        self.pos = base[:, None] + depth.to(dev)[None]  # (B, S)
        self.rows = torch.arange(base.shape[0], device=dev)[:, None].expand(-1, S)  # (B, S)
        rel = torch.arange(Lk, device=dev)[None] - base[:, None]  # (B, Lk) key slot relative to the tree
        tree = visible.to(dev)[:, rel.clamp(0, S - 1)].permute(1, 0, 2)  # (B, S, Lk)
        self.mask = (rel < 0)[:, None] | (tree & (rel < S)[:, None])  # the prefix, or an ancestor inside the tree

    def nodes(self, lo: int = 0, hi: int = None) -> "TreeNodes":
        return TreeNodes(self, lo, self.slot.numel() if hi is None else hi)


class TreeNodes(NamedTuple):  # nodes lo..hi-1 of a TreeLayout: what one forward appends (begin_nodes)
    layout: TreeLayout
    lo: int
    hi: int
