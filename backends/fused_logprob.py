"""Log-probabilities of chosen tokens straight from the final hidden state: the LM head applied chunk by chunk.

    log p(y_t) = z_t[y_t] - lse(z_t),     z_t = W x_t / tau        (x_t the final normed hidden, W the LM head (V, H))
    d log p(y_t) / dz_t = 1_{y_t} - softmax(z_t)
    dx_t = g_t (W[y_t] - softmax(z_t) W) / tau,     dW = sum_t g_t (1_{y_t} - softmax(z_t))^T x_t / tau

GRPO needs log pi(o_t) of the sampled tokens (new with gradient; old and reference without), and the draft's teacher
needs the policy's distribution; neither needs the (T, V) logits to exist at once. `token_logp` computes them `chunk`
rows at a time and saves only x (an input, (T, H)) and lse (T,); backward recomputes z one chunk at a time (the fused
linear cross-entropy pattern of Liger-Kernel and Cut Your Losses; verl's and NeMo-RL's chunked log-prob options). With
it, and the draft's fused teacher (draft_loss.Teacher(hidden, head=W)), a training step holds no (T, V) tensor: its
memory grows with V only through W, its gradient and one (chunk, V) block. `token_logp_dense` is the reference.

The chunk is a byte budget, not a row count (`budget_rows`, --chunk_mib): rows = chunk_mib MiB / (4 V) fp32 logits,
so every vocabulary gets blocks of the same size, and the head W is read once per chunk (T / rows times per pass):
a fixed small row count would re-read it more often the larger V is.

    python -m backends.fused_logprob     # fused == dense (values, grads) on a small case

Letters: T rows, H hidden, V vocab, c rows of one chunk, S sequences.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from modeling.layers import at_least_f32, linear_f32

DEFAULT_CHUNK_MIB = 256.0  # one (rows, V) fp32 logits block per chunk: 441 rows at V = 151936, 2048 at V = 32768


def budget_rows(vocab_size: int, chunk_mib: float = DEFAULT_CHUNK_MIB) -> int:
    """Rows per chunk so that one (rows, V) fp32 block takes chunk_mib MiB (at least 1 row); chunk_mib = 0 -> 0, the
    unfused reference (every (T, V) tensor at once)."""
    if not chunk_mib >= 0 or vocab_size < 1:
        raise ValueError(f"chunk_mib={chunk_mib}, vocab_size={vocab_size}: expected chunk_mib >= 0 and vocab_size >= 1")
    return 0 if chunk_mib == 0 else max(1, int(chunk_mib * 2**20) // (4 * vocab_size))


class FusedTokenLogp(torch.autograd.Function):
    """x (T, H), W (V, H), y (T,) long -> (T,) log softmax(W x / tau)[y], chunk rows at a time (fp32 at least)."""

    @staticmethod
    def forward(ctx, x, W, y, tau, chunk):
        out = torch.empty(x.shape[0], dtype=torch.promote_types(x.dtype, torch.float32), device=x.device)
        lse = torch.empty_like(out)
        for a in range(0, x.shape[0], chunk):
            z = linear_f32(x[a:a + chunk], W) / tau  # (c, V) fp32: the head matmul too (modeling/layers.py)
            lse[a:a + chunk] = torch.logsumexp(z, -1)
            out[a:a + chunk] = z.gather(-1, y[a:a + chunk, None])[:, 0] - lse[a:a + chunk]
        ctx.save_for_backward(x, W, y, lse)
        ctx.tau, ctx.chunk = tau, chunk
        return out

    @staticmethod
    def backward(ctx, g):
        x, W, y, lse = ctx.saved_tensors
        dx = torch.empty_like(x) if ctx.needs_input_grad[0] else None
        dW = torch.zeros(W.shape, dtype=torch.promote_types(W.dtype, torch.float32), device=W.device) \
            if ctx.needs_input_grad[1] else None
        for a in range(0, x.shape[0], ctx.chunk):
            xc = x[a:a + ctx.chunk]
            p = (linear_f32(xc, W) / ctx.tau).sub_(lse[a:a + ctx.chunk, None]).exp_()  # (c, V) softmax
            dz = p.mul_(-g[a:a + ctx.chunk, None].to(p.dtype))  # (c, V) g (1_y - softmax), in place
            dz[torch.arange(dz.shape[0], device=dz.device), y[a:a + ctx.chunk]] += g[a:a + ctx.chunk].to(p.dtype)
            dz /= ctx.tau
            if dx is not None:
                dx[a:a + ctx.chunk] = (dz.to(W.dtype) @ W).to(x.dtype)
            if dW is not None:
                dW += dz.T.to(dW.dtype) @ at_least_f32(xc).to(dW.dtype)
        return dx, None if dW is None else dW.to(W.dtype), None, None, None


def token_logp(hidden, weight, targets, *, chunk: int, temperature: float = 1.0):
    """(T,) log p(targets[t]) under softmax(weight @ hidden[t] / temperature), chunk rows at a time.

    hidden (T, H): the policy's final normed hidden (Transformer(..., logits=False).hidden); weight (V, H): its
    LM-head weight (Transformer.head_weight); targets (T,) ids in [0, V)."""
    if chunk < 1:
        raise ValueError(f"chunk={chunk}: expected >= 1 rows (0 means the unfused path: token_logp_dense)")
    if hidden.dim() != 2 or weight.dim() != 2 or hidden.shape[1] != weight.shape[1]:
        raise ValueError(f"hidden {tuple(hidden.shape)}, weight {tuple(weight.shape)}: expected (T, H) and (V, H)")
    if targets.shape != hidden.shape[:1]:
        raise ValueError(f"targets: expected shape ({hidden.shape[0]},), got {tuple(targets.shape)}")
    if not temperature > 0:
        raise ValueError(f"temperature={temperature}: expected > 0")
    return FusedTokenLogp.apply(hidden, weight, targets.long(), float(temperature), int(chunk))


def token_logp_dense(hidden, weight, targets, *, temperature: float = 1.0):
    """The reference: the whole (T, V) logits at once."""
    z = linear_f32(hidden, weight) / temperature  # (T, V)
    return z.gather(-1, targets.long()[:, None])[:, 0] - torch.logsumexp(z, -1)


def next_token_logp(hidden, weight, tokens, cu_seqlens, *, chunk: int, temperature: float = 1.0):
    """rl_loop.next_token_logp from the final hidden: (T,) log p(tokens[t] | its prefix), 0 at each sequence start.
    Row t-1 predicts token t: the targets are shifted by index (tokens[t+1] at row t), no row of x moves."""
    T = tokens.shape[0]
    nxt = torch.cat([tokens[1:], tokens[:1]])  # (T,) row t's target; the last row's is a placeholder
    lp = token_logp(hidden, weight, nxt, chunk=chunk, temperature=temperature)  # (T,) row t scores token t+1
    out = torch.cat([lp.new_zeros(1), lp[:-1]])  # token t's log-prob comes from row t-1
    starts = torch.zeros(T, dtype=torch.bool, device=tokens.device)
    starts[cu_seqlens[:-1].long()] = True
    return out.masked_fill(starts, 0.0)


if __name__ == "__main__":
    from parallel.cli import answer_help
    answer_help(__doc__, __file__)  # -h / --help: usage and summary from the docstring, exit 0
    torch.manual_seed(0)
    x = torch.randn(37, 16, dtype=torch.float64, requires_grad=True)
    W = torch.randn(101, 16, dtype=torch.float64, requires_grad=True)
    y = torch.randint(101, (37,))
    fused = token_logp(x, W, y, chunk=8, temperature=0.7)
    fused.sum().backward()
    gx, gW = x.grad.clone(), W.grad.clone()
    x.grad = W.grad = None
    dense = token_logp_dense(x, W, y, temperature=0.7)
    dense.sum().backward()
    print(f"max |fused - dense|: value {(fused - dense).abs().max():.1e}, dx {(gx - x.grad).abs().max():.1e}, "
          f"dW {(gW - W.grad).abs().max():.1e}")
