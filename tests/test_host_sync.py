"""Host-sync budgets, counted on the CPU by tests/sync_count.py (a TorchDispatchMode over the ops that make a GPU wait
for its host: .item() / int / float / bool, nonzero, masked_select, boolean-mask indexing, repeat_interleave without
output_size, unique, tolist, numpy). On CPU every tensor stands in for a device tensor, so the count is exact.

    a ring step (ring_branch_attention forward + backward, cp_shift), every CPU-runnable backend      0
    a chain speculative decode step (propose k=4 + verify + extend + commit, and the loop's test)    <= 3 (measured 1,
                                                       plus a compaction's nonzero when rows finish)
    a tree decode step (the same loop)                                                                <= 3 (measured 1)
    the draft hook, per draft per micro-batch (TTT loss + its backward), cp 1 and 2                   <= 2 (measured 1)

Before these budgets (tiny policy + draft, 6 prompts, 40 new tokens, `python` of the counts below): 21.8 syncs per
chain step at k = 4 (KV-cache max length and rollback checks, RoPE table size, token range check, per forward), 7.1
per autoregressive step, 22.2 per tree (2, 2, 1) step; the draft hook 13 per draft per micro-batch (16 on a new
layout, 23 without an attention backend). The remaining per-step sync is speculative.poll (finished rows and the
caches' longest rows in one read); the draft hook's is its metrics' one tolist. Not counted: host <-> device copies
(none exist on a CPU run; on a GPU a blocking .to(device) of a host tensor also waits for the stream)."""
import contextlib
import threading

import pytest
import torch

from attention_cases import make_case
from attention_cp import ring_branch_attention
from branch_mask import cp_shift, zigzag_shard
from parallel.host_copy import cu_to, host_cu
from parallel.ring import run_ranks
from sync_count import HostSyncs


def test_the_counter_counts_each_kind_of_sync_once():  # adds ~3 s: mostly the one-time import a dispatch mode triggers
    x = torch.tensor([1.0, 2.0, 0.0])
    m = x > 0
    cases = [(lambda: x[0].item(), "_local_scalar_dense"), (lambda: bool(m[0]), "_local_scalar_dense"),
             (lambda: int(x[1]), "_local_scalar_dense"), (lambda: float(x.sum()), "_local_scalar_dense"),
             (lambda: x.tolist(), "tolist"), (lambda: x.numpy(), "numpy"), (lambda: m.nonzero(), "nonzero"),
             (lambda: torch.where(m), "nonzero"), (lambda: x.masked_select(m), "masked_select"),
             (lambda: x[m], "index with a boolean mask"), (lambda: x.clone().__setitem__(m, 0.0), "index_put_"),
             (lambda: x.repeat_interleave(torch.tensor([1, 2, 0])), "repeat_interleave without output_size"),
             (lambda: torch.unique(x), "_unique2"), (lambda: torch.equal(x, x), "equal")]
    for fn, name in cases:
        for mode in (contextlib.nullcontext, torch.inference_mode):  # composite ops reach the mode whole there
            with mode(), HostSyncs() as syncs:
                fn()
            assert syncs.count == 1, (name, syncs.sites)  # under inference_mode as item, is_nonzero, where(...)
            assert mode is torch.inference_mode or syncs.sites[0].startswith(name), (name, syncs.sites)
    with HostSyncs() as syncs:  # what stays on the device
        x.repeat_interleave(torch.tensor([1, 2, 0]), output_size=3)
        x[torch.tensor([0, 2])], x.max(), torch.where(m, x, 0.0), torch.multinomial(x + 1, 1), x.repeat_interleave(2)
        torch._assert_async(x.sum() > 0, "device-side check")
    x.tolist(), x[0].item()  # outside the mode: not counted
    assert syncs.count == 0, syncs.sites
    with HostSyncs() as syncs:  # another thread's syncs are not this mode's
        t = threading.Thread(target=lambda: x.tolist())
        t.start()
        t.join()
    assert syncs.count == 0, syncs.sites


def _rank_fn(case, found, calls):
    cu = case["cu"]

    def rank(ring):
        shard = lambda x: zigzag_shard(x, cu, case["cp"], ring.rank)  # noqa: E731
        ins = [shard(case[n]).requires_grad_() for n in ("q", "k", "v", "bk", "bv")]
        dout, dlse = shard(case["dout"]), shard(case["dlse"])  # the test's own sharding: outside the region
        for i in range(calls):  # a forward over `calls` layers: the first may build the layout's tables
            with HostSyncs() if i == calls - 1 else contextlib.nullcontext() as syncs:
                out, lse = ring_branch_attention(*ins[:3], cu, *ins[3:], group=ring, return_lse=True,
                                                 backend=case["backend"])
                ((out * dout).sum() + (lse * dlse).sum()).backward()
            if syncs is not None:
                found.extend(syncs.sites)
        return True
    return rank


@pytest.mark.parametrize("cp", [1, 2, 3])
def test_no_host_reads_in_the_torch_ring(cp):
    """backend "torch" keeps no tables: zero reads from the first call, given the carried host copy."""
    case = make_case([13, 5, 20], cp, P=2, Hkv=2, G=2, D=8, seed=cp, backend="torch_tile5")
    case["cu"] = cu_to(case["cu"], "cpu")  # what the loader does when it moves a batch to the GPU
    found = []
    run_ranks(cp, _rank_fn(case, found, calls=1), timeout=60)
    assert found == [], found


def test_no_host_reads_in_the_triton_ring_after_the_first_layer():
    pytest.importorskip("triton", reason="triton is not installed")
    from backends import attention_triton  # noqa: F401  (the interpreter was set by conftest.py on CPU)
    if not torch.cuda.is_available() and not attention_triton.INTERPRETED:
        pytest.skip("attention_triton was imported before TRITON_INTERPRET=1 and there is no GPU")
    case = make_case([13, 5], 2, P=1, Hkv=1, G=2, D=16, dtype=torch.float32, seed=3, backend="triton")
    host_cu(case["cu"])
    found = []
    run_ranks(2, _rank_fn(case, found, calls=2), timeout=300)
    assert found == [], found


def test_no_host_reads_in_cp_shift_after_the_first_call():
    cu = cu_to(torch.tensor([0, 12, 20], dtype=torch.int32), "cpu")  # lengths multiples of 2 * cp = 4
    x = torch.randn(20, 3)

    found = []

    def rank(ring):
        xs = zigzag_shard(x, cu, 2, ring.rank).requires_grad_()
        for i in range(2):
            with HostSyncs() if i else contextlib.nullcontext() as syncs:
                for d in (1, 3, -2):
                    cp_shift(xs, cu, d, group=ring)[0].sum().backward()
            if syncs is not None:
                found.extend(syncs.sites)
        return True

    run_ranks(2, rank, timeout=60)
    assert found == [], found


# ------------------------------------------------------------------------------------------ speculative decoding
@pytest.fixture(scope="module")
def pair():
    from draft import Eagle3Draft
    from model import ModelConfig, Transformer
    torch.manual_seed(0)
    target = Transformer(ModelConfig.preset("tiny")).eval()
    return target, Eagle3Draft.from_target(target)


@pytest.mark.parametrize("k, tree, tau", [(4, None, 1.0), (4, None, 0.0), (0, None, 1.0), (0, (2, 2, 1), 1.0)])
def test_decode_step_sync_budget(pair, k, tree, tau):  # adds ~7 s CPU for the four (16 s wall at load 12 on 2 cores)
    """Every sync generate makes outside prefill and finish, per verification forward: <= 3 (chain and tree alike;
    k = 0 is autoregressive sampling through the same loop). EOS and ragged prompts make rows finish at different
    steps, so compaction (its nonzero) runs too."""
    import speculative
    target, draft = pair
    prompts = [torch.randint(97, (n,), generator=torch.Generator().manual_seed(n)) for n in (5, 3, 8, 4)]
    with HostSyncs() as syncs:
        r = speculative.generate(target, draft, prompts, max_new_tokens=16, num_draft_tokens=k, temperature=tau,
                                 eos_id=3, generator=torch.Generator().manual_seed(1), tree=tree)
    loop = syncs.outside("prefill", "finish", "_check")
    steps = r.stats.policy_forwards
    assert steps >= 3 and r.stats.new_tokens > steps
    assert len(loop) <= 3 * steps, (len(loop), steps, loop)
    assert any("compact" in s for s in loop), loop  # the control: rows did finish, compaction was counted
    assert len(syncs.sites) > len(loop)  # ... and prefill / finish's own syncs exist and are excluded by name


# ---------------------------------------------------------------------------------------------- the draft hook
@pytest.mark.parametrize("backend, chunk", [("torch", 0), ("torch", 3), (None, 0)])
def test_draft_hook_sync_budget(backend, chunk):  # adds ~8 s CPU for the three (27 s wall at load 12 on 2 cores)
    """DistCotrainer's draft hook at world size 1 (the TTT loss of one draft on the taps, then its backward), one step
    of two micro-batches: <= 2 syncs per draft per micro-batch, on layouts seen for the first time."""
    from dist_step import DistCotrainer
    from parallel.grid import Grid
    from test_dist_step import grpo, make_batch, make_models, make_policy_opt
    policy, drafts = make_models()
    ct = DistCotrainer(policy, drafts[:1], Grid.build(), make_policy_opt, attn_backend=backend, logprob_chunk=chunk)
    counts, step = [], ct.sched.step

    def counted_step(mbs, loss_fn, hook):
        def counted(d):
            with HostSyncs() as syncs:
                out = hook(d)  # the drafts' losses and their backward
            counts.append(syncs.sites)
            return out
        return step(mbs, loss_fn, counted)

    ct.sched.step = counted_step
    ct.step(make_batch(policy), grpo("global-token"), micro_batches=2)
    assert len(counts) == 2 and all(len(c) <= 2 for c in counts), counts


def test_draft_ttt_sync_budget_under_cp():  # adds ~1 s CPU
    """The same TTT loss + backward on each rank of a cp = 2 ring (threads), zigzag shards, global positions."""
    from branch_mask import cu_seqlens_from_lengths, pad_for_cp, position_ids
    from draft import Eagle3Draft
    from model import EMBED_TAP, ModelConfig, Transformer
    torch.manual_seed(0)
    target = Transformer(ModelConfig.preset("tiny")).double()
    draft = Eagle3Draft.from_target(target).double()
    pad = pad_for_cp(cu_seqlens_from_lengths([13, 7, 20]), 2)
    cu = cu_to(pad.cu_seqlens, "cpu")
    tokens = pad.pad(torch.randint(97, (40,)))
    mask = pad.pad(torch.ones(40, dtype=torch.bool), False)
    mask[cu[1:].long() - 1] = False
    with torch.no_grad():
        out = target(tokens, cu, tap_layers=draft.tap_layers + (EMBED_TAP,))
    found = []

    def rank(ring):
        sh = lambda x: zigzag_shard(x, cu, 2, ring.rank)  # noqa: E731
        taps = {l: sh(t) for l, t in out.taps.items()}
        with HostSyncs() as syncs:
            loss, _ = draft.ttt_loss(taps, sh(tokens), cu, sh(out.logits), loss_mask=sh(mask), num_passes=3,
                                     position_ids=sh(position_ids(cu)), group=ring)
            loss.backward()
        found.append(syncs.sites)
        return True

    run_ranks(2, rank, timeout=120)
    assert len(found) == 2 and all(len(f) <= 2 for f in found), found
