"""fused_logprob.py: chunked log-probs from the final hidden == the dense (T, V) reference in fp64 (values and grads
to 1e-10, any chunk, temperature, a weighted backward); next_token_logp == rl_loop's on the policy's logits; the
policy's forward with logits=False; the reference log-probs in slices of sequences through the fused path == one
unfused forward; the byte budget's rows; nothing of size T x V saved for backward; clear errors."""
import pytest
import torch

import rl_loop
from backends.fused_logprob import budget_rows, next_token_logp, token_logp, token_logp_dense
from model import ModelConfig, Transformer

pytestmark = pytest.mark.usefixtures("one_thread")
TOL = dict(rtol=1e-10, atol=1e-10)


def leaves(T=29, H=12, V=83, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, H, dtype=torch.float64, generator=g).requires_grad_()
    W = (2 * torch.randn(V, H, dtype=torch.float64, generator=g)).requires_grad_()
    return x, W, torch.randint(V, (T,), generator=g), torch.randn(T, dtype=torch.float64, generator=g)


@pytest.mark.parametrize("chunk,tau", [(1, 1.0), (7, 0.6), (1000, 1.3)])
def test_fused_equals_dense(chunk, tau):
    x, W, y, g = leaves()
    out = token_logp(x, W, y, chunk=chunk, temperature=tau)
    (out * g).sum().backward()  # a weighted backward: each row its own upstream gradient
    got = out.detach(), x.grad.clone(), W.grad.clone()
    x.grad = W.grad = None
    ref = token_logp_dense(x, W, y, temperature=tau)
    (ref * g).sum().backward()
    for a, b in zip(got, (ref.detach(), x.grad, W.grad)):
        torch.testing.assert_close(a, b, **TOL)


def test_next_token_logp_from_hidden_equals_rl_loop():
    torch.manual_seed(0)
    policy = Transformer(ModelConfig.preset("tiny")).double()
    cu = torch.tensor([0, 5, 6, 14, 17], dtype=torch.int32)
    tokens = torch.randint(policy.cfg.vocab_size, (17,))
    out = policy(tokens, cu)
    ref = rl_loop.next_token_logp(out.logits, tokens, cu)
    ref.sum().backward()
    g_ref = {n: p.grad.clone() for n, p in policy.named_parameters()}
    policy.zero_grad()
    h = policy(tokens, cu, logits=False)
    assert h.logits is None
    torch.testing.assert_close(h.hidden, out.hidden, rtol=0, atol=0)
    got = next_token_logp(h.hidden, policy.head_weight, tokens, cu, chunk=4)
    got.sum().backward()
    torch.testing.assert_close(got, ref, **TOL)
    for n, p in policy.named_parameters():
        torch.testing.assert_close(p.grad, g_ref[n], **TOL)


@pytest.mark.parametrize("seqs,chunk,tau", [(2, 3, 1.0), (3, 1, 0.7), (0, None, 1.3)])
def test_reference_logp_sliced_and_fused_equals_one_unfused_forward(seqs, chunk, tau):
    """rl_loop.reference_logp: `seqs` sequences per forward, the head `chunk` rows at a time (None: the byte budget)
    == the unfused reference (logprob_chunk=0, one forward over the batch, (T, V) logits), fp64 to 1e-10."""
    torch.manual_seed(0)
    ref = Transformer(ModelConfig.preset("tiny")).double()
    lens = [5, 1, 8, 3, 6]
    seqs_ = [torch.randint(ref.cfg.vocab_size, (n,)) for n in lens]
    batch = rl_loop.RolloutBatch.from_rollouts([s[:1] for s in seqs_], [s[1:] for s in seqs_],
                                               [torch.zeros(n - 1) for n in lens], torch.zeros(5), torch.ones(5).bool())
    want = rl_loop.reference_logp(ref, batch, temperature=tau, logprob_chunk=0)
    got = rl_loop.reference_logp(ref, batch, temperature=tau, logprob_chunk=chunk, seqs=seqs)
    assert want.shape == got.shape == (sum(lens),) and want.dtype == torch.float64
    torch.testing.assert_close(got, want, **TOL)


def test_budget_rows():
    assert budget_rows(151936, 256) == 441 and budget_rows(32768, 256) == 2048  # one 256 MiB fp32 block
    assert budget_rows(151936, 1) == 1 and budget_rows(97, 0) == 0  # at least a row; 0: the unfused path
    with pytest.raises(ValueError, match="chunk_mib"):
        budget_rows(97, -1)


def test_saves_nothing_of_size_T_by_V():
    x, W, y, _ = leaves(T=64, H=8, V=300)
    sizes = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: sizes.append(tuple(t.shape)) or t, lambda t: t):
        token_logp(x, W, y, chunk=8)
    assert (64, 8) in sizes and not [s for s in sizes if len(s) == 2 and s[-1] == 300 and s[0] > 8]


def test_bad_input():
    x, W, y, _ = leaves()
    with pytest.raises(ValueError, match="chunk"):
        token_logp(x, W, y, chunk=0)
    with pytest.raises(ValueError, match="targets"):
        token_logp(x, W, y[:3], chunk=4)
    with pytest.raises(ValueError, match="weight"):
        token_logp(x, W[:, :5], y, chunk=4)
    with pytest.raises(ValueError, match="temperature"):
        token_logp(x, W, y, chunk=4, temperature=0.0)


def test_head_logits_are_fp32_from_bf16_weights():
    """modeling.layers.linear_f32, the LM head of every compared log-prob: bf16 hidden and weights, fp32 logits equal
    to the fp64 product of the same bf16 numbers within fp32 accumulation (1e-5 relative), where the bf16 matmul's
    output rounding is ~2^-9 relative. Adds < 0.1 s."""
    from modeling.layers import linear_f32
    g = torch.Generator().manual_seed(0)
    x = torch.randn(16, 64, generator=g).bfloat16()
    W = torch.randn(200, 64, generator=g).bfloat16()
    exact = x.double() @ W.double().T
    got = linear_f32(x, W)
    scale = exact.abs().max().item()
    assert got.dtype == torch.float32
    assert (got.double() - exact).abs().max().item() <= 1e-5 * scale
    assert (torch.nn.functional.linear(x, W).double() - exact).abs().max().item() > 1e-3 * scale  # what it replaces
