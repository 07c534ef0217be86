"""Lossless batched speculative sampling (chain drafts): a draft proposes k tokens, the policy verifies k+1 at once.

`generate` is a short driver over named steps: `prefill` (one policy forward over the prompts, the first token, the
draft's trunk over the prompt), then until every row is done `compact` (drop finished rows) and, per step and row, with
p the policy's and q the draft's next-token distributions, both at temperature tau:
  1. propose: d_j ~ q_j(. | x, d_<j)   j = 1..k   (the draft's own KV cache: EAGLE-3 k cheap forwards, DFlash one)
  2. verify:  p_1..p_{k+1} from ONE policy forward over [x_t, d_1..d_k] (its KV cache; taps for the draft come free)
  3. accept:  d_j with probability min(1, p_j(d_j) / q_j(d_j)), left to right; n = number accepted before the first
              rejection; then y ~ norm(max(p_{n+1} - q_{n+1}, 0)) (residual), or y ~ p_{k+1} when n = k (bonus)
  4. commit:  d_1..d_n, y; roll both KV caches back past the rejected entries (rows advance by different amounts)
and `finish` truncates each row at max_new_tokens and through its first EOS: any of the ids eos_id lists (an HF
checkpoint's generation config may list several, Qwen3's two).
Every emitted token is distributed exactly as policy sampling [Leviathan et al. 2023; Chen et al. 2023]; tau = 0 is
greedy (accept iff d_j = argmax p_j) and reproduces plain greedy decoding token for token. The acceptance length,
bonus included (1.0 = no speedup), is defined here, once:
    acceptance length = sum_forwards (tokens the row keeps from that forward) / sum_forwards (rows active in it)
the prefill forward and its token excluded; the forward in which a row stops counts only the tokens kept up to EOS or
max_new_tokens (kept_tokens). So returned tokens = rows with a prefill token + the numerator, exactly. The rest a
call measures (per-prompt and per-position counts, the uncut length vLLM reports, KV peak, time) is counted beside
the engine: decoding/spec_stats.py.
The log-probs returned for GRPO are the policy's, log softmax(logits / tau) (tau = 0: of the raw logits), read from
the verification forwards.

The draft is any family of the drafter protocol (drafter.py): `extend` / `propose` / `new_cache` are all it is asked
(its cache and state: decoding/draft_trunk.py). Each step's k comes from a controller (decoding/k_control.py):
num_draft_tokens at every step, or generate(adapt=AdaptiveK(K)) for a chain (decoding/adaptive_k.py: k in {0..K} from
measured costs and acceptance). k = 0 proposes nothing: the step is plain autoregressive sampling. Tree drafts
(several candidates per position, verified in the same one forward): speculative_tree.py, generate(tree=).

    python speculative.py      # tiny random policy + draft: greedy exactness and the stats of a sampled rollout

Letters: B batch rows, k draft tokens per step, V vocab, H hidden, E EOS ids.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Sequence

import torch

from decoding import speculative_tree
from decoding.draft_trunk import DraftTrunk
from decoding.generate_args import check_generate_args, draft_shape, eos_list
from decoding.k_control import FixedK
from decoding.row_streams import multinomial, uniform
from decoding.spec_rule import accept_prob, probs, residual, sample
from decoding.spec_stats import SpecCounts, SpecStats
from model import Transformer
from modeling.layers import at_least_f32


@dataclass
class Rollout:
    tokens: list  # per prompt: (n_b,) generated ids, prompt excluded, ending with an EOS id if one was produced
    logprobs: list  # per prompt: (n_b,) per token (rl_loop.py: indexing), [b][j] the policy's log-prob of tokens[b][j]
    stats: SpecStats


# ------------------------------------------------------------------------------------------------ the sampling rule
def verify(p_logits, d, q, temperature: float, generator=None, lengths=None):
    """The accept / residual / bonus rule for all rows at once.

    p_logits (B, k+1, V) policy at [x_t, d_1..d_k]; d (B, k) drafted ids; q (B, k, V) the draft's probabilities (unused
    at tau = 0); lengths (B,) or None: row b proposed d_1..d_{lengths[b]} only (a block draft cut short, e.g. DSpark's
    confidence cut); its later columns are never accepted and its bonus is y ~ p_{lengths[b]+1}. Returns n (B,)
    accepted drafts and y (B,) the token after them."""
    B, k = d.shape
    rows = torch.arange(B, device=d.device)
    if k == 0:  # nothing drafted: y ~ p_1, plain sampling
        return torch.zeros_like(rows), sample(p_logits[:, 0], temperature, generator)[0]
    if temperature == 0:
        g = p_logits.argmax(-1)  # (B, k+1)
        n = (d == g[:, :k]).long().cumprod(1).sum(1)
        n = n if lengths is None else torch.minimum(n, lengths)
        return n, g[rows, n]
    p = probs(p_logits, temperature)  # (B, k+1, V)
    p_d = p[:, :k].gather(-1, d[..., None])[..., 0]  # (B, k)
    q_d = q.gather(-1, d[..., None])[..., 0]
    u = uniform((B, k), generator, d.device)
    ok = u < accept_prob(p_d, q_d)  # (B, k)
    if lengths is not None:  # a column past a row's proposal was not proposed: it is never accepted
        ok = ok & (torch.arange(k, device=d.device) < lengths[:, None])
    n = ok.long().cumprod(1).sum(1)  # leading accepts
    q_next = torch.cat([q, torch.zeros_like(q[:, :1])], 1)[rows, n]  # q = 0 after the last draft: residual = p (bonus)
    if lengths is not None:  # ... and after the last draft a row proposed
        q_next = q_next * (n < lengths)[:, None]
    y = multinomial(residual(p[rows, n], q_next), generator)
    return n, y


def _logprob(logits, tokens, temperature):  # (B, S, V), (B, S) -> (B, S) log p(token)
    z = at_least_f32(logits) if temperature == 0 else at_least_f32(logits) / temperature
    return torch.log_softmax(z, -1).gather(-1, tokens[..., None])[..., 0]


# ------------------------------------------------------------------------------------------------------ the engine
@dataclass
class _Decode:
    """The state of one generate call. Rows are compacted as they finish: `live` maps a batch row to its prompt."""
    k: int  # this step's draft tokens (the controller's choice; 0: autoregressive)
    temperature: float
    eos: torch.Tensor  # (E,) the ids that end a row, on the device (E = 0: rows end at max_new_tokens only)
    max_new_tokens: int
    generator: object  # a torch.Generator (None: torch's global one) or RowStreams (decoding/row_streams.py)
    toks: torch.Tensor  # (B, width) generated ids per prompt; finished rows keep writing harmlessly past their end
    lps: torch.Tensor  # (B, width) their policy log-probs
    n_gen: torch.Tensor  # (B,) tokens generated per prompt so far
    live: torch.Tensor  # (b,) prompt index of each batch row
    y: torch.Tensor  # (b,) each row's last sampled token (not yet in the policy's cache)
    done: torch.Tensor  # (b,) bool: the row has finished (it rides along until compacted)
    pcache: object  # the policy's KV cache (kv_cache.KVCache)
    counts: SpecCounts  # what the call measures (decoding/spec_stats.py): the acceptance length and the rest
    trunk: DraftTrunk = field(default_factory=DraftTrunk)  # the draft's cache and its state at y (no draft: empty)
    tree: object = None  # speculative_tree.Tree, or None: a chain
    lengths: torch.Tensor = None  # (b,) this step's proposal per row when the draft cut it short (None: k each)
    left: int = 0  # host int, set by poll: the most new tokens an open row may still take
    open: int = 0  # host int, set by poll: the rows not yet finished


@torch.inference_mode()
def generate(target: Transformer, draft=None, prompts=(), *, max_new_tokens: int, num_draft_tokens: int = 0,
             temperature: float = 1.0, eos_id: int | Sequence[int] | None = None, generator=None, tree=None,
             adapt=None, kv_block: int = None) -> Rollout:
    """Sample up to max_new_tokens per prompt (ragged prompts, per-row EOS) with speculative decoding:
    prefill, then per step compact -> k from the controller -> propose (k draft tokens) -> verify (one policy
    forward) -> commit.

    eos_id: an int, a list or tuple of ints (a row ends at the first token that is any of them, kept), or None.
    draft=None or num_draft_tokens=0: plain autoregressive sampling through the same code (the baseline).
    tree=(b_1, ..., b_k): a tree draft instead of the chain (speculative_tree.py; num_draft_tokens must be 0 or k);
    None or () is the chain. generator: a torch.Generator (one stream for the batch), or row_streams.RowStreams with
    one stream per prompt: then each row's tokens depend on its own stream alone, not on the rows beside it.
    adapt: the controller asked for each step's k (decoding/k_control.py: KSchedule, adaptive_k.AdaptiveK) for a
    chain draft; num_draft_tokens is then its ceiling K. None: num_draft_tokens at every step (k_control.FixedK).
    kv_block: both KV caches grow (and shrink) in blocks of this many positions per row as the longest row advances
    (kv_cache.py; None: kv_cache.BLOCK); the outputs do not depend on it."""
    check_generate_args(target, draft, prompts, max_new_tokens, num_draft_tokens, temperature, eos_id)
    tree, k = draft_shape(draft, tree, num_draft_tokens, adapt)
    t0 = time.perf_counter()
    if max_new_tokens == 0:
        dev = next(target.parameters()).device
        empty = [torch.zeros(0, dtype=torch.long, device=dev)] * len(prompts)
        return Rollout(empty, [torch.zeros(0, device=dev)] * len(prompts), SpecStats())
    ctl = FixedK(k) if adapt is None else adapt
    drafting = ctl.begin(k, len(prompts), max(p.numel() for p in prompts), left=max_new_tokens)  # False: no draft
    s = prefill(target, draft if drafting else None, prompts, k, temperature, eos_id, max_new_tokens, generator,
                tree=tree, kv_block=kv_block)
    while (n_done := poll(s)) < s.live.numel():  # sync point: one per step
        compact(s, n_done)
        s.k = ctl.k(s)  # this step's k; 0: a plain autoregressive step
        d, q = propose(s)  # 1.
        block, z, n, taps = verify_step(target, s, d, q)  # 2-3.
        s.trunk.extend(block, taps, n)  # 4. the draft's trunk takes the kept entries ...
        commit(s, block, z, n)  # ... and the policy's: tokens, log-probs, caches rolled back past the rejected
        ctl.observe(s)
    return ctl.end(finish(s, time.perf_counter() - t0))  # a controller reads the rows' acceptance spread (host lists)


def prefill(target, draft, prompts, k: int, temperature, eos_id, max_new_tokens, generator, tree=None,
            kv_block: int = None) -> _Decode:
    """Step 0. One policy forward over the right-padded prompts (each row then rolls back to its own length), the
    first token y ~ p(. | prompt), and the draft's trunk over the prompt: entry j = (token j+1, taps at j), the last
    one fed the sampled y. k: the most draft tokens a step proposes (a tree's depth); draft None: plain sampling.
    eos_id: as generate takes it; its ids go to the device once, as the (E,) tensor every step compares against.
    max_len bounds the caches; they allocate the prompt rounded up to a block and grow from there (kv_block)."""
    dev = next(target.parameters()).device
    B, K = len(prompts), k
    k = k if draft is not None else 0  # without a draft the caches are sized as plain sampling's
    lens = torch.tensor([p.numel() for p in prompts], device=dev)
    rows = torch.arange(B, device=dev)
    span = k + 1 if tree is None else 1 + tree.num_nodes  # entries a step appends past the last kept token
    max_len = int(lens.max()) + max_new_tokens + span
    x = torch.zeros(B, int(lens.max()), dtype=torch.long, device=dev)
    for b, p in enumerate(prompts):
        x[b, : p.numel()] = p.to(dev)
    pcache = target.new_cache(B, max_len, block=kv_block)
    taps = draft.tap_layers if k else None
    out = target.forward_cached(x, pcache, tap_layers=taps, logits_at=lens - 1)
    pcache.rollback(lens)
    z = out.logits  # (B, V) at each row's last prompt token only: no (B, S, V) logits
    y, _ = sample(z, temperature, generator)
    width = max_new_tokens + 2 * (k + 1)
    eos = torch.tensor(eos_list(eos_id), dtype=torch.long, device=dev)  # (E,)
    s = _Decode(k, temperature, eos, max_new_tokens, generator,
                toks=torch.zeros(B, width, dtype=torch.long, device=dev),
                lps=torch.zeros(B, width, dtype=at_least_f32(z).dtype, device=dev),
                n_gen=torch.ones(B, dtype=torch.long, device=dev), live=rows, y=y,
                done=(max_new_tokens <= 1) | is_eos(y, eos), pcache=pcache, counts=SpecCounts(B, K, k, dev), tree=tree)
    s.toks[:, 0], s.lps[:, 0] = y, _logprob(z[:, None], y[:, None], temperature)[:, 0]
    if taps is not None:
        dcache = draft.new_cache(B, max_len, block=kv_block)
        nxt = torch.cat([x[:, 1:], torch.zeros_like(x[:, :1])], 1)
        nxt[rows, lens - 1] = y
        s.trunk = DraftTrunk(draft, dcache, draft.extend(dcache, nxt, out.taps, lens - 1))
    return s


def poll(s: _Decode) -> int:
    """The step's one host sync: the number of finished rows, each KV cache's longest row (its forwards then attend
    exactly as far as they need, kv_cache.KVCache.bound) and the most tokens an open row may still take (s.left)."""
    caches = [c for c in (s.pcache, s.trunk.cache) if c is not None]
    left = (s.max_new_tokens - s.n_gen[s.live]).masked_fill(s.done, 0).max()
    n_done, s.left, *longest = torch.stack([s.done.sum(), left] + [c.lengths.max() for c in caches]).tolist()
    s.open = s.live.numel() - n_done
    for c, L in zip(caches, longest):
        c.bound = min(c.bound, L)
    s.counts.saw_caches(caches)
    return n_done


def compact(s: _Decode, n_done: int):
    """Drop the finished rows once they are a quarter of the batch: O(log B) cache copies in all. Until then they
    ride along; nothing they compute is kept."""
    if n_done * 4 < s.live.numel():
        return
    keep = (~s.done).nonzero()[:, 0]
    s.live, s.y, s.done = s.live[keep], s.y[keep], s.done[keep]
    s.pcache.keep_rows(keep)
    if hasattr(s.generator, "keep_rows"):  # per-row streams (decoding/row_streams.py) travel with their rows
        s.generator.keep_rows(keep)
    s.trunk.keep_rows(keep)


def propose(s: _Decode):
    """Step 1. d_j ~ q_j(. | x, d_<j), j = 1..k, from the draft's state at the last verified position (drafter.py:
    k draft forwards for a chain drafter, one for a block drafter). Returns d (b, k) and q (b, k, V), the
    distributions the tokens were drawn from (None at tau = 0). The draft's cache ends as it began: only verified
    tokens enter its trunk (DraftTrunk.extend). A tree: speculative_tree.propose (d the nodes (b, 1+N)). k = 0:
    nothing is drafted. A block draft may cut its proposal short (drafter.py: d, q, lengths): row b proposes
    d[b, :lengths[b]] (s.lengths), and the step's k becomes d's width, the longest row's."""
    s.lengths = None
    if s.k == 0:
        return s.y.new_zeros(s.y.shape[0], 0), None
    if s.tree is not None:
        return speculative_tree.propose(s, s.tree)
    d, q, *cut = s.trunk.propose(s.k, s.temperature, s.generator)
    if cut:
        s.lengths, s.k = cut[0], d.shape[1]
    return d, q


def verify_step(target, s: _Decode, d, q):
    """Steps 2-3. ONE policy forward over [y, d_1..d_k] gives p_1..p_{k+1}; `verify` keeps n drafts and the token
    after them. Returns block (b, k+1) = d_1..d_n, y', then junk past n; the logits z (b, k+1, V); n (b,); the taps
    (None without a draft). A tree: speculative_tree.verify_step, which returns the same along the accepted path."""
    if s.tree is not None:
        return speculative_tree.verify_step(target, s, s.tree, d, q)
    out = target.forward_cached(torch.cat([s.y[:, None], d], 1), s.pcache, tap_layers=s.trunk.tap_layers)
    z = out.logits
    n, y = verify(z, d, q, s.temperature, s.generator, s.lengths)
    block = torch.cat([d, y[:, None]], 1)
    block[torch.arange(d.shape[0], device=d.device), n] = y
    return block, z, n, out.taps


def is_eos(tokens, eos):
    """tokens (...) -> (...) bool: the token is one of the ids eos (E,). A broadcast compare over (..., E): the same
    element-wise ops at any E, no host sync (torch.isin switches to a sort-based path once the id list is long)."""
    return (tokens[..., None] == eos).any(-1)


def kept_tokens(block, n, n_gen, active, eos, max_new_tokens):
    """(b,) tokens each row KEEPS from this verification forward: n + 1 (the accepted drafts and the token after them),
    cut after the first EOS (any id of eos (E,)) among them and at the row's remaining budget max_new_tokens - n_gen;
    0 for rows already finished. This is the numerator of the acceptance length (module docstring): a forward in
    which a row stops counts only what that row keeps."""
    cols = torch.arange(block.shape[1], device=block.device)
    hit = is_eos(block, eos) & (cols[None] <= n[:, None])  # (b, k+1) EOS among the n + 1 new tokens
    kept = torch.where(hit.any(1), hit.long().argmax(1) + 1, n + 1)  # through the first EOS
    kept = torch.minimum(kept, max_new_tokens - n_gen)
    return torch.where(active, kept, 0)


def commit(s: _Decode, block, z, n):
    """Step 4. Write each active row's n + 1 new tokens and their policy log-probs, advance its count by the tokens it
    keeps (kept_tokens), mark rows that hit EOS or max_new_tokens, and roll both caches back past the rejected entries
    (finished rows restart their caches at 0: while they ride along they never grow)."""
    active = ~s.done
    cols = torch.arange(block.shape[1], device=block.device)
    g = s.n_gen[s.live]
    idx = g[:, None] + cols  # (b, k+1) output columns
    s.toks[s.live[:, None], idx] = block
    s.lps[s.live[:, None], idx] = _logprob(z, block, s.temperature)
    kept = kept_tokens(block, n, g, active, s.eos, s.max_new_tokens)
    s.done = s.done | (is_eos(block, s.eos) & (cols[None] <= n[:, None]) & active[:, None]).any(1)
    g = g + kept
    s.n_gen[s.live] = g
    s.done = s.done | (g >= s.max_new_tokens)
    s.pcache.rollback(torch.where(s.done, 0, s.pcache.lengths - block.shape[1] + kept))  # live rows kept n + 1
    s.trunk.empty_finished(s.done)
    s.y = block[torch.arange(block.shape[0], device=block.device), n]
    s.counts.step(s, n, kept, active)  # the acceptance length's sums and the rest (decoding/spec_stats.py)


def finish(s: _Decode, seconds: float) -> Rollout:
    """Step 5. Truncate each row at max_new_tokens and after its first EOS; the call's statistics (spec_stats.py)."""
    n_keep = s.n_gen.clamp(max=s.max_new_tokens)
    hit = is_eos(s.toks, s.eos) & (torch.arange(s.toks.shape[1], device=s.toks.device)[None] < n_keep[:, None])
    n_keep = torch.minimum(n_keep, torch.where(hit.any(1), hit.float().argmax(1) + 1, n_keep))  # (B,)
    n_keep = n_keep.tolist()
    return Rollout([s.toks[b, :m].clone() for b, m in enumerate(n_keep)],
                   [s.lps[b, :m].clone() for b, m in enumerate(n_keep)], s.counts.stats(n_keep, seconds))


if __name__ == "__main__":
    from parallel.cli import answer_help
    answer_help(__doc__, __file__)  # -h / --help: usage and summary from the docstring, exit 0
    from branch_mask import cu_seqlens_from_lengths
    from draft import Eagle3Draft
    from model import ModelConfig, greedy_generate

    torch.manual_seed(0)
    target = Transformer(ModelConfig.preset("tiny")).eval()
    draft = Eagle3Draft.from_target(target)
    prompts = [torch.randint(97, (n,)) for n in (5, 3, 8, 4)]
    ref = greedy_generate(target, prompts, 24)

    def show(tag):
        r = generate(target, draft, prompts, max_new_tokens=24, num_draft_tokens=4, temperature=0)
        exact = all(torch.equal(a, b) for a, b in zip(ref, r.tokens))
        print(f"{tag:>22}: greedy == plain greedy {exact}; acceptance length {r.stats.acceptance_length:.2f}, per "
              f"position {[round(a, 2) for a in r.stats.accept_per_position]}, {r.stats.policy_forwards} forwards")

    show("untrained draft")
    # co-training in miniature: TTT on the policy's own continuations, taps + teacher from one policy forward
    seqs = [torch.cat([p, t]) for p, t in zip(prompts, ref)]
    tokens = torch.cat(seqs)
    cu = cu_seqlens_from_lengths([len(s) for s in seqs])
    with torch.no_grad():
        out = target(tokens, cu, tap_layers=draft.tap_layers)
    opt = torch.optim.Adam(draft.parameters(), lr=1e-2)
    for _ in range(40):
        loss, m = draft.ttt_loss(out.taps, tokens, cu, out.logits, num_passes=3, hard_labels=True)
        opt.zero_grad()
        loss.backward()
        opt.step()
    show("after 40 TTT steps")
