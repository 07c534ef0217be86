"""decoding/row_streams.py: the counter hash equals its Python-integer reference, uniforms are exact in their dtype,
the inverse-CDF draw never picks a zero-probability token and matches p, speculative sampling through per-row streams
stays lossless (chain and tree, the exact first-3-token distribution), and a row's tokens and log-probs do not depend
on the rows beside it or their order. ~25 s on 2 shared cores (most of it the two 6000-row lossless checks)."""
import math

import pytest
import torch

from decoding.row_streams import RowStreams, multinomial, naive_row_key, naive_stream, row_keys, uniform
from model import ModelConfig, Transformer
from draft import Eagle3Draft
from spec_cases import exact_first3, make_small_vocab_pair
from speculative import generate

pytestmark = pytest.mark.usefixtures("one_thread")
U64 = (1 << 64) - 1


def test_hash_equals_the_python_integer_reference():
    parts = (123456789, 7, torch.arange(6) * 1000003, torch.tensor([0, 1, 2, 3, 2 ** 40, 5]))
    keys = row_keys(*parts)
    ref = [naive_row_key(123456789, 7, 1000003 * i, s) for i, s in enumerate([0, 1, 2, 3, 2 ** 40, 5])]
    assert [k & U64 for k in keys.tolist()] == ref
    s = RowStreams(keys)
    a, b = s.bits(3), s.bits(5)  # the counter moves on: outputs 0..2, then 3..7
    for r in range(6):
        assert [x & U64 for x in a[r].tolist() + b[r].tolist()] == naive_stream(ref[r], 8)
    assert row_keys(1, 2).item() != row_keys(2, 1).item()  # the order of the parts matters


@pytest.mark.parametrize("dtype, m", [(torch.float32, 24), (torch.float64, 53)])
def test_uniforms_are_exact_in_their_dtype(dtype, m):
    s = RowStreams(row_keys(5, torch.arange(4000)))
    u = s.rand(3, dtype=dtype)
    assert u.shape == (4000, 3) and u.dtype == dtype and float(u.min()) >= 0 and float(u.max()) < 1
    assert torch.equal(u * 2.0 ** m, (u * 2.0 ** m).floor())  # a multiple of 2^-m
    assert abs(float(u.double().mean()) - 0.5) < 0.01 and abs(float(u.double().var()) - 1 / 12) < 0.005


def test_multinomial_matches_p_and_never_draws_zero_probability():
    N, p = 60000, torch.tensor([0.1, 0.0, 0.45, 1e-3, 0.0, 0.449])
    x = RowStreams(row_keys(11, torch.arange(N))).multinomial(p.expand(N, -1))
    emp = torch.bincount(x, minlength=6).double() / N
    bound = 0.5 * (p * (1 - p) / N).sqrt().sum().item() + math.sqrt(math.log(1e6) / (2 * N))  # as test_speculative
    assert emp[1] == 0 and emp[4] == 0 and 0.5 * (emp - p.double()).abs().sum() < bound
    edge = torch.tensor([[0.0, 0.0, 1.0, 0.0]])  # the last positive entry is drawn even at u -> 1
    assert int(RowStreams(row_keys(0, torch.arange(1))).multinomial(edge)) == 2


def test_dispatch_keeps_torch_generators_exact_and_checks_rows():
    g1, g2 = torch.Generator().manual_seed(3), torch.Generator().manual_seed(3)
    assert torch.equal(uniform((4, 2), g1, "cpu"), torch.rand(4, 2, generator=g2))
    p = torch.softmax(torch.randn(4, 9), -1)
    assert torch.equal(multinomial(p, g1), torch.multinomial(p, 1, generator=g2)[:, 0])
    with pytest.raises(ValueError, match="row streams: 3 rows"):
        uniform((4, 2), RowStreams(row_keys(0, torch.arange(3))), "cpu")


@pytest.mark.parametrize("tree", [None, (2, 2)])
def test_lossless_through_row_streams(tree):
    """TV(empirical, exact) of the first 3 tokens over 6000 rows below E[TV] + t (the bound of test_speculative.py)."""
    policy, draft = make_small_vocab_pair()
    prompt, V, N = torch.tensor([1, 4, 2]), policy.cfg.vocab_size, 6000
    p = exact_first3(policy, prompt, 1.0)
    r = generate(policy, draft, [prompt] * N, max_new_tokens=3, num_draft_tokens=2, temperature=1.0, tree=tree,
                 generator=RowStreams(row_keys(17, torch.arange(N))))
    emp = torch.bincount(torch.stack(r.tokens) @ torch.tensor([V * V, V, 1]), minlength=V ** 3).double() / N
    bound = 0.5 * (p * (1 - p) / N).sqrt().sum().item() + math.sqrt(math.log(1e6) / (2 * N))
    assert 0.5 * (emp.view(V, V, V) - p).abs().sum().item() < bound
    assert 0.05 < r.stats.accepted / r.stats.drafted < 0.95  # both paths of the rule ran


@pytest.mark.parametrize("k, tree", [(3, None), (0, None), (3, (2, 2, 1))])
def test_a_rows_tokens_do_not_depend_on_its_batch(k, tree):
    """12 rows generated at once, and again as 3 shuffled batches of 4: the same tokens per row. The log-probs agree
    to float rounding only: a row's forward is not bit-invariant to its batch on CPU (the cached attention's SDPA
    kernel sums over the batch's padded key length, MKL's sgemm rounds differently below 4 rows), which is why the
    harness cuts rows into the same blocks on every mesh (harness/mesh.row_blocks)."""
    torch.manual_seed(0)
    policy = Transformer(ModelConfig.preset("tiny")).eval()
    draft = Eagle3Draft.from_target(policy)
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(97, (int(n),), generator=g) for n in torch.randint(3, 12, (12,), generator=g)]
    keys = row_keys(9, torch.arange(12))
    kw = dict(max_new_tokens=24, num_draft_tokens=k, temperature=1.0, eos_id=0, tree=tree)
    full = generate(policy, draft, prompts, generator=RowStreams(keys), **kw)
    order = torch.randperm(12, generator=g)
    for part in order.view(3, 4):
        r = generate(policy, draft, [prompts[i] for i in part], generator=RowStreams(keys[part]), **kw)
        for j, i in enumerate(part.tolist()):
            assert torch.equal(r.tokens[j], full.tokens[i]), (i, r.tokens[j], full.tokens[i])
            assert torch.allclose(r.logprobs[j], full.logprobs[i], rtol=0, atol=1e-5)
    assert sum(t.numel() < 24 for t in full.tokens) >= 3  # a quarter of the rows stopped early: compaction ran
    shared = generate(policy, draft, prompts, generator=torch.Generator().manual_seed(9), **kw)
    alone = generate(policy, draft, prompts[:4], generator=torch.Generator().manual_seed(9), **kw)
    assert any(not torch.equal(a, b) for a, b in zip(shared.tokens, alone.tokens))  # one shared stream: it would
