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

Precision: lse and the softmax are fp32 at least. With 16-bit weights the four GEMMs (z = x W^T, again in backward,
dx = dz W, dW = dz^T x) take 16-bit inputs and accumulate in fp32 (modeling.layers.mm_f32 / addmm_f32_: cuBLAS's
bf16 x bf16 -> fp32 through torch's out_dtype, else fp32 math on the same values, W cast a block at a time), dz rounded
once to 16 bits, as a bf16 autograd would hold it. Under mixed precision dW adds into the weight's fp32 .main_grad
chunk by chunk (`WeightGrad`): the backward holds no (V, H) tensor. fp32 / fp64 weights compute in their own precision.

    python -m backends.fused_logprob     # fused == dense (values, grads) on a small case

Letters: T rows, H hidden, V vocab, c rows of one chunk, S sequences.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from modeling.layers import HALF, addmm_f32_, at_least_f32, linear_f32

DEFAULT_CHUNK_MIB = 256.0  # one (rows, V) fp32 logits block per chunk: 441 rows at V = 151936, 2048 at V = 32768


def budget_rows(vocab_size: int, chunk_mib: float = DEFAULT_CHUNK_MIB) -> int:
    """Rows per chunk so that one (rows, V) fp32 block takes chunk_mib MiB (at least 1 row); chunk_mib = 0 -> 0, the
    unfused reference (every (T, V) tensor at once)."""
    if not chunk_mib >= 0 or vocab_size < 1:
        raise ValueError(f"chunk_mib={chunk_mib}, vocab_size={vocab_size}: expected chunk_mib >= 0 and vocab_size >= 1")
    return 0 if chunk_mib == 0 else max(1, int(chunk_mib * 2**20) // (4 * vocab_size))


class FusedTokenLogp(torch.autograd.Function):
    """x (T, H), W (V, H), y (T,) long -> (T,) log softmax(W x / tau)[y], chunk rows at a time (fp32 at least).
    wg: WeightGrad(W, x), W passed as wg.weight() (token_logp does); None: dW in a buffer, returned to autograd."""

    @staticmethod
    def forward(ctx, x, W, y, tau, chunk, wg=None):
        out = torch.empty(x.shape[0], dtype=torch.promote_types(x.dtype, torch.float32), device=x.device)
        lse = torch.empty_like(out)
        for a in range(0, x.shape[0], chunk):
            z = linear_f32(x[a:a + chunk], W) / tau  # (c, V) fp32: the head matmul too (modeling/layers.py)
            lse[a:a + chunk] = torch.logsumexp(z, -1)
            out[a:a + chunk] = z.gather(-1, y[a:a + chunk, None])[:, 0] - lse[a:a + chunk]
        ctx.save_for_backward(x, W, y, lse)
        ctx.tau, ctx.chunk, ctx.wg = tau, chunk, WeightGrad(W) if wg is None else wg
        return out

    @staticmethod
    def backward(ctx, g):
        x, W, y, lse = ctx.saved_tensors
        dx = torch.empty_like(x) if ctx.needs_input_grad[0] else None
        dW = ctx.wg.begin(ctx.needs_input_grad[1])  # dW (V, H) in fp32 at least, or into W's .main_grad
        for a in range(0, x.shape[0], ctx.chunk):
            xc = x[a:a + ctx.chunk]
            p = (linear_f32(xc, W) / ctx.tau).sub_(lse[a:a + ctx.chunk, None]).exp_()  # (c, V) softmax
            dz = p.mul_(-g[a:a + ctx.chunk, None].to(p.dtype))  # (c, V) g (1_y - softmax), in place
            dz[torch.arange(dz.shape[0], device=dz.device), y[a:a + ctx.chunk]] += g[a:a + ctx.chunk].to(p.dtype)
            dz = dz.div_(ctx.tau).to(W.dtype)  # (c, V) both GEMMs' operand: rounded once to a 16-bit W's dtype
            del p  # 16-bit W: the fp32 block goes before the GEMMs
            if dx is not None:
                dx[a:a + ctx.chunk] = (dz @ W).to(x.dtype)
            if dW is not None:
                dW.add_(dz, xc)
        return dx, None if dW is None else dW.result(), None, None, None, None


class WeightGrad:
    """dW = sum_c dz_c^T x_c (V, H) of a streamed LM head W, added chunk by chunk in backward (begin, add_, result).

    Mixed precision (a 16-bit W with an fp32 .main_grad, modeling/mixed_precision.py), given the Function's other
    input x that needs a gradient: the chunks go straight into .main_grad, as Megatron's gradient_accumulation_fusion
    does. The fp32 sum of every backward lands there anyway, so no (V, H) buffer exists and the sum is never rounded
    to 16 bits. The autograd.Function then takes W detached (`weight`): autograd forms no 16-bit (V, H) grad for it
    and .main_grad's hook has nothing to add (torch.autograd.grad, which should not accumulate, would still add).
    Otherwise dW sums in a zeroed buffer in fp32 at least (in bf16, T / rows chunks would round it T / rows times),
    handed to autograd in W's dtype."""

    def __init__(self, W: torch.Tensor, x: torch.Tensor = None):
        self.W, self.acc = W, None
        self.fused = (x is not None and x.requires_grad and W.requires_grad and torch.is_grad_enabled()
                      and W.dtype in HALF and getattr(W, "main_grad", None) is not None)

    def weight(self) -> torch.Tensor:
        """W as the autograd.Function takes it: detached when its gradient goes to .main_grad."""
        return self.W.detach() if self.fused else self.W

    def begin(self, needed: bool):
        """In backward: self with its accumulator (.main_grad, read at use: an optimizer may re-home it; or a zeroed
        buffer), or None when autograd asks for no dW."""
        if not (needed or self.fused):
            return None
        self.acc = self.W.main_grad if self.fused else torch.zeros(
            self.W.shape, dtype=torch.promote_types(self.W.dtype, torch.float32), device=self.W.device)
        return self

    def add_(self, dz: torch.Tensor, x: torch.Tensor) -> None:
        """acc += dz^T x: dz (c, V) in W's dtype, x (c, H). 16-bit: 16-bit inputs with fp32 accumulation
        (modeling.layers.addmm_f32_: tensor cores, no (V, H) temporary); fp32 / fp64: in acc's precision."""
        if dz.dtype in HALF:
            addmm_f32_(self.acc, dz.T, x.to(dz.dtype))
        else:
            self.acc += dz.T.to(self.acc.dtype) @ at_least_f32(x).to(self.acc.dtype)

    def result(self):
        """W's gradient for autograd: None where it went into .main_grad, else the sum in W's dtype. Drops the
        reference to it, so that autograd can take the tensor as W's .grad without a copy."""
        acc, self.acc = self.acc, None
        return None if self.fused else acc.to(self.W.dtype)


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
    wg = WeightGrad(weight, hidden)  # dW into weight's fp32 .main_grad under mixed precision
    return FusedTokenLogp.apply(hidden, wg.weight(), targets.long(), float(temperature), int(chunk), wg)


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
