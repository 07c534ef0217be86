"""Tree drafts with lossless multi-candidate verification: several draft candidates per position, one policy forward.

A static tree (b_1, ..., b_k): the root is the last sampled token y; every node at depth j-1 has b_j children, the
b_j draws WITHOUT replacement from the draft's q at that node (Gumbel-top-k: the ordered top-b_j of log q + Gumbel
noise is a sequential sample without replacement [Kool et al. 2019]). The policy scores all 1 + N nodes in ONE forward
with the tree mask (node sees the row's prefix, its ancestors and itself; position = parent's + 1). Then per row, from
the root down, recursive rejection sampling over the children x_1..x_b of the current node [SpecInfer's multi-step
speculative sampling, Miao et al. 2023; without replacement: Recursive Speculative Decoding, Jeon et al. 2024]:

  1. p <- p(. | path), q <- q(. | path)                       (policy and draft at the current node, temperature tau)
  2. for i = 1..b:  accept x_i with probability min(1, p(x_i) / q(x_i))  -> move to child x_i, go to 1
                    else  p <- norm(max(p - q, 0))            (the residual: what x_i's rejection leaves of p)
                          q <- norm(q with x_i removed)       (x_{i+1} was drawn from exactly this q)
  3. all b rejected: the next token y' ~ p (the final residual); a leaf reached: y' ~ p(. | leaf) (the bonus)

Each step is standard speculative sampling of target p from proposal q, recursing into the residual instead of
sampling it, so every emitted token is exactly a policy sample (tests/test_tree.py computes the rule's output
distribution exactly by enumeration). Top-k candidates, or skipping either update, are not lossless. tau = 0: the
candidates are the draft's top-b_j and a child is accepted iff it is the policy's argmax (greedy decoding exactly).
tree = (1,) * k is the chain of speculative.py. Both KV caches keep exactly the accepted path: the policy's by
KVCache.keep_path, the draft's trunk by draft.extend over the path (its tree entries are rolled back).

    python -m decoding.speculative_tree    # the rule on a small vocabulary (sampled / top-k candidates), a tree, a mask
    python bench/bench_rollout.py --trees=2,2,1:3,2,1   # tree rows beside the chain in the rollout benchmark

Letters: B rows, k depth, N tree nodes below the root, I internal nodes (depth < k, root included), V vocab, H hidden.
"""
from __future__ import annotations

import torch

from branch_mask import tree_mask
from modeling.kv_cache import TreeLayout
from decoding.spec_rule import accept_prob, probs
from decoding.row_streams import multinomial, uniform
from decoding.spec_rule import residual as _residual  # a module name of its own: tests swap it for a wrong rule


class Tree:
    """The static tree (b_1..b_k) in breadth-first order: node 0 the root, then depth 1, 2, ...; the children of the
    m-th node at depth j-1 are nodes level[j] + m*b_j + 0..b_j-1, in the order they were drawn."""

    MAX_NODES = 1024  # all nodes are verified in one policy forward; useful trees have 6-30

    def __init__(self, branching):
        b = tuple(branching) if isinstance(branching, (tuple, list)) else None
        if not b or any(isinstance(x, bool) or not hasattr(x, "__index__") or x < 1 for x in b):
            raise ValueError(f"tree={branching!r}: expected a non-empty tuple of integer branching factors >= 1, "
                             "e.g. (2, 2, 1)")
        b = tuple(int(x) for x in b)
        self.branching, self.k = b, len(b)
        width = [1]
        for x in b:
            width.append(width[-1] * x)  # nodes per depth
        if sum(width) - 1 > self.MAX_NODES:
            raise ValueError(f"tree={b}: {sum(width) - 1} nodes, more than the {self.MAX_NODES} one verification "
                             "forward takes (its mask is (rows, nodes, length) per step)")
        self.level = [sum(width[:j]) for j in range(self.k + 2)]  # level[j]: first node at depth j
        self.num_nodes = self.level[-1] - 1  # N, the root excluded: what one verification forward adds
        parents, depth, first_child = [-1], [0], []
        for j in range(1, self.k + 1):
            for m in range(width[j]):
                parents.append(self.level[j - 1] + m // b[j - 1])
                depth.append(j)
        for j in range(self.k):
            first_child += [self.level[j + 1] + m * b[j] for m in range(width[j])]
        self.parents = tuple(parents)
        self.depth = torch.tensor(depth)  # (1+N,)
        self.first_child = torch.tensor(first_child)  # (I,)
        self.visible = tree_mask(parents)  # (1+N, 1+N) ancestors and self
        # the rule's segments, top down: ("level", j) a level with siblings (b_j > 1), walked child by child, or
        # ("run", j0, table) levels j0+1..j0+L where every node has one child: below a node at depth j0 the path is a
        # chain, tried in one pass. table[i, l] = the node at depth j0+1+l under the i-th node at depth j0 (n_j0, L).
        self.segments, j = [], 0
        while j < self.k:
            if b[j] > 1:
                self.segments.append(("level", j + 1))
                j += 1
                continue
            j1 = next((i for i in range(j, self.k) if b[i] > 1), self.k)  # levels j+1..j1 have one child each
            chains = [list(range(self.level[j], self.level[j + 1]))]  # the nodes at depth j
            for _ in range(j1 - j):
                chains.append([first_child[c] for c in chains[-1]])
            table = torch.tensor(chains[1:], dtype=torch.long).T.contiguous()  # (n_j, j1 - j)
            self.segments.append(("run", j, table))
            j = j1
        self._on = {}

    def on(self, device) -> "Tree":  # the index tensors moved to `device` once
        if device not in self._on:
            t = object.__new__(Tree)
            t.__dict__.update(self.__dict__)
            t.depth, t.first_child, t.visible = (x.to(device) for x in (self.depth, self.first_child, self.visible))
            t.segments = [s if s[0] == "level" else (s[0], s[1], s[2].to(device)) for s in self.segments]
            self._on[device] = t
        return self._on[device]

    def __repr__(self):
        return f"Tree{self.branching} ({self.num_nodes} nodes)"


# ------------------------------------------------------------------------------------------------ the sampling rule
def sample_children(zq, b: int, temperature: float, generator=None):
    """b candidates per node from the draft's logits zq (B, n, V) -> tokens (B, n, b), in draw order, and q (B, n, V)
    (None at tau = 0, where the candidates are the top-b). Gumbel-top-k = b sequential draws without replacement."""
    if temperature == 0:
        return zq.topk(b, -1).indices, None
    q = probs(zq, temperature)
    u = uniform(q.shape, generator, q.device, q.dtype)
    g = -torch.log(-torch.log(u.clamp_min(torch.finfo(q.dtype).tiny)))  # Gumbel(0, 1)
    return (q.log() + g).topk(b, -1).indices, q  # zero-q tokens (key -inf) come last: drawn only once q is exhausted


def _without(q, x):
    """q with token x (B,) removed, renormalised (B, V); all zero once q's support is exhausted."""
    q = q.scatter(-1, x[:, None], 0.0)
    s = q.sum(-1, keepdim=True)
    return torch.where(s > 0, q / s.clamp_min(torch.finfo(q.dtype).tiny), q)


def tree_rule(p, q, cand, u, tree: Tree):
    """The verification rule, a pure function of its inputs, for B rows at once (steps 1-3 of the module docstring).

    p (B, 1+N, V) the policy at every node (at tau); q (B, I, V) the draft at every internal node; cand (B, 1+N) the
    node tokens (column 0, the root, unused); u (B, 1+N) uniforms, u[:, c] decides node c. Returns path (B, k+1) the
    accepted nodes (column 0 the root; 0 past n), n (B,) their number, r (B, V) the distribution of the next token,
    and a (B, 1+N) the acceptance probability of every tried node (nan where untried): node c is accepted iff
    u[:, c] < a[:, c]. The tree's segments are walked top down: a level with siblings child by child (`_rule_level`),
    a run of single-child levels in one pass (`_rule_run`: the chain's rule; a chain is one run)."""
    B = p.shape[0]
    st = dict(cur=torch.zeros(B, dtype=torch.long, device=p.device),  # the node whose children are tried next
              alive=torch.ones(B, dtype=torch.bool, device=p.device),  # the whole path so far was accepted
              path=torch.zeros(B, tree.k + 1, dtype=torch.long, device=p.device),
              a=torch.full(cand.shape, float("nan"), dtype=p.dtype, device=p.device),
              r=p[:, 0], rows=torch.arange(B, device=p.device))
    for seg in tree.segments:
        (_rule_level if seg[0] == "level" else _rule_run)(p, q, cand, u, tree, seg, st)
    alive, path = st["alive"], st["path"]  # alive: a leaf was reached, the bonus token ~ p(. | leaf)
    r = torch.where(alive[:, None], p[st["rows"], st["cur"]], st["r"])
    return path, (path[:, 1:] > 0).sum(1), r, st["a"]


def _rule_level(p, q, cand, u, tree: Tree, seg, st):
    """Level j = seg[1] of `tree_rule` (b_j > 1 siblings): the children of each row's current node, in draw order,
    each tried against the residual its elder siblings' rejections left. Updates the state st in place."""
    j, rows, cur, alive = seg[1], st["rows"], st["cur"], st["alive"]
    b = tree.branching[j - 1]
    kids = tree.first_child[cur][:, None] + torch.arange(b, device=p.device)  # (B, b) in draw order
    xs = cand.gather(1, kids)
    pj, qj = p[rows, cur], q[rows, cur]  # (B, V) step 1
    ai = []
    for i in range(b):  # step 2. Child i is tried only after 1..i-1 were rejected, so its (p, q) are the
        x = xs[:, i: i + 1]  # updates by those children alone: no per-row branching is needed
        ai.append(accept_prob(pj.gather(-1, x)[:, 0], qj.gather(-1, x)[:, 0]))
        pj = _residual(pj, qj)
        if i < b - 1:  # the last child's rejection ends the level: no next draw to renormalise q for
            qj = _without(qj, x[:, 0])
    ai = torch.stack(ai, 1)  # (B, b)
    acc = u.gather(1, kids) < ai
    took = alive & acc.any(1)
    first = acc.long().argmax(1)  # the first accepted child (0 if none)
    tried = torch.arange(b, device=p.device)[None] <= torch.where(took, first, b - 1)[:, None]
    a = st["a"]
    a.scatter_(1, kids, torch.where(alive[:, None] & tried, ai, a.gather(1, kids)))  # (stopped rows: unchanged)
    st["r"] = torch.where((alive & ~took)[:, None], pj, st["r"])  # step 3: every child rejected -> final residual
    st["alive"], st["cur"] = took, torch.where(took, kids.gather(1, first[:, None])[:, 0], cur)
    st["path"][:, j] = torch.where(took, st["cur"], 0)


def _rule_run(p, q, cand, u, tree: Tree, seg, st):
    """Levels j0+1..j0+L of `tree_rule` (seg = ("run", j0, table)), where every node has one child: below the current
    node the rest is a chain, and steps 1-3 with b = 1 are the chain's rule, tried for all L nodes in one pass.
    Updates the state st in place."""
    _, j0, table = seg
    L, rows, cur, alive = table.shape[1], st["rows"][:, None], st["cur"], st["alive"]
    idx = torch.where(alive, cur - tree.level[j0], 0)  # stopped rows (cur above depth j0) read any chain: unused
    nodes = table[idx]  # (B, L) the chain below cur
    par = torch.cat([cur[:, None], nodes[:, :-1]], 1)  # (B, L) each node's parent
    x = cand.gather(1, nodes)
    ai = accept_prob(p[rows, par, x], q[rows, par, x])  # (B, L) steps 1-2 at every parent
    n = (u.gather(1, nodes) < ai).long().cumprod(1).sum(1) * alive  # (B,) accepted before the first rejection
    steps = torch.arange(L, device=p.device)[None]
    tried = alive[:, None] & (steps <= n[:, None])  # up to and including the first rejection
    a = st["a"]
    a.scatter_(1, nodes, torch.where(tried, ai, a.gather(1, nodes)))
    st["path"][:, j0 + 1: j0 + 1 + L] = torch.where(steps < n[:, None], nodes, 0)
    through = alive & (n == L)  # every node of the run accepted: the path goes on below its last node
    stop = par.gather(1, n.clamp(max=L - 1)[:, None])[:, 0]  # the node whose child was rejected
    r = _residual(p[rows[:, 0], stop], q[rows[:, 0], stop])  # step 3
    st["r"] = torch.where((alive & ~through)[:, None], r, st["r"])
    st["alive"], st["cur"] = through, torch.where(through, nodes[:, -1], cur)


def tree_rule_naive(p, q, cand, u, tree: Tree):
    """One row of `tree_rule`, written as the recursion: p (1+N, V), q (I, V), cand (1+N,), u (1+N,) ->
    (accepted node list, r (V,)). The reference the batched rule is tested against."""
    path, node = [], 0
    for b in tree.branching:
        pj, qj = p[node], q[node]
        for i in range(b):
            c = int(tree.first_child[node]) + i
            x = int(cand[c])
            if qj[x] > 0 and u[c] < min(1.0, float(pj[x] / qj[x])):
                path.append(c)
                node = c
                break
            pj = _residual(pj[None], qj[None])[0]  # rejected: recurse into the residual ...
            qj = _without(qj[None], torch.tensor([x]))[0]  # ... against a draft that can no longer propose x
        else:
            return path, pj
    return path, p[node]


def tree_greedy(z, cand, tree: Tree):
    """tau = 0: z (B, 1+N, V) policy logits -> path (B, k+1), n (B,), y (B,): follow the child equal to the policy's
    argmax while there is one (siblings are distinct, so at most one matches), then y = the argmax there."""
    g = z.argmax(-1)  # (B, 1+N)
    B = z.shape[0]
    rows = torch.arange(B, device=z.device)
    cur = torch.zeros(B, dtype=torch.long, device=z.device)
    alive = torch.ones(B, dtype=torch.bool, device=z.device)
    path = torch.zeros(B, tree.k + 1, dtype=torch.long, device=z.device)
    for j, b in enumerate(tree.branching, 1):
        kids = tree.first_child[cur][:, None] + torch.arange(b, device=z.device)  # (B, b)
        hit = (cand.gather(1, kids) == g[rows, cur][:, None]) & alive[:, None]
        alive = hit.any(1)
        cur = torch.where(alive, kids.gather(1, hit.long().argmax(1, keepdim=True))[:, 0], cur)
        path[:, j] = torch.where(alive, cur, 0)
    return path, (path[:, 1:] > 0).sum(1), g[rows, cur]


# ------------------------------------------------------------------------------------------------- the engine steps
def propose(s, tree: Tree):
    """Step 1 (tree). Level by level from the root's state s.trunk.state = (h, zq): draw each node's children, then
    one draft forward over the new level (k - 1 forwards, as the chain), each node attending to the trunk and its
    ancestors. Returns cand (b, 1+N) the node tokens (column 0 = s.y) and q (b, I, V) the draft at the internal nodes
    (None at tau = 0). The draft's tree entries are rolled back afterwards."""
    t, draft, cache = tree.on(s.y.device), s.trunk.draft, s.trunk.cache
    base, top = cache.lengths.clone(), cache.bound  # top: the host's bound on base, no sync
    if t.k > 1:  # the draft's entries: the nodes at depths 1..k-1 (the root's entry is the trunk's last)
        layout = TreeLayout(t.depth[1: t.level[t.k]] - 1, t.visible[1: t.level[t.k], 1: t.level[t.k]], base,
                            cache.max_len, top=top)
    h, zq = (x[:, None] for x in s.trunk.state)  # (b, 1, H), (b, 1, V): the root level (EAGLE-3's state: h, zq)
    toks, qs = [s.y[:, None]], []
    for j, b in enumerate(t.branching, 1):
        x, q = sample_children(zq, b, s.temperature, s.generator)  # (b, n_{j-1}, b_j)
        toks.append(x.flatten(1))
        qs.append(q)
        if j < t.k:  # one draft forward over level j: layout nodes level[j]-1 .. level[j+1]-2
            h = h if b == 1 else h.repeat_interleave(b, 1)
            h, zq = draft.tree_step(cache, x.flatten(1), h, layout.nodes(t.level[j] - 1, t.level[j + 1] - 1))
    cache.rollback(base, bound=top)
    return torch.cat(toks, 1), (torch.cat(qs, 1) if s.temperature > 0 else None)


def verify_step(target, s, tree: Tree, cand, q):
    """Steps 2-3 (tree). ONE policy forward over the 1 + N nodes with the tree mask; the rule keeps a path of n nodes
    and samples the token after it; the policy's cache keeps the path (then it looks as if the chain [y, path] had
    been verified). Returns what speculative.commit and draft.extend take, as the chain's verify_step does: block
    (b, k+1) = path tokens, y', junk past n; the logits (b, k+1, V) and taps gathered along the path; n (b,)."""
    t = tree.on(cand.device)
    base = s.pcache.lengths.clone()
    layout = TreeLayout(t.depth, t.visible, base, s.pcache.max_len, top=s.pcache.bound)  # no host sync
    out = target.forward_cached(cand, s.pcache, tap_layers=s.trunk.tap_layers, tree=layout.nodes())
    z = out.logits  # (b, 1+N, V)
    if s.temperature == 0:
        path, n, y = tree_greedy(z, cand, t)
    else:
        p = probs(z, s.temperature)  # (b, 1+N, V) T x V per node, as the chain's k+1
        u = uniform(cand.shape, s.generator, cand.device, p.dtype)
        path, n, r, _ = tree_rule(p, q, cand, u, t)
        y = multinomial(r, s.generator)
    s.pcache.keep_path(base, path)
    rows = torch.arange(cand.shape[0], device=cand.device)
    block = torch.cat([cand.gather(1, path[:, 1:]), y[:, None]], 1)  # (b, k+1)
    block[rows, n] = y
    taps = {l: v[rows[:, None], path] for l, v in out.taps.items()}
    return block, z[rows[:, None], path], n, taps


if __name__ == "__main__":
    from parallel.cli import answer_help
    answer_help(__doc__, __file__)  # -h / --help: usage and summary from the docstring, exit 0
    # the rule on a 5-token vocabulary, a depth-1 tree of 3 candidates: the next token's distribution over 200k rows,
    # candidates drawn without replacement (lossless) vs the draft's top-3 (not)
    torch.manual_seed(0)
    t, B, V = Tree((3,)), 200_000, 5
    p = torch.tensor([0.05, 0.4, 0.3, 0.2, 0.05], dtype=torch.float64)
    q = torch.tensor([0.5, 0.1, 0.1, 0.1, 0.2], dtype=torch.float64)
    P, Q = p.expand(B, 1 + t.num_nodes, V), q.expand(B, 1, V)
    for name, cand in [("sampled w/o replacement", sample_children(Q.log(), 3, 1.0)[0][:, 0]),
                       ("top-3 (wrong)", q.topk(3).indices.expand(B, 3))]:
        cand = torch.cat([torch.zeros(B, 1, dtype=torch.long), cand], 1)
        path, n, r, _ = tree_rule(P, Q, cand, torch.rand(B, 1 + t.num_nodes, dtype=torch.float64), t)
        first = torch.where(n > 0, cand.gather(1, path[:, 1:2])[:, 0], torch.multinomial(r, 1)[:, 0])
        emp = torch.bincount(first, minlength=V) / B
        print(f"{name:>24}: next-token frequencies {[round(x, 3) for x in emp.tolist()]} vs p {p.tolist()}; "
              f"a candidate accepted in {float((n > 0).double().mean()):.1%} of rows")
    t = Tree((2, 2, 1))
    print(f"\n{t!r}: parents {list(t.parents)}; the verification mask (row = node, column = key):\n" +
          "\n".join("".join("█" if v else "·" for v in row) for row in t.visible.tolist()))
