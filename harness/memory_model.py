"""A model of one rank's memory in a co-training run: bytes per component, from the config, the model's shape and the
mesh -- before anything is allocated. harness/memory_plan.py prints it; harness/memory_track.py checks it against the
tensors a real step allocates (tests/test_memory_plan.py).

Per rank of pipeline stage s (the stage's DP x CP ranks are alike; global rank 0 also trains the offline arm):

  persistent (held between steps)
    weights      the stage's parameters in --dtype (ZeRO-1 / bf16: one flat buffer padded to n slices)
    grads        fp32 .main_grad per parameter (bf16), else .grad in fp32
    optimizer    AdamW m, v (+ fp32 master slice with bf16 or --zero1), over n = dp * cp ranks with --zero1 else 1:
                 bf16: 12 N / n;  fp32: 8 N (12 N / n with --zero1)
    copy:<name>  each full copy the rank keeps (held_copies: the rule), weights in --dtype; the drafts share the
                 policy's embedding, and the rollout policy's layers of this stage are the stage's weights (aliased)
    draft_optim  the drafts' grads and AdamW state where they are trained (the last stage; the offline arm on rank 0),
                 bf16's fp32 masters and accumulators too: nowhere else
    tap_slots    TapChannel's landing slots on the last stage: one (T_mb, H) per tapped layer of an earlier stage
  transient (a phase's peak; the run's peak is the larger phase)
    rollout      kv_cache (policy: layers x B x Hkv x L x D x 2, L grown in blocks to the longest row, at worst the
                 budget: kv_slots; the draft's: EAGLE-3's one layer, a block draft's L_d with room for its block)
                 + verify_logits (the
                 verification's vocabulary-sized working set) + prefill (prefill_bytes: the policy's taps over the
                 prompts, held while the draft's trunk runs over them, a layer's working set, and one block of the
                 cached attention's mask); or the reference forward's working set over rollout_batch
                 sequences, whichever is larger (the caches are freed first)
    update       activations (saved for backward: in-flight micro-batches x layers x T x per-token bytes; with
                 --activation_checkpointing only the layer inputs, plus one layer recomputed), draft_activations (every
                 trained arm's graph for one micro-batch, alive until their one backward: draft_act_bytes, TTT's
                 passes or a block family's anchors), logits_chunks (the
                 streamed LM head's blocks), head_buffers (head_bytes: fp32 (V, H) gradient partials of the streamed
                 heads under fp32; under bf16 only a tied embedding's gradient or the CPU's cast block) and
                 comm_buffers (pipeline p2p, ring K/V); or, after the
                 backward, one at a time: reduce_bucket (the gradient reduction's bucket), optimizer_step (step_bytes:
                 the fp32 gradient slice, AdamW's temporaries, ZeRO-1's all_gather copies), refit_bucket
                 (DistCotrainer.refit: each stage's weights, then each draft's, as one flat tensor in turn), whichever
                 is larger

Per-token bytes of a decoder layer, b = bytes of --dtype, Q = Hq D, KV = Hkv D, I intermediate (what autograd saves,
counted op by op from modeling/layers.py): each RMSNorm 12 H (fp32: its input, the normed x and the output) or 8 H
(bf16: the fp32 copy, the cast, the output), + its fp32 rsqrt; attention b (2 Q + 2 KV) + 4 Hq (q and k after RoPE, v,
the output; the fp32 lse: RoPE's products with cos / sin save only the tables, which need no gradient); SwiGLU
4 I b. Constants measured rather than counted (the storage tracker at V = 151936, tests/test_memory_plan.py) are
named *_BLOCKS below.

Letters: N stage parameters, n ranks sharing a stage's optimizer, B rollout rows, L KV-cache length, T tokens of a
micro-batch on one CP rank, V vocabulary, H hidden, P TTT passes.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from backends.fused_logprob import budget_rows
from modeling.kv_cache import BLOCK
from modeling.layers import CACHED_SCORES_MIB, CAST_BLOCK_MIB
from pipeline import REDUCE_BUCKET_MIB
from harness import drafters
from model import ModelConfig, Transformer
from parallel.pp_schedule import schedule_actions, split_layers

VERIFY_BLOCKS = 4  # fp32 (B, k+1, V) blocks live at the verification's peak (p, q, the residual), + one (B, V)
LOGIT_BLOCKS = 3  # fp32 (rows, V) blocks live in a streamed LM-head chunk (logits, softmax, its gradient)
HEAD_BLOCKS = (4, 1)  # fp32 (V, H) blocks in an fp32 update's backward: the policy's streamed head, + per trained draft


@dataclass
class Run:
    """What the plan reads besides the Config: the policy's shape, the mesh, the sequence lengths."""
    model: ModelConfig
    pp: int = 1
    cp: int = 1
    dp: int = 1
    seq: int = 0  # tokens per sequence in the update (prompt + response)
    prompt: int = 0  # the longest prompt of a rollout block (the KV cache's length is prompt + max_new_tokens + k + 1)
    dtype: str = "bf16"  # resolved: bf16 | fp32
    rollout_seq: float = 0  # mean tokens per sequence of a rollout block's reference forward (0: seq)
    tap_layers: tuple = ()  # the draft's taps; (): --tap_layers, or model.default_tap_layers
    gpu: bool = False  # a CUDA device: its context and NCCL's buffers count too (stated constants, below)


CUDA_CONTEXT_GIB = 1.0  # per process: the CUDA context (~0.5 GiB on Hopper with torch), cuBLAS / cuDNN workspaces and
# the caching allocator's slack. Stated, not measured here (no GPU): nvidia-smi's per-process figure checks it
NCCL_GIB_PER_GROUP = 1.0  # per NCCL communicator this rank belongs to: its buffers are NCCL_BUFFSIZE (4 MiB) per
# channel and peer and protocol, and NCCL opens more channels to reach NVLink's bandwidth. Public reports: ~1.6 GB on
# the first communicator after an all-reduce, ~2 GB each with 3 or more (https://github.com/NVIDIA/nccl/issues/864),
# 1.1 -> 4.3 GB for an all-to-all over 8 H100s (https://github.com/NVIDIA/nccl/issues/1685), memory linear in the
# channels (https://github.com/NVIDIA/nccl/issues/986); point-to-point communicators share one buffer per peer.
# Stated, not measured here


def nccl_groups(cfg, run: Run, stage: int = 0) -> int:
    """The NCCL communicators a rank of `stage` joins, as parallel/grid.py creates them: the world, and the groups of
    more than one rank it belongs to -- pipeline, TapChannel's pair communicators (the last stage's to each earlier
    stage, an earlier stage's to the last; its group's own is never made), the first and last stage's embedding
    group (tied heads only), CP, DP, and the DP x CP shard group where both are > 1 (else ZeRO-1 shards over the CP
    or the DP group)."""
    pp = run.pp > 1
    links = (run.pp - 1 if stage == run.pp - 1 else 1) if pp else 0
    embed = pp and run.model.tie_word_embeddings and stage in (0, run.pp - 1)
    return 1 + pp + links + embed + (run.cp > 1) + (run.dp > 1) + (run.cp > 1 and run.dp > 1)


def family_of(cfg):
    """The class of the run's draft family (--drafter; a config without one: drafters.DEFAULT's): it states its
    default taps, its draft's shape, its KV cache and what it saves for backward (drafter.FAMILY)."""
    return drafters.family(getattr(cfg, "drafter", drafters.DEFAULT)).cls


def taps_of(cfg, run: Run) -> tuple:
    """The policy layers the drafts read (the embedding tap aside): --tap_layers, else the family's default rule."""
    return tuple(run.tap_layers or cfg.tap_layers or family_of(cfg).default_taps(run.model.num_hidden_layers, cfg))


def held_copies(cfg) -> dict:
    """THE rule for which full copies a rank keeps, as harness/experiment.build_models makes them: name -> (kind,
    where it is trained: "last" stage, "rank0", or None). One place to align when the build's rules change: the
    reference only when used (Config.needs_ref), each control arm by its flag (Config.arm), no draft with --no_spec.
    The policy copy is the rollout engine's; the stage's own layers are its parameters (dist_step.stage_of)."""
    out = {"policy": ("policy", None)}
    if cfg.needs_ref:
        out["reference"] = ("policy", None)
    if not cfg.no_spec:
        out["cotrained"] = ("draft", "last")
        out.update({arm: ("draft", where) for arm, where in (("frozen", None), ("cold", "last"), ("offline", "rank0"))
                    if cfg.arm(arm)})
    return out


def draft_tokens(cfg) -> int:
    """k of a rollout's verification (the ceiling under --num_draft_tokens=auto)."""
    return cfg.max_draft_tokens if cfg.num_draft_tokens == "auto" else int(cfg.num_draft_tokens)


def _numel(module) -> tuple:
    """(trainable parameters, bytes of buffers) of a module built on the meta device."""
    return (sum(p.numel() for p in module.parameters()),
            sum(b.numel() * b.element_size() for n, b in module.named_buffers()
                if n not in ("embed_weight", "head_weight")))  # the policy's, shared (drafter.py: attach)


_NUMEL: dict = {}  # (the model's repr, layers) -> parameters: building 36 layers on meta takes ~0.1 s


def stage_numel(m: ModelConfig, layers: tuple) -> int:
    """Parameters of the stage slice holding `layers` (built on the meta device: nothing allocated)."""
    key = (repr(m), tuple(layers))
    if key not in _NUMEL:
        with torch.device("meta"):
            _NUMEL[key] = _numel(Transformer(m, layers=layers))[0]
    return _NUMEL[key]


def draft_numel(m: ModelConfig, cfg, taps: tuple) -> tuple:
    """(parameters, buffer bytes) of one draft arm of this policy, of the run's family (--drafter), built on the meta
    device as its class's of_shape shapes it (EAGLE-3: --draft_vocab; the block families: --draft_layers,
    --block_size, --markov_rank: DSpark's Markov head is two (V, r) tables)."""
    cls = family_of(cfg)
    key = (repr(m), cls.__name__, taps, cfg.draft_vocab, getattr(cfg, "draft_layers", 0),
           getattr(cfg, "markov_rank", 0), getattr(cfg, "block_slots", 0))
    if key in _NUMEL:
        return _NUMEL[key]
    with torch.device("meta"):
        out = _numel(cls.of_shape(m, cfg, taps))
    _NUMEL[key] = out
    return out


def in_flight(schedule: str, pp: int, stage: int, M: int) -> int:
    """The most micro-batches whose activations stage `stage` holds at once (its F's not yet matched by a B)."""
    live = most = 0
    for kind, _ in schedule_actions(schedule, pp, stage, M):
        live += 1 if kind == "F" else -1
        most = max(most, live)
    return most


def norm_bytes(H: int, b: int) -> int:  # per token, what one RMSNorm saves (module docstring)
    return (12 * H if b == 4 else 8 * H) + 4  # + the fp32 rsqrt


def layer_bytes(m: ModelConfig, b: int, qk_norm: bool = None) -> int:
    """Per token: what one decoder layer saves for backward."""
    Q, KV, I = m.num_attention_heads * m.head_dim, m.num_key_value_heads * m.head_dim, m.intermediate_size
    qk = ((8 if b == 4 else 6) * (Q + KV) + 4 * (m.num_attention_heads + m.num_key_value_heads)
          if (m.qk_norm if qk_norm is None else qk_norm) else 0)
    return 2 * norm_bytes(m.hidden_size, b) + b * (2 * Q + 2 * KV) + 4 * m.num_attention_heads + qk + 4 * I * b


def draft_pass_bytes(m: ModelConfig, b: int) -> int:
    """Per token and TTT pass: the draft layer (norms on e and h, the 2H concat, attention, post norm, SwiGLU), its
    final norm and the streamed loss's three fp32 normalisers."""
    H, Q, KV = m.hidden_size, m.num_attention_heads * m.head_dim, m.num_key_value_heads * m.head_dim
    return (4 * norm_bytes(H, b) + 2 * H * b + b * (2 * Q + 2 * KV) + 4 * m.num_attention_heads
            + 4 * m.intermediate_size * b + 12)


def head_bytes(m: ModelConfig, b: int, trained: int, gpu: bool) -> int:
    """The (V, H)-sized transients of the update's backward on the last stage. fp32: HEAD_BLOCKS fp32 blocks (the
    policy's streamed head, + per trained draft). bf16: none of the heads' own -- dW adds into the fp32 .main_grad
    chunk by chunk (backends/fused_logprob.WeightGrad) -- but a tied head's embedding forms its bf16 gradient (2 V H)
    and, without CUDA's fp32-output GEMM (the CPU), one fp32 cast block of W (modeling/layers.CAST_BLOCK_MIB) lives
    while a chunk runs: the larger of the two (measured at V = 151936)."""
    VH = m.vocab_size * m.hidden_size
    if b == 4:
        return (HEAD_BLOCKS[0] + HEAD_BLOCKS[1] * trained) * VH * 4
    return max(2 * VH * m.tie_word_embeddings, 0 if gpu else min(int(CAST_BLOCK_MIB * 2**20), 4 * VH))  # not at once


@dataclass
class Sizes:
    """Per-token bytes of the pieces a draft family's act_bytes adds up (drafter.FAMILY): the model's shape m and
    the bytes per element b; H, norm (one RMSNorm over H), draft_pass (an EAGLE-3-shaped layer's TTT pass) and
    layer(qk_norm) (a decoder layer of the policy's shape)."""
    m: ModelConfig
    b: int

    @property
    def H(self) -> int:
        return self.m.hidden_size

    @property
    def norm(self) -> int:
        return norm_bytes(self.m.hidden_size, self.b)

    @property
    def draft_pass(self) -> int:
        return draft_pass_bytes(self.m, self.b)

    def layer(self, qk_norm: bool = None) -> int:
        return layer_bytes(self.m, self.b, qk_norm=qk_norm)


def draft_act_bytes(cfg, run: Run, T: float, b: int) -> float:
    """What one trained draft saves for backward over a micro-batch of T tokens on one CP rank, as its family's
    act_bytes counts it (Sizes: the pieces; the sequences per CP rank, for the families that train per anchor).
      EAGLE-3   T (P draft_pass_bytes + (taps + 1) H b): every position, each of the P TTT passes, and the taps
      blocks    T (taps H b + 2 norm(H) + L_d 4 KV b): fc's concatenated taps, the context and its norms, each draft
                layer's injected K / V; + N W (L_d layer_bytes + norm(H) + 12): the N anchors' W-slot blocks
                through the L_d layers (q / k RMS-normed), the final norm and the streamed loss's normalisers per
                slot. N: --anchors per sequence of the micro-batch, spread over the CP ranks by position."""
    seqs = cfg.prompts_per_step * cfg.group_size / cfg.updates / cfg.micro_batches / run.cp  # per CP rank
    return family_of(cfg).act_bytes(Sizes(run.model, b), cfg, T, len(taps_of(cfg, run)), seqs)


def micro_batch(cfg, run: Run) -> tuple:
    """(T tokens of one micro-batch on one CP rank, micro-batches per DP rank): sequences padded to 2 cp under CP
    (and to even lengths at cp = 1: the ring of one)."""
    seqs = cfg.prompts_per_step * cfg.group_size / cfg.updates / cfg.micro_batches
    pad = 2 * run.cp
    return seqs * math.ceil(run.seq / pad) * pad / run.cp, max(1, cfg.micro_batches // run.dp)


def optimizer_parts(N: int, n: int, b: int) -> dict:
    """weights / grads / optimizer bytes of N parameters whose optimizer is sharded n ways (n = 1: not sharded)."""
    per = math.ceil(N / n)
    if b == 2:  # bf16: flat working copy, fp32 main_grad, fp32 master slice + m, v
        return {"weights": 2 * n * per, "grads": 4 * N, "optimizer": 12 * per}
    if n == 1:
        return {"weights": 4 * N, "grads": 4 * N, "optimizer": 8 * N}
    return {"weights": 4 * n * per, "grads": 4 * N, "optimizer": 12 * per}


def persistent(cfg, run: Run, stage: int, rank0: bool) -> dict:
    """Bytes held between steps by a rank of `stage` (rank0: global rank 0, which also trains the offline arm)."""
    m, b = run.model, 2 if run.dtype == "bf16" else 4
    split = split_layers(m.num_hidden_layers, run.pp)
    n = run.dp * run.cp if cfg.zero1 is True else 1  # ("auto": resolve_zero1 first)
    out = optimizer_parts(stage_numel(m, split[stage]), n, b)
    full, (Nd, dbuf) = stage_numel(m, (0, m.num_hidden_layers)), draft_numel(m, cfg, taps_of(cfg, run))
    last = stage == run.pp - 1
    own = stage_numel(m, split[stage]) - (m.vocab_size * m.hidden_size if last and run.pp > 1 and
                                          m.tie_word_embeddings else 0)  # the tied embedding's copy: not aliased
    optim = 0
    for name, (kind, where) in held_copies(cfg).items():
        size = (full - own if name == "policy" else full) if kind == "policy" else Nd  # the stage IS the policy's
        out[f"copy:{name}"] = size * b + (dbuf if kind == "draft" else 0)
        trained = (where == "last" and last) or (where == "rank0" and rank0)
        if trained:  # only where trained: grads (bf16: fp32 main_grad) and m, v, + bf16's fp32 master
            optim += (16 if b == 2 else 12) * Nd
    out["draft_optim"] = optim
    T, _ = micro_batch(cfg, run)
    taps = taps_of(cfg, run) + (-1,)
    remote = [t for t in taps if t < split[-1][0]]  # produced on an earlier stage (the embedding tap on stage 0)
    out["tap_slots"] = int(len(remote) * T * m.hidden_size * b) if last and run.pp > 1 and not cfg.no_spec else 0
    return out


def kv_slots(prompt: int, max_new_tokens: int, longest_new: int = None, k: int = 0) -> int:
    """Slots per row a KV cache holds at its largest (modeling/kv_cache.KVCache grows in blocks of kv_cache.BLOCK up
    to max_len = prompt + max_new_tokens + k + 1): the longest row's prompt + response (longest_new; None: the budget,
    the worst case) + the k + 1 entries of a verification, rounded up to a block."""
    max_len = prompt + max_new_tokens + k + 1
    need = prompt + (max_new_tokens if longest_new is None else longest_new) + k + 1
    return min(max_len, -(-need // BLOCK) * BLOCK)


def rollout_transient(cfg, run: Run, max_new_tokens: int, longest_new: int = None) -> dict:
    """The rollout phase's components: the generate call's KV caches and vocabulary-sized working set, the prefill's
    and the reference forward's working sets (max_new_tokens: the response budget; longest_new: the longest response
    a block generates, None: the budget)."""
    m, b = run.model, 2 if run.dtype == "bf16" else 4
    k = 0 if cfg.no_spec else draft_tokens(cfg)
    rows = cfg.prompts_per_step * cfg.group_size
    B = min(cfg.rollout_batch, rows)
    L = kv_slots(run.prompt, max_new_tokens, longest_new, k)
    per_layer = 2 * B * m.num_key_value_heads * L * m.head_dim * b
    Ld, W = (0, 0) if cfg.no_spec else family_of(cfg).cache_shape(cfg)  # the draft's cache (its family's): EAGLE-3's
    # one layer; a block family's L_d layers, with room for its block of W
    kv = per_layer * m.num_hidden_layers + Ld * 2 * B * m.num_key_value_heads * m.head_dim * b * kv_slots(
        run.prompt + W, max_new_tokens, longest_new, k)  # L_d layers, with room for its block (+ W)
    verify = (VERIFY_BLOCKS * (k + 1) + 1) * B * m.vocab_size * 4
    Q, KV, I, H = (m.num_attention_heads * m.head_dim, m.num_key_value_heads * m.head_dim, m.intermediate_size,
                   m.hidden_size)
    work = (2 * H + Q + 2 * KV + 3 * I) * b  # per token, a no-grad layer's live tensors at once
    T = B * (run.rollout_seq or run.seq)  # the reference forward's tokens: rollout_batch sequences at once
    ref = (T * work + LOGIT_BLOCKS * min(T, _rows(cfg, m)) * m.vocab_size * 4) if cfg.needs_ref else 0  # held?
    prefill = prefill_bytes(m, B, run.prompt, 0 if cfg.no_spec else len(taps_of(cfg, run)), b)
    return {"kv_cache": kv, "verify_logits": verify, "prefill": prefill, "reference_forward": ref}


def prefill_bytes(m: ModelConfig, B: int, P: int, taps: int, b: int) -> int:
    """The peak a generate call's prefill adds over its KV caches: B prompts of P tokens (tests/test_memory_plan.py
    checks it against speculative.prefill's allocations).
      per token   the taps (held while the draft's trunk runs over them; 0 without a draft) + a no-grad layer's live
                  tensors (2 H + Q + 2 KV + 3 I; with taps the residual stream's 4 H)
      attention   one block of query rows of modeling.layers.cached_attention (rows n from its scores budget): its
                  (B, G n, Lk) mask as bool and as the float bias the SDPA kernels take, (1 + b) B G n P bytes. With
                  the old dense-mask path this term was (B, Hq, P, P) fp32 scores: O(P^2).
    """
    Q, KV, I, H = m.num_attention_heads * m.head_dim, m.num_key_value_heads * m.head_dim, m.intermediate_size, \
        m.hidden_size
    per_token = (taps * H + 4 * H + Q + 2 * KV + 3 * I) if taps else (2 * H + Q + 2 * KV + 3 * I)
    G = m.num_attention_heads // m.num_key_value_heads
    n = min(P, max(1, int(CACHED_SCORES_MIB * 2**20) // (4 * B * m.num_attention_heads * max(P, 1))))
    return B * P * per_token * b + (1 + b) * B * G * n * P


def _rows(cfg, m: ModelConfig) -> int:
    return budget_rows(m.vocab_size, cfg.chunk_mib) or 1 << 62  # 0: unfused, the whole (T, V)


def update_transient(cfg, run: Run, stage: int) -> dict:
    """The update phase's components on a rank of `stage`."""
    m, b = run.model, 2 if run.dtype == "bf16" else 4
    split = split_layers(m.num_hidden_layers, run.pp)
    a, z = split[stage]
    T, M = micro_batch(cfg, run)
    live = in_flight(cfg.schedule, run.pp, stage, M)
    last, H = stage == run.pp - 1, m.hidden_size
    per_tok = (z - a) * layer_bytes(m, b) + 2 * m.head_dim * b + (norm_bytes(H, b) if last else 0)
    if cfg.activation_checkpointing:
        acts = live * T * ((z - a) * H * b + 2 * m.head_dim * b) + T * layer_bytes(m, b)
    else:
        acts = live * T * per_tok
    trained = sum(1 for kind, where in held_copies(cfg).values() if where == "last")
    dacts = trained * draft_act_bytes(cfg, run, T, b) if last else 0
    rows = min(T, _rows(cfg, m))
    logits = LOGIT_BLOCKS * rows * m.vocab_size * 4 if last else 0
    heads = head_bytes(m, b, trained, run.gpu) if last else 0
    KV = m.num_key_value_heads * m.head_dim
    n = run.dp * run.cp if cfg.zero1 is True else 1  # ("auto": resolve_zero1 first)
    comm = (2 * T * H * b * (0 < stage or not last)  # p2p: the received activation and gradient
            + (4 * T * KV * b if run.cp > 1 else 0))  # ring: K and V, in flight and arriving
    big = max(m.intermediate_size, m.vocab_size if stage == 0 or last else 0) * H  # the stage's largest tensor
    opt_step = step_bytes(stage_numel(m, (a, z)), big, n, b, run.gpu)
    if last and trained:  # then each trained draft's optimizer, one after another (plain AdamW, or fp32 masters)
        dv = cfg.draft_vocab or m.vocab_size
        opt_step = max(opt_step, step_bytes(draft_numel(m, cfg, taps_of(cfg, run))[0],
                                            max(dv, m.intermediate_size, 3 * H) * H, 1, b, run.gpu))
    refit = max([stage_numel(m, r) for r in split] + [draft_numel(m, cfg, taps_of(cfg, run))[0]]) * b
    grads = stage_numel(m, (a, z)) * 4  # fp32 (.main_grad under bf16)
    reduce = min(grads, int(REDUCE_BUCKET_MIB * 2**20)) if run.cp * run.dp > 1 else 0  # pipeline.grad_buckets
    return {"activations": int(acts), "draft_activations": int(dacts), "logits_chunks": int(logits),
            "head_buffers": int(heads), "comm_buffers": int(comm), "refit_bucket": int(refit),
            "reduce_bucket": int(reduce), "optimizer_step": int(opt_step)}


def step_bytes(N: int, largest: int, n: int, b: int, gpu: bool) -> int:
    """The transient peak of one optimizer step over N parameters (largest: the elements of the biggest tensor) whose
    state is sharded n ways; it runs after the backward, whose transients are gone.
      ShardedOptimizer (bf16 masters, or --zero1: parallel/zero1.py): the fp32 gradient slice it assembles (4 per;
        under --zero1 over several ranks the reduce_scatter's slice, held from the backward to the step),
        AdamW's temporary over the slice (sqrt(v), 4 per, with foreach: CUDA's default; the CPU's single-tensor loop
        holds sqrt(v) and its quotient at once, 8 per) and, for n > 1, the all_gather: the slice cast to the weights'
        dtype (b per, bf16 only) and the flat output torch's ProcessGroup allocates for a list of outputs and copies
        out of (b n per);
      a plain fp32 AdamW (n = 1): its foreach temporary over every parameter (4 N) on CUDA, two temporaries of the
        largest tensor (8 largest) in the CPU's loop."""
    temp = 4 if gpu else 8
    if b == 2 or n > 1:
        per = math.ceil(N / n)
        gather = (b * per * (b == 2) + b * n * per) if n > 1 else 0
        return 4 * per + temp * per + gather
    return 4 * N if gpu else 8 * largest


def rank_plan(cfg, run: Run, stage: int, rank0: bool = False, max_new_tokens: int = None,
              longest_new: int = None) -> dict:
    """Every component of a rank of `stage`, the two phases' peaks and the total (persistent + the larger phase).
    longest_new: the longest response a rollout block generates (None: the budget, the worst case)."""
    out = persistent(cfg, run, stage, rank0)
    new = max_new_tokens if max_new_tokens is not None else cfg.max_new_tokens or max(run.seq - run.prompt, 0)
    roll, upd = rollout_transient(cfg, run, new, longest_new), update_transient(cfg, run, stage)
    out.update(roll)
    out.update(upd)
    out["rollout_peak"] = max(roll["kv_cache"] + roll["verify_logits"] + roll["prefill"], roll["reference_forward"])
    apart = ("refit_bucket", "reduce_bucket", "optimizer_step")  # after the backward, one at a time: the other
    # transients are gone
    out["update_peak"] = max([sum(v for k, v in upd.items() if k not in apart)] + [upd[k] for k in apart])
    if run.gpu:
        out["cuda_context"] = int(CUDA_CONTEXT_GIB * 2**30)
        out["nccl_buffers"] = int(NCCL_GIB_PER_GROUP * 2**30) * nccl_groups(cfg, run, stage) \
            if run.pp * run.cp * run.dp > 1 else 0
    keep = [k for k in out if k not in roll and k not in upd and not k.endswith("_peak")]
    out["persistent"] = sum(out[k] for k in keep)
    out["total"] = out["persistent"] + max(out["rollout_peak"], out["update_peak"])
    return out


def resolve_zero1(cfg, model: ModelConfig, grid, device, max_new_tokens: int, device_bytes: int = None) -> bool:
    """--zero1 as the run applies it: true / false as given; "auto": on where the plan's largest rank WITHOUT it
    exceeds the device's memory (device_bytes; None: the CUDA device's total) -- on CUDA only, and only where the
    stage has dp * cp > 1 ranks to shard over; off on the CPU. The plan's sequence: --max_prompt_tokens +
    max_new_tokens (the task's response budget)."""
    if cfg.zero1 != "auto":
        return bool(cfg.zero1)
    if torch.device(device).type != "cuda" or grid.dp * grid.cp == 1:
        return False
    if device_bytes is None:
        device_bytes = torch.cuda.get_device_properties(device).total_memory
    from dataclasses import replace
    plain = replace(cfg, zero1=False)
    run = Run(model, pp=grid.pp, cp=grid.cp, dp=grid.dp, seq=cfg.max_prompt_tokens + max_new_tokens,
              prompt=cfg.max_prompt_tokens, dtype="fp32" if cfg.dtype == "fp32" else "bf16", gpu=True)
    worst = max(rank_plan(plain, run, s, rank0=s == 0, max_new_tokens=max_new_tokens)["total"]
                for s in range(grid.pp))
    return worst > device_bytes
