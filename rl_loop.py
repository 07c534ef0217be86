"""GRPO with an online co-trained draft (any family: EAGLE-3, DFlash, DSpark): the math of one RL update and the
co-training step.

For each prompt, G responses o_1..o_G are sampled (speculatively, exactly from pi_old) and scored r_1..r_G.

  1. Group-relative advantages (GRPO, DeepSeekMath [Shao et al. 2024]), shared by every token of o_i:
         A_i = (r_i - mean(r)) / (std(r) + eps)      std: the unbiased sample std of the group, as in TRL
         A_i =  r_i - mean(r)                        Dr. GRPO [Liu et al. 2025]: no std (std_norm=False)
     Groups whose rewards are all equal give A = 0: they are counted and skipped (no loss, no token counts; DAPO).
  2. Clipped surrogate with asymmetric clip ("clip-higher", DAPO [Yu et al. 2025]) and an optional KL penalty:
         rho_{i,t} = pi_theta(o_t | q, o_<t) / pi_old(o_t | q, o_<t)    (pi_old: the log-probs the rollout recorded)
     Every pi here is softmax(logits / tau) at the rollout's temperature tau (GRPOConfig.temperature): the samples
     come from pi_old at tau, so on-policy rho = 1 exactly; a log_softmax(logits) would make rho != 1 at tau != 1.
     (The draft's teacher is not tempered: step 4.)
         l_{i,t}   = -min(rho A_i, clip(rho, 1 - eps_low, 1 + eps_high) A_i) + beta * k3_{i,t}
         k3        = ratio - 1 - log ratio,  ratio = pi_ref / pi_theta  (unbiased, always >= 0; Schulman 2020,
                     "Approximating KL Divergence", http://joschu.net/blog/kl-approx.html; used by GRPO)
  3. Aggregation over the update's minibatch M (|o_i| = response length, L_max = max new tokens):
         seq-mean     (GRPO)      L = 1/|M| sum_i 1/|o_i| sum_t l_{i,t}
         token-mean               L = mean over the tokens of each micro-batch, averaged over micro-batches
         global-token (DAPO)      L = 1/sum_i |o_i| sum_{i,t} l_{i,t}   (global count over all micro-batches/ranks)
         constant     (Dr. GRPO)  L = 1/(|M| L_max) sum_{i,t} l_{i,t}
     Each is a function in LOSS_NORMS (register_loss_norm adds one; --loss_norm picks it). dist_step.py needs every
     one LINEAR in the l_{i,t}: it takes the weights w_t = dL/dl_t once per minibatch (docs/EXTENDING.md).
  4. Co-training: one policy forward over the packed rollouts returns logits and the taps; the draft's loss reads
     the taps (detached) with the policy's own distributions (detached) as teacher:
         total = L_policy + lambda * L_draft      (no extra policy forward for the draft)
     The teacher is the UNtempered softmax(z), whatever tau: the draft fits softmax(z_d) to softmax(z), and at
     inference draft and policy are tempered alike (speculative.py: q = softmax(z_d / tau), p = softmax(z / tau)), so a
     perfect draft (z_d = z) accepts every token at any tau. A teacher softmax(z / tau) would temper twice: its
     perfect draft proposes softmax(z / tau^2) against p = softmax(z / tau) (tests/test_temperature.py). EAGLE-3,
     DFlash and vLLM train and sample the same way.
     The two graphs share no tensor, so the policy gets no gradient from L_draft and the draft none from L_policy;
     each has its own optimizer, learning rate and gradient clipping.

Everything works on a `RolloutBatch`: S prompt+response sequences packed into T tokens, so a micro-batch is just a
subset of sequences (`select`). The step that applies this math is dist_step.DistCotrainer.step, the one train.py runs
at every world size (one process: the 1 x 1 x 1 grid). tests/reference_step.py writes the same step as a plain loop
in one process; it is the oracle the step equals to fp64 round-off:

    python -m pytest -q tests/test_rl_loop.py       # the math: advantages, clipping, k3, the normalisations
    python -m pytest -q tests/test_dist_step.py     # DistCotrainer.step == the oracle, one process and 4 gloo ranks

Indexing, one rule for every packed (T,) array: entry t is about tokens[t], the token itself. resp_mask[t] says
it is a response token; old_logp[t], ref_logp[t] and next_token_logp(...)[t] are log p(tokens[t] | the tokens before
it in its sequence), 0 at a sequence's first token, which nothing predicts; speculative.Rollout.logprobs[b][j] is the
log-prob of generated token j. The model's outputs (logits, hidden states, taps) sit at the row that computes them,
so their row t predicts tokens[t+1]; an array read next to those rows -- the draft's loss mask (`draft_mask`,
Eagle3Draft.ttt_loss's loss_mask, draft_loss.pass_targets) and the labels and weights dist_step moves under CP -- is
a per-token array moved one row up by `per_prediction` (out[t] = x[t+1], zero at a sequence's last row) and is
called "per prediction" where it is defined.

Letters: T packed tokens, t a row of the packed batch, S sequences, G group size, V vocab, H hidden.
"""
from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Optional

import torch

from backends import fused_logprob
from branch_mask import cu_seqlens_from_lengths, seq_ids
from modeling.layers import at_least_f32

LOSS_NORMS: dict = {}  # --loss_norm NAME -> fn(l, mask, cu_seqlens, *, n_seqs, n_tokens, max_len, n_micro) -> ()


def register_loss_norm(name: str):
    """Decorator: fn(l, mask, cu_seqlens, *, n_seqs, n_tokens, max_len, n_micro) -> this micro-batch's share of the
    minibatch loss, l = the per-token losses (T,) already zero off `mask` (T,); linear in l (dist_step.py's weights)."""
    def add(fn):
        if name in LOSS_NORMS:
            raise ValueError(f"loss_norm={name!r}: already registered")
        LOSS_NORMS[name] = fn
        return fn
    return add


# ---------------------------------------------------------------------------------------------------- packed batches
def pack(seqs: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """list of S 1-D token tensors -> tokens (T,), cu_seqlens int32 (S+1,)."""
    if not seqs or any(s.dim() != 1 or s.numel() == 0 for s in seqs):
        raise ValueError("pack: expected a non-empty list of non-empty 1-D tensors")
    return torch.cat(seqs), cu_seqlens_from_lengths([s.numel() for s in seqs])


@dataclass
class RolloutBatch:
    """S packed sequences (prompt + response) and what GRPO needs per token / per sequence."""
    tokens: torch.Tensor  # (T,) long
    cu_seqlens: torch.Tensor  # (S+1,) int32
    resp_mask: torch.Tensor  # (T,) bool: tokens[t] is a response token (its log-prob is trained)
    old_logp: torch.Tensor  # (T,) log pi_old(tokens[t] | prefix) from the rollout; 0 off the response
    adv: torch.Tensor  # (S,) advantage A_i
    valid: torch.Tensor  # (S,) bool: the group had reward variance (else skipped)
    ref_logp: Optional[torch.Tensor] = None  # (T,) log pi_ref(tokens[t] | prefix), for the k3 penalty

    @classmethod
    def from_rollouts(cls, prompts, responses, resp_logp, adv, valid):
        """prompts / responses / resp_logp: lists of S 1-D tensors (resp_logp[i][j] = log pi_old of responses[i][j])."""
        tokens, cu = pack([torch.cat([p, r]) for p, r in zip(prompts, responses)])
        resp_mask = torch.cat([torch.cat([torch.zeros(p.numel(), dtype=torch.bool),
                                          torch.ones(r.numel(), dtype=torch.bool)])
                               for p, r in zip(prompts, responses)])
        old = torch.cat([torch.cat([torch.zeros(p.numel()), lp.float()]) for p, lp in zip(prompts, resp_logp)])
        return cls(tokens, cu, resp_mask, old, adv.float(), valid.bool())

    @property
    def num_seqs(self) -> int:
        return self.cu_seqlens.numel() - 1

    def to(self, device) -> "RolloutBatch":
        """The batch on `device` (itself when already there). Batches are built and exchanged on the CPU; the forwards
        that read them move them to the model's device."""
        if self.tokens.device == torch.device(device):
            return self
        return RolloutBatch(*(None if t is None else t.to(device) for t in (
            self.tokens, self.cu_seqlens, self.resp_mask, self.old_logp, self.adv, self.valid, self.ref_logp)))

    def trained_mask(self) -> torch.Tensor:  # (T,) response tokens of valid (non-zero-variance) groups
        return self.resp_mask & self.valid[seq_ids(self.cu_seqlens)]

    def select(self, idx) -> "RolloutBatch":
        """The sub-batch of sequences idx (a micro-batch), re-packed."""
        idx = torch.as_tensor(idx, dtype=torch.long)
        cu = self.cu_seqlens.long()
        tok_idx = torch.cat([torch.arange(int(cu[i]), int(cu[i + 1])) for i in idx.tolist()])
        new_cu = cu_seqlens_from_lengths(cu[idx + 1] - cu[idx])
        per_tok = {k: getattr(self, k)[tok_idx] for k in ("tokens", "resp_mask", "old_logp")}
        ref = None if self.ref_logp is None else self.ref_logp[tok_idx]
        return RolloutBatch(cu_seqlens=new_cu, adv=self.adv[idx], valid=self.valid[idx], ref_logp=ref, **per_tok)


def per_prediction(x: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
    """Per token (T,) -> per prediction (T,): out[t] = x[t+1], the entry of the token that row t predicts; 0 (False)
    at each sequence's last row, which predicts nothing (module docstring: indexing)."""
    out = torch.roll(x, -1).clone()
    out[cu_seqlens[1:].long() - 1] = 0
    return out


def token_logp(logits: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """logits (T, V), targets (T,) -> (T,) log softmax(logits / tau)[t, targets[t]] (row-aligned: per prediction when
    targets = per_prediction(tokens)), in fp32 at least (bf16 logits; fp64 kept). tau: the rollout's temperature --
    the distribution the samples came from, so that every log-prob of the update (old, new, reference) is of the same
    pi. Gathered logit minus logsumexp: never materialises the (T, V) log-softmax."""
    z = at_least_f32(logits) if temperature == 1.0 else at_least_f32(logits) / temperature
    return z.gather(-1, targets[:, None])[:, 0] - torch.logsumexp(z, -1)


def next_token_logp(logits: torch.Tensor, tokens: torch.Tensor, cu_seqlens: torch.Tensor,
                    temperature: float = 1.0) -> torch.Tensor:
    """logits (T, V) of a packed forward -> per token (T,) log p_tau(tokens[t] | tokens of its sequence before t); 0 at
    starts (row t-1 predicts token t). p_tau = softmax(logits / tau), the rollout's temperature."""
    lp = token_logp(logits[:-1], tokens[1:], temperature)
    out = torch.zeros(tokens.shape[0], dtype=lp.dtype, device=logits.device)
    starts = torch.zeros_like(tokens, dtype=torch.bool)
    starts[cu_seqlens[:-1].long()] = True
    return torch.cat([out[:1], lp]).masked_fill(starts, 0.0)


# ------------------------------------------------------------------------------------------------------- GRPO math
def group_advantages(rewards: torch.Tensor, group_size: int, *, std_norm: bool = True, eps: float = 1e-6):
    """rewards (S,) with S = n_prompts * G, groups contiguous -> (A (S,), valid (S,) bool: group std > 0)."""
    if group_size < 2 or rewards.numel() % group_size:
        raise ValueError(f"group_size={group_size}: expected >= 2 and dividing the {rewards.numel()} rewards")
    r = rewards.float().view(-1, group_size)  # (n_prompts, G)
    std = r.std(dim=1, keepdim=True)  # unbiased (Bessel) like TRL's GRPO
    A = r - r.mean(dim=1, keepdim=True)
    if std_norm:
        A = A / (std + eps)
    valid = (r.max(dim=1, keepdim=True).values > r.min(dim=1, keepdim=True).values).expand_as(r)
    return torch.where(valid, A, 0.0).reshape(-1), valid.reshape(-1)


def clipped_surrogate(logp, old_logp, adv, eps_low: float, eps_high: float):
    """Per-token -min(rho A, clip(rho, 1-eps_low, 1+eps_high) A); logp/old_logp/adv (T,). Returns (loss, clipped)."""
    rho = torch.exp(logp - old_logp)
    unclipped, clipped = rho * adv, rho.clamp(1.0 - eps_low, 1.0 + eps_high) * adv
    return -torch.minimum(unclipped, clipped), (clipped < unclipped)


def k3(logp, ref_logp):
    """k3 = ratio - 1 - log ratio, ratio = pi_ref / pi_theta, per token (T,): an unbiased, non-negative estimate of
    KL(pi_theta || pi_ref) from samples of pi_theta (Schulman 2020)."""
    log_ratio = ref_logp - logp
    return torch.exp(log_ratio) - 1.0 - log_ratio


def aggregate(loss_tok, mask, cu_seqlens, norm: str, *, n_seqs: int, n_tokens: int, max_len: int, n_micro: int = 1):
    """Reduce per-token losses (T,) over `mask` (T,) to this micro-batch's share of the minibatch loss.

    n_seqs / n_tokens: the number of trained sequences / tokens in the whole minibatch (all micro-batches, all ranks);
    summing the returned values over micro-batches gives the formulas in the module docstring."""
    if norm not in LOSS_NORMS:
        raise ValueError(f"loss_norm={norm!r}: expected one of {tuple(LOSS_NORMS)}")
    return LOSS_NORMS[norm](loss_tok * mask, mask, cu_seqlens, n_seqs=n_seqs, n_tokens=n_tokens, max_len=max_len,
                            n_micro=n_micro)


@register_loss_norm("seq-mean")
def _seq_mean(l, mask, cu_seqlens, *, n_seqs, n_tokens, max_len, n_micro):
    sid = seq_ids(cu_seqlens).to(l.device)
    S = cu_seqlens.numel() - 1
    per_seq = torch.zeros(S, dtype=l.dtype, device=l.device).index_add(0, sid, l)
    n_tok = torch.zeros(S, dtype=l.dtype, device=l.device).index_add(0, sid, mask.to(l.dtype))
    return (per_seq / n_tok.clamp_min(1)).sum() / max(n_seqs, 1)


@register_loss_norm("token-mean")
def _token_mean(l, mask, cu_seqlens, *, n_seqs, n_tokens, max_len, n_micro):
    return l.sum() / mask.sum().clamp_min(1) / n_micro


@register_loss_norm("global-token")
def _global_token(l, mask, cu_seqlens, *, n_seqs, n_tokens, max_len, n_micro):
    return l.sum() / max(n_tokens, 1)


@register_loss_norm("constant")  # Dr. GRPO
def _constant(l, mask, cu_seqlens, *, n_seqs, n_tokens, max_len, n_micro):
    return l.sum() / (max(n_seqs, 1) * max_len)


@dataclass
class GRPOKnobs:
    """The paper's GRPO settings, each a flag of train.py (harness/config.Config takes them from here, its --help
    their comments): a new one is a field here, its use in this file and its row of config.CHECKS."""
    # GRPO (rl_loop.py)
    eps_low: float = 0.2  # PPO clip below: the ratio is clipped to [1 - eps_low, 1 + eps_high]
    eps_high: float = 0.28  # PPO clip above (asymmetric, "clip-higher": keeps low-probability tokens explorable)
    beta: float = 0.0  # k3 KL penalty to the frozen reference (0: drift is measured, not penalised)
    std_norm: bool = True  # divide the group advantage by the group's reward std (off + loss_norm=constant: Dr. GRPO)
    loss_norm: str = "global-token"  # how token losses are averaged (rl_loop.aggregate)


@dataclass
class GRPOConfig(GRPOKnobs):
    """The knobs and what the run fixes: the "constant" normalisation's L_max and the rollouts' temperature."""
    max_len: int = 64  # L_max for the "constant" normalisation (the rollout's max new tokens)
    temperature: float = 1.0  # the rollout's tau: pi_theta, pi_old and pi_ref are all softmax(logits / tau)

    @classmethod
    def of(cls, knobs: GRPOKnobs, **fixed) -> GRPOConfig:
        """The GRPOKnobs fields of `knobs` (train.py's Config has them all), with max_len / temperature."""
        return cls(**{f.name: getattr(knobs, f.name) for f in fields(GRPOKnobs)}, **fixed)

    def __post_init__(self):
        if not self.temperature > 0:
            raise ValueError(f"temperature={self.temperature}: expected > 0 (the rollouts' sampling temperature)")
        if self.loss_norm not in LOSS_NORMS:
            raise ValueError(f"loss_norm={self.loss_norm!r}: expected one of {tuple(LOSS_NORMS)}")
        if not (0 <= self.eps_low < 1 and self.eps_high >= 0):
            raise ValueError(f"eps_low={self.eps_low}, eps_high={self.eps_high}: expected 0 <= eps_low < 1, "
                             f"eps_high >= 0")


def token_losses(logp, old_logp, adv, ref_logp, cfg: GRPOConfig):
    """Step 2 per token: l_t = -min(rho A, clip(rho) A) + beta k3_t. logp / old_logp / adv / ref_logp (T,); ref_logp
    may be None when beta = 0. Returns (l, clipped, k3) -- k3 is zeros when beta = 0 (not computed)."""
    l, clipped = clipped_surrogate(logp, old_logp, adv, cfg.eps_low, cfg.eps_high)
    if cfg.beta == 0:
        return l, clipped, torch.zeros_like(l)
    if ref_logp is None:
        raise ValueError("beta > 0 needs ref_logp in the batch (the frozen reference's log-probs)")
    kl = k3(logp, ref_logp)
    return l + cfg.beta * kl, clipped, kl


# ------------------------------------------------------------------------------------------------ the co-training step
@dataclass
class DraftTrainer:
    """A draft with its own optimizer, loss weight lambda and gradient clipping (co-trained on the policy's taps)."""
    draft: torch.nn.Module
    opt: torch.optim.Optimizer
    lam: float = 1.0
    grad_clip: float = 1.0
    num_passes: int = 3  # TTT's passes (a chain drafter's loss_options read them)
    pass_weight: float = 0.8  # TTT's per-pass weight decay
    attn_fn: Optional[object] = None  # the draft's single-process training attention (None: the family's default)
    opts: dict = field(default_factory=dict)  # other families' loss options (drafter.py: draft.loss_options reads)


def draft_mask(mb: RolloutBatch) -> torch.Tensor:
    """(T,) bool per prediction: the rows whose next-token prediction the draft learns, those predicting a response
    token (the draft only ever proposes response tokens; a prompt is task input, not policy output)."""
    return per_prediction(mb.resp_mask, mb.cu_seqlens)


def draft_loss(tr: DraftTrainer, taps: dict, logits, mb: RolloutBatch, *, hidden=None, head=None, chunk=None):
    """L_draft: the draft's loss (drafter.py; EAGLE-3: TTT) on detached taps with the policy's detached logits as
    teacher, untempered: softmax(z) at any rollout temperature (module docstring, step 4: draft and policy are
    tempered alike at inference). Returns (loss, metrics); the metrics (alpha, tau_hat) are those of the untempered
    pair. logits None: the teacher is the policy's final normed hidden (T, H) with its LM head (V, H), its logits
    formed `chunk` rows at a time inside the streamed loss (no (T, V) tensor). chunk: rows per chunk of the streamed
    loss (None or 0: draft_loss.chunk_rows's default budget)."""
    taps = {l: taps[l].detach() for l in tr.draft.tap_layers}
    if logits is not None:
        teacher = dict(teacher_logits=logits.detach())
    else:
        teacher = dict(teacher_hidden=hidden.detach(), teacher_head=head.detach())
    return tr.draft.loss(taps, mb.tokens, mb.cu_seqlens, loss_mask=draft_mask(mb), attn_fn=tr.attn_fn,
                         chunk=chunk or None, **tr.draft.loss_options(tr), **teacher)


def packed_logp(out, head, tokens, cu_seqlens, *, chunk: int, temperature: float = 1.0) -> torch.Tensor:
    """next_token_logp of a packed forward's output `out` (model.ModelOutput): from its logits (T, V) when it has
    them (chunk = 0, the unfused reference), else from its final hidden (T, H) and the LM head (V, H), `chunk` rows
    at a time (fused_logprob.next_token_logp; gradients kept)."""
    if out.logits is not None:
        return next_token_logp(out.logits, tokens, cu_seqlens, temperature)
    return fused_logprob.next_token_logp(out.hidden, head, tokens, cu_seqlens, chunk=chunk, temperature=temperature)


def micro_chunks(num_seqs: int, micro_batches: int) -> list:
    """The micro-batches of an update: its sequence indices cut into `micro_batches` runs of equal length. Every loss
    that averages over micro-batches divides by micro_batches, so it must divide num_seqs: torch.chunk would make
    fewer, unequal runs (3 for 4 sequences gives 2) and shrink those losses (by 2/3)."""
    if micro_batches < 1 or num_seqs % micro_batches:
        ok = [d for d in range(1, num_seqs + 1) if num_seqs % d == 0]
        raise ValueError(f"micro_batches={micro_batches}: must divide the update's {num_seqs} sequences into equal "
                         f"micro-batches (--micro_batches: one of {ok})")
    return list(torch.arange(num_seqs).chunk(micro_batches))


@torch.no_grad()
def check_finite_weights(model: torch.nn.Module, what: str, hint: str = ""):
    """Raise FloatingPointError naming `what` and the first non-finite parameter (an update that overflowed)."""
    bad = [n for n, p in model.named_parameters() if not bool(torch.isfinite(p).all())]
    if bad:
        more = f" and {len(bad) - 1} more" if len(bad) > 1 else ""
        raise FloatingPointError(f"{what}: the weights are not finite ({bad[0]}{more}){'; ' + hint if hint else ''}")


@torch.no_grad()
def reference_logp(ref, batch: RolloutBatch, *, attn_fn=None, temperature: float = 1.0, logprob_chunk=None,
                   seqs: int = 0) -> torch.Tensor:
    """log pi_ref(tokens[t] | prefix) per token (T,) from the frozen reference (no-grad forwards), on the batch's
    device; pi_ref = softmax(logits / tau) at the rollout's temperature, like pi_old and pi_theta.
    seqs > 0: `seqs` sequences per forward (the batch in slices, like the update's micro-batches); 0: one forward.
    logprob_chunk: rows of the LM head per chunk from the final hidden (fused_logprob; None: the default byte budget,
    fused_logprob.budget_rows); 0: the unfused reference, (T, V) logits per forward."""
    dev = next(ref.parameters()).device
    chunk = fused_logprob.budget_rows(ref.cfg.vocab_size) if logprob_chunk is None else int(logprob_chunk)
    S = batch.num_seqs
    step = S if seqs <= 0 else seqs
    out = []
    for a in range(0, S, step):
        b = (batch if step >= S else batch.select(torch.arange(a, min(a + step, S)))).to(dev)
        o = ref(b.tokens, b.cu_seqlens, attn_fn=attn_fn, logits=chunk == 0)  # logits (T, V) only unfused
        out.append(packed_logp(o, ref.head_weight, b.tokens, b.cu_seqlens, chunk=chunk, temperature=temperature))
    return torch.cat(out).to(batch.tokens.device)


def rollout_kl(batch: RolloutBatch) -> float:
    """KL(pi_t || pi_ref) estimated on the rollouts themselves: they are samples of pi_t = pi_old, so the mean k3 with
    ratio = pi_ref / pi_old over all response tokens is unbiased -- no extra policy forward needed."""
    if batch.ref_logp is None:
        raise ValueError("rollout_kl: the batch has no ref_logp")
    m = batch.resp_mask
    return float(k3(batch.old_logp[m], batch.ref_logp[m]).mean()) if m.any() else 0.0
