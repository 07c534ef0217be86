"""The KV cache grows in blocks (modeling/kv_cache.py): during a generate whose rows finish at different steps
(EOS), at EVERY forward and compaction the allocated K/V bytes stay within 1.1x the live cache -- rows in the batch x
(longest row + the entries the forward appends) -- plus one block per row, while the outputs are bit-identical to a
preallocated cache and the host syncs are the same. Adds ~12 s (measured 12.5 s for the file at load 6 on 2 cores:
the chain case 10.7 s, most of it the host-sync counter; the tree 1.6 s).
"""
import contextlib

import pytest
import torch
from sync_count import HostSyncs

import speculative
from decoding.row_streams import RowStreams, row_keys
from draft import Eagle3Draft
from model import ModelConfig, Transformer
from modeling.kv_cache import KVCache

BLOCK, PREALLOC = 8, 10 ** 6  # PREALLOC >= max_len: one allocation of max_len slots, the cache before growth
EOS, N_NEW = 93, 60  # with these seeds rows stop after 15, 46, 14, 39, 17, 20, 47 and 60 tokens (chain)


@pytest.fixture(scope="module")
def setup():
    torch.manual_seed(0)
    target = Transformer(ModelConfig.preset("tiny")).eval()
    draft = Eagle3Draft.from_target(target)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(97, (n,), generator=g) for n in (9, 3, 14, 6, 11, 2, 7, 5)]
    return target, draft, prompts


def _run(setup, block, mode):
    target, draft, prompts = setup
    kw = dict(num_draft_tokens=3) if mode == "chain" else dict(tree=(2, 2, 1))
    return speculative.generate(target, draft, prompts, max_new_tokens=N_NEW, temperature=1.0, eos_id=EOS,
                                generator=RowStreams(row_keys(5, torch.arange(len(prompts)))), kv_block=block, **kw)


def _watched(monkeypatch):
    """Record (rows, cap, allocated bytes, live bytes, old preallocation bytes) after every begin and keep_rows."""
    recs = []

    def record(cache, S):
        live = cache.batch * (int(cache.lengths.max()) + S) * cache.slot_bytes  # a host read: the test's own
        recs.append((cache.batch, cache.cap, cache.allocated_bytes(), live,
                     cache.batch * cache.max_len * cache.slot_bytes, cache.batch * cache.block * cache.slot_bytes))

    begin, keep_rows = KVCache.begin, KVCache.keep_rows

    def watched_begin(self, S, tree=None):
        pos = begin(self, S, tree)
        record(self, self._pending[0])
        return pos

    def watched_keep_rows(self, rows):
        keep_rows(self, rows)
        record(self, 0)

    monkeypatch.setattr(KVCache, "begin", watched_begin)
    monkeypatch.setattr(KVCache, "keep_rows", watched_keep_rows)
    return recs


@pytest.mark.parametrize("mode", ["chain", "tree"])
def test_allocation_tracks_the_live_cache_and_outputs_do_not_change(setup, mode, monkeypatch):
    counting = HostSyncs if mode == "chain" else contextlib.nullcontext  # the counter is slow; the chain suffices
    with counting() as syncs_old:
        old = _run(setup, PREALLOC, mode)
    with counting() as syncs_new:
        new = _run(setup, BLOCK, mode)
    if mode == "chain":  # growth decides from the host's bound: not one sync more
        assert syncs_new.count == syncs_old.count, (syncs_new.sites, syncs_old.sites)
    assert all(torch.equal(a, b) for a, b in zip(old.tokens, new.tokens))
    assert all(torch.equal(a, b) for a, b in zip(old.logprobs, new.logprobs))
    assert new.stats.policy_forwards == old.stats.policy_forwards
    assert 0 < new.stats.kv_peak_bytes < old.stats.kv_peak_bytes
    lens = sorted(t.numel() for t in new.tokens)
    assert lens[0] < N_NEW // 2 and lens[-1] == N_NEW  # rows finish early, one runs to the end

    recs = _watched(monkeypatch)
    _run(setup, BLOCK, mode)
    for rows, cap, alloc, live, prealloc, block in recs:
        assert alloc <= 1.1 * live + block, (rows, cap, alloc, live)
    caps = [r[1] for r in recs]
    assert max(caps) > min(caps) and any(b < a for a, b in zip(caps, caps[1:]))  # it grew, and it shrank
    assert len({r[0] for r in recs}) > 1  # compaction dropped rows
    # vs the old preallocation (max_len slots per row): bytes held summed over the forwards, measured 0.46 (chain) and
    # 0.56 (tree); the peak 0.41 and 0.71
    assert sum(r[2] for r in recs) < 0.7 * sum(r[4] for r in recs)
    assert max(r[2] for r in recs) <= 0.75 * max(r[4] for r in recs)


def test_shrinks_to_the_longest_row_and_keeps_its_entries():
    cfg = ModelConfig.preset("tiny")
    cache = KVCache(cfg, 2, 100, block=8)
    assert cache.cap == 8 and cache.allocated_bytes() == 2 * 8 * cache.slot_bytes
    cache.begin(40)
    kv = {l: (torch.randn(2, 40, cfg.num_key_value_heads, cfg.head_dim),
              torch.randn(2, 40, cfg.num_key_value_heads, cfg.head_dim)) for l in cache.layers}
    for l, (k, v) in kv.items():
        cache.write(l, k, v)
    cache.commit()
    assert cache.cap == 40
    cache.rollback(torch.tensor([5, 3]), bound=5)  # the long entries are gone: 6 slots are needed next
    cache.begin(1)
    assert cache.cap == 8 and cache.allocated_bytes() == 2 * 8 * cache.slot_bytes
    for i, l in enumerate(cache.layers):
        assert torch.equal(cache.k[i][:, :, :5], kv[l][0][:, :5].transpose(1, 2))
        assert torch.equal(cache.v[i][:, :, :5], kv[l][1][:, :5].transpose(1, 2))
    cache._pending = None
    cache.keep_rows(torch.tensor([1]))  # one row left: half the bytes
    assert cache.allocated_bytes() == 8 * cache.slot_bytes
    assert torch.equal(cache.k[0][0, :, :5], kv[cache.layers[0]][0][1, :5].transpose(0, 1))


def test_bad_block_is_refused():
    with pytest.raises(ValueError, match="block=0"):
        KVCache(ModelConfig.preset("tiny"), 2, 10, block=0)
