"""Warm-up before RL: SFT of the policy on demonstrations, then the draft on the warm policy's own samples.

  1. Policy SFT: next-token cross-entropy on the response tokens of the task's demonstrations (tsk.encode_demo,
     tasks/protocol.py; the built-in task writes each chain step explicitly with probability p_explicit), AdamW with
     linear warm-up and cosine decay. Cheap to reuse, so the result is cached on disk (HF format,
     `cache/policy-<key>/`) and later runs load it. A task without demonstrations gets no SFT: the policy is its
     seeded random initialisation.
  2. Draft warm-up (EAGLE-3's offline stage): sample responses from the warm policy (temperature 1), run the policy's
     packed forward to get taps and its final hidden, and fit the draft's multi-pass TTT loss with the policy as
     teacher. Also cached (`cache/draft-<key>/`, draft.py's save/load), keyed on the policy's key too.
Both train through the RL update's streamed losses: the LM head is applied --chunk_mib of logits at a time, so no
(tokens, V) tensor forms (fused_logprob.py, draft_loss.py); sampling runs --rollout_batch prompts per generate call,
prompt i from its own random stream. Both compute in the run's --dtype (bf16: fp32 master weights), which is in the
key. Under torchrun on GPUs every rank calls them at once (group=): the samples and each step's work split over the
ranks, the same result as one process (warmup_split.py), and rank 0 alone writes the cache.

Each warm-up reads its settings from one spec (cache_keys.PolicySpec / DraftSpec) and nothing else that shapes it; the
key is the hash of the whole spec and of the warm-up's source code (cache_keys.py says which).

An entry is complete once its config.json is there (written last, each file atomically). It is written under
`<entry>.tmp<pid>` and renamed into place (publish): an incomplete entry there (an interrupted copy) is replaced, a
complete one (a concurrent run finished first) is kept, and the temporary never stays behind, not even after a kill
(the next run deletes those of processes that are gone). A cached entry that cannot be read, or holds NaN/inf
weights, is a one-line error naming the file.

    python -m harness.warmup                   # SFT (or load) the default policy, then its draft (none with
                                               # --no_spec or --draft); report the policy's held-out greedy /
                                               # sampled reward
    python -m harness.warmup --preset smoke    # any train.py preset / --key=value: the same cache entries as train.py
    python -m harness.warmup --model DIR --data prompts.jsonl ...   # HF mode: the checkpoint as is, its draft
                                               # warm-up pre-built on this machine's GPU before a torchrun start

Letters: T packed tokens, S sequences, V vocab.
"""
from __future__ import annotations

import glob
import math
import os
import random
import re
import shutil
import sys
import time

import torch

import speculative
from tasks.protocol import Demonstrations, task_from_config
from harness.cache_keys import (DraftSpec, PolicySpec, code_record, hf_policy_key, run_dtype, stale_line,
                                write_record)
from harness import drafters
from serving.export import pid_alive
from serving.hf_io import from_pretrained, read_json, save_pretrained
from serving.draft_vocab import select_draft_vocab
from model import Transformer
from backends.attention_padded import auto_causal_attention
from backends.fused_logprob import DEFAULT_CHUNK_MIB, budget_rows
from parallel.cli import writing
from rl_loop import RolloutBatch, check_finite_weights, draft_loss, micro_chunks, pack, packed_logp
from decoding.row_streams import RowStreams, row_keys
from harness.warmup_split import MasterOptimizer, agree, gather_blocks, micro_count, mine, rank_world


HINT = "stopping, nothing cached. Try a lower --sft_lr / --draft_warmup_lr"


def lr_at(step: int, steps: int, lr: float, warmup: int) -> float:
    """Linear warm-up for `warmup` steps, then cosine decay to lr/10."""
    if step < warmup:
        return lr * (step + 1) / warmup
    t = (step - warmup) / max(steps - warmup, 1)
    return lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * t)))


def sft_batch(tsk: Demonstrations, n: int, rng: random.Random, pick=None):
    """n demonstrations of the train split, drawn (and encoded) in full on every rank so that `rng` advances the same,
    of which those `pick` names (default all) are packed: tokens (T,), cu_seqlens (S+1,), loss mask (T,) = response
    tokens (incl. <eos>) -- None, None, None when pick is empty -- and the count of loss tokens of all n (the SFT
    loss's denominator)."""
    seqs, masks = [], []
    for p in tsk.sample(n, rng, "train"):
        x, n_prompt = tsk.encode_demo(p, rng)
        seqs.append(x)
        m = torch.zeros(x.numel(), dtype=torch.bool)
        m[n_prompt:] = True
        masks.append(m)
    total = sum(int(m.sum()) for m in masks)
    pick = range(n) if pick is None else pick
    if not len(pick):
        return None, None, None, total
    tokens, cu = pack([seqs[i] for i in pick])
    return tokens, cu, torch.cat([masks[i] for i in pick]), total


def sft_policy(policy: Transformer, tsk: Demonstrations, *, steps: int, batch: int, lr: float, seed: int,
               log_every: int = 0, chunk_mib: float = DEFAULT_CHUNK_MIB, group=None, dtype=torch.float32) -> list:
    """Supervised warm-up in place, computing in `dtype` (16-bit: fp32 master weights, warmup_split.MasterOptimizer;
    the policy is cast to it). Returns the loss per step. The log-probs come from the final hidden through the LM head
    chunk_mib MiB of logits at a time (rl_loop.packed_logp; 0: (T, V) logits), like the RL update's. group: the
    ranks that share the work (warmup_split.py: rank r takes sequences r, r + n, ... of each batch); None: one
    process."""
    rng = random.Random(seed)
    chunk = budget_rows(policy.cfg.vocab_size, chunk_mib)
    opt = MasterOptimizer(policy.parameters(), lambda ps: torch.optim.AdamW(ps, lr=lr, weight_decay=0.0,
                                                                            betas=(0.9, 0.98)), dtype)
    policy.to(dtype)
    losses, t0 = [], time.time()
    dev = next(policy.parameters()).device
    policy.train()
    for step in range(steps):
        for g in opt.param_groups:
            g["lr"] = lr_at(step, steps, lr, warmup=max(steps // 20, 1))
        tokens, cu, mask, total = sft_batch(tsk, batch, rng, mine(batch, group))
        lsum = torch.zeros((), device=dev)  # sum over this rank's tokens of -log p * mask
        if tokens is not None:
            tokens, cu, mask = tokens.to(dev), cu.to(dev), mask.to(dev)
            out = policy(tokens, cu, attn_fn=auto_causal_attention, logits=chunk == 0)  # hidden (T, H)
            lsum = -(packed_logp(out, policy.head_weight, tokens, cu, chunk=chunk).float() * mask).sum()
            (lsum / total).backward()
            opt.accumulate()
        loss = opt.sum_grads(lsum.detach().reshape(1), group).item() / total  # the whole batch's mean
        if not math.isfinite(loss):
            raise FloatingPointError(f"SFT warm-up step {step}: loss = {loss} (not finite); {HINT}")
        opt.step(1.0)
        losses.append(loss)
        if log_every and (step % log_every == 0 or step == steps - 1):
            print(f"  sft step {step:4d}/{steps}  loss {loss:.4f}  {time.time() - t0:5.1f}s", flush=True)
    check_finite_weights(policy, f"SFT warm-up, after {steps} steps, the policy", HINT)  # never cache a diverged one
    return losses


def warm_policy(spec: PolicySpec, *, cache_dir: str = "cache", log_every: int = 0, device=None,
                chunk_mib: float = DEFAULT_CHUNK_MIB, group=None) -> tuple[Transformer, str, bool]:
    """The SFT'd policy on `device` (default CPU) in spec.dtype, from `cache_dir` when an identical warm-up was run
    before; a task without demonstrations (no encode_demo): the seeded random initialisation, nothing cached.
    Returns (policy, key, loaded). Everything that shapes it comes from `spec` (its key: spec.key()); the device,
    chunk_mib (the log-probs' chunk) and group (the ranks that share the work, warmup_split.py; None: one process) do
    not: they change rounding only, and a CPU-trained policy serves a GPU run. Under a group every rank calls this:
    a hit needs the entry on every rank, a miss trains on all of them and rank 0 alone writes the entry."""
    key, dt = spec.key(), getattr(torch, spec.dtype)
    if not isinstance(spec.task, Demonstrations):
        torch.manual_seed(spec.seed)
        return Transformer(spec.model).to(device=device, dtype=dt), key, False
    path = os.path.join(cache_dir, f"policy-{key}")
    main = rank_world(group)[0] == 0
    if main:
        clean_stale(path)
    if agree(complete(path), group):  # names the file of any unreadable or non-finite weight
        return from_pretrained(path, dtype=dt, device=device), key, True
    if main:
        missed(path, "policy SFT warm-up", "policy", spec)
    torch.manual_seed(spec.seed)
    policy = Transformer(spec.model).to(device)  # initialised on the CPU: the same weights on every device
    sft_policy(policy, spec.task, steps=spec.steps, batch=spec.batch, lr=spec.lr, seed=spec.seed,
               log_every=log_every if main else 0, chunk_mib=chunk_mib, group=group, dtype=dt)
    policy.zero_grad(set_to_none=True)
    if main:  # the others hold the same weights (the same summed gradients, the same steps)
        publish(path, lambda tmp: save_pretrained(policy, tmp), code_record("policy", spec, cache_dir))
    return policy, key, False


def complete(path: str) -> bool:
    """A cache entry is complete once its config.json is there (each file lands atomically, config.json last)."""
    return os.path.isfile(os.path.join(path, "config.json"))


def clean_stale(path: str):
    """Delete `path`.tmp<pid> / .old<pid> left by processes that are gone (killed mid-save)."""
    for p in glob.glob(f"{glob.escape(path)}.*"):
        m = re.fullmatch(rf"{re.escape(path)}\.(?:tmp|old)(\d+)", p)
        if m and not pid_alive(int(m[1])):
            shutil.rmtree(p, ignore_errors=True)


def missed(path: str, label: str, kind: str, spec):
    """A cache miss: print one line naming the source files changed since an entry of the same settings, if any."""
    line = stale_line(label, kind, spec, os.path.dirname(path))
    if line:
        print(line, flush=True)


def publish(path: str, save, record: dict | None = None):
    """save(tmp) into `path`.tmp<pid> (with `record`, cache_keys.code_record, beside it), then into place: an
    incomplete entry at `path` is replaced (renamed away first), a complete one (a concurrent run's) kept. The
    temporary is deleted whatever happens."""
    tmp, old = f"{path}.tmp{os.getpid()}", f"{path}.old{os.getpid()}"
    try:
        with writing(path):  # a full disk: one error naming the entry (safetensors' SafetensorError too)
            save(tmp)
            if record is not None:
                write_record(tmp, record)
        if os.path.isdir(path) and not complete(path):
            os.replace(path, old)
            shutil.rmtree(old)
        try:
            os.replace(tmp, path)
        except OSError:  # a complete entry landed meanwhile (a concurrent run): theirs is as good
            if not complete(path):
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def load_draft(path: str, policy):
    """A cached draft (its family's save format, drafter.py); anything unreadable or non-finite is a ValueError naming
    the file."""
    cfg_path, st = os.path.join(path, "config.json"), os.path.join(path, "model.safetensors")
    cls = drafters.architecture(path)
    extra = sorted(set(read_json(cfg_path)) - drafters.config_fields(cls) - {"architectures"})
    if extra:
        raise ValueError(f"{cfg_path}: unknown key(s) {extra} (a cached draft holds its config's fields); delete "
                         f"{path} to retrain it")
    try:
        draft = cls.load(path, policy)
    except Exception as e:  # noqa: BLE001 -- SafetensorError, a missing or misshapen tensor, a bad config value
        why = " ".join(f"{type(e).__name__}: {e}".split())[:300]
        raise ValueError(f"{st}: unreadable cached draft ({why}); truncated or not this draft? Delete {path} to "
                         "retrain it") from None
    bad = [n for n, p in draft.named_parameters() if not bool(torch.isfinite(p).all())]
    if bad:
        raise ValueError(f"{st}: the weights are not finite ({bad[0]}); delete {path} to retrain it")
    return draft


def draft_spec(cfg, tsk, policy_key: str, device=None) -> DraftSpec:
    """What a run's draft warm-up reads (train.py and this module's command alike): the config's draft_warmup_*
    settings, the task, the policy's key, the attention kernels (the draft's: its family's, drafters.py), the dtype
    (--dtype; "auto" by `device`)."""
    return DraftSpec.from_config(cfg, tsk, policy_key, attn_fn=auto_causal_attention,
                                 draft_attn_fn=drafters.family(cfg.drafter).attn_fn, device=device)


def warm_draft(policy: Transformer, spec: DraftSpec, *, cache_dir: str = "cache", log_every: int = 0,
               chunk_mib: float = DEFAULT_CHUNK_MIB, group=None) -> tuple:
    """A draft fitted offline to the warm policy's own samples (cached). Returns (draft, loaded).
    policy: the model spec.policy_key names, in spec.dtype (the draft computes in it: 16-bit with fp32 masters).
    Everything else that shapes the draft comes from `spec` (its key: spec.key()): the task (its train prompts and
    EOS), steps (0: an untrained draft), draft_vocab = N > 0 (the draft names only the N most frequent target tokens
    of the sampled responses, draft_vocab.py), tap_layers (the policy layers it reads; (): the family's default
    rule), pass_weight (w_d = pass_weight^(d-1) in the TTT loss), drafter and drafter_opts (the family,
    harness/drafters.py, and its options), ...
    chunk_mib (rounding only, not in the key): the streamed loss's chunk, its teacher's logits formed from the policy's
    final hidden chunk by chunk (0: the policy's (T, V) logits as the teacher). group: the ranks that share the work
    (warmup_split.py; None: one process), rounding only.

    1. sample `pool` responses from the policy (plain sampling at temperature 1: the distribution RL starts from),
       spec.rows prompts per generate call, prompt i from its own stream (blocks spread over the group's ranks);
    2. each step: `batch` of them in M micro-batches (warmup_split.micro_count), each: policy forward (no grad) for
       taps + final hidden -> the draft's loss (TTT for EAGLE-3), streamed; the step's loss is their mean -> AdamW."""
    tsk, steps, pool, seed, draft_vocab = spec.task, spec.steps, spec.pool, spec.seed, spec.draft_vocab
    taps = spec.tap_layers or None  # None: the default rule
    opts = dict(spec.drafter_opts)
    if steps == 0 and draft_vocab == 0:
        torch.manual_seed(seed)
        return drafters.build_draft(spec.drafter, policy, opts, tap_layers=taps), False
    path = os.path.join(cache_dir, f"draft-{spec.key()}")
    main = rank_world(group)[0] == 0
    if main:
        clean_stale(path)
    if agree(complete(path), group):  # also at steps 0 with a reduced vocabulary: its sampled responses are the cost
        return load_draft(path, policy), True
    if main:
        missed(path, "draft warm-up", "draft", spec)
    record = code_record("draft", spec, cache_dir)
    dev = next(policy.parameters()).device
    rng = random.Random(seed + 1)
    prompts = [tsk.encode_prompt(p) for p in tsk.sample(pool, rng, "train")]
    keys = row_keys(seed + 1, torch.arange(pool))  # (pool,) prompt i's own stream: the same pool on any mesh

    def sample(items: range) -> list:
        return [r.cpu() for r in speculative.generate(
            policy, None, prompts[items.start: items.stop], max_new_tokens=spec.max_new_tokens, temperature=1.0,
            eos_id=tsk.tok.eos_ids, generator=RowStreams(keys[items.start: items.stop].to(dev))).tokens]
    responses = gather_blocks(pool, spec.rows, sample, group)
    torch.manual_seed(seed)
    ids = select_draft_vocab(responses, policy.cfg.vocab_size, draft_vocab) if draft_vocab else None
    draft = drafters.build_draft(spec.drafter, policy, opts, tap_layers=taps, draft_vocab=ids)
    if steps:
        fit_draft(policy, draft, spec, prompts, responses, rng, group=group, log_every=log_every if main else 0,
                  chunk_mib=chunk_mib)
    if main:  # steps 0: untrained, but its reduced vocabulary came from `pool` samples: cached like a trained one
        publish(path, draft.save, record)
    return draft, False


def fit_draft(policy, draft, spec: DraftSpec, prompts, responses, rng, *, group, log_every, chunk_mib):
    """The draft's offline fit (warm_draft's step 2), in place, the policy's dtype: fp32 masters if 16-bit."""
    steps, batch, lr = spec.steps, spec.batch, spec.lr
    dt = next(policy.parameters()).dtype
    opt = MasterOptimizer(draft.parameters(), lambda ps: torch.optim.AdamW(ps, lr=lr, weight_decay=0.0), dt)
    draft.to(dt).attach(policy)  # its working copy computes in the policy's dtype; the embedding stays shared
    tr = drafters.make_trainer(spec.drafter, draft, opt, dict(spec.drafter_opts), num_passes=spec.num_passes,
                               pass_weight=spec.pass_weight)
    tr.attn_fn = spec.draft_attn_fn  # the spec's: its family's single-process training attention (draft_spec)
    t0, chunk, dev = time.time(), budget_rows(policy.cfg.vocab_size, chunk_mib), next(policy.parameters()).device
    M = micro_count(batch)
    micro = micro_chunks(batch, M)  # the step's M micro-batches of batch / M sequences
    for step in range(steps):
        for grp in opt.param_groups:
            grp["lr"] = lr_at(step, steps, lr, warmup=max(steps // 20, 1))
        idx = rng.sample(range(len(responses)), batch)  # the whole batch, on every rank
        sums = torch.zeros(2, device=dev)  # this rank's micro-batches: sum of losses, of tau_hat
        for j in mine(M, group):
            sel = [idx[i] for i in micro[j].tolist()]
            zeros = torch.zeros(len(sel))
            mb = RolloutBatch.from_rollouts([prompts[i] for i in sel], [responses[i] for i in sel],
                                            [torch.zeros(responses[i].numel()) for i in sel], zeros,
                                            zeros.bool()).to(dev)
            with torch.no_grad():
                out = policy(mb.tokens, mb.cu_seqlens, attn_fn=spec.attn_fn, tap_layers=draft.tap_layers,
                             logits=chunk == 0)
            loss, m = draft_loss(tr, out.taps, out.logits, mb, hidden=out.hidden, head=policy.head_weight,
                                 chunk=chunk)
            (loss / M).backward()
            opt.accumulate()
            sums += torch.stack([loss.detach().float(), torch.tensor(m["tau_hat"], device=dev)])
        loss, tau = (opt.sum_grads(sums, group) / M).tolist()
        if not math.isfinite(loss):
            raise FloatingPointError(f"draft warm-up step {step}: loss = {loss} (not finite); {HINT}")
        opt.step(tr.grad_clip)
        if log_every and (step % log_every == 0 or step == steps - 1):
            print(f"  draft step {step:4d}/{steps}  loss {loss:.4f}  tau_hat {tau:.2f}  {time.time() - t0:5.1f}s",
                  flush=True)
    check_finite_weights(draft, f"draft warm-up, after {steps} steps, the draft", HINT)
    draft.zero_grad(set_to_none=True)  # the last step's gradients would stay on this rank (a draft's size in fp32)


@torch.no_grad()
def evaluate_policy(policy, tsk, problems, max_new_tokens: int, *, temperature: float, seed: int = 0,
                    rows: int = 32) -> dict:
    """Mean reward, accuracy, explicit-step fraction (0 for a task without one) and response length on `problems`,
    sampled `rows` prompts per generate call (the rollout engine's batch, --rollout_batch)."""
    g = torch.Generator(device=next(policy.parameters()).device).manual_seed(seed)
    prompts = [tsk.encode_prompt(p) for p in problems]
    resp = []
    for i in range(0, len(prompts), rows):
        resp += [r.cpu() for r in speculative.generate(policy, None, prompts[i: i + rows],
                                                       max_new_tokens=max_new_tokens, temperature=temperature,
                                                       eos_id=tsk.tok.eos_ids, generator=g).tokens]
    R, parts = tsk.score(problems, resp)
    return {"reward": float(R.mean()), "correct": float(parts["correct"].mean()),
            "explicit": float(parts["explicit"].mean()) if "explicit" in parts else 0.0,
            "resp_len": sum(r.numel() for r in resp) / len(resp)}


def main(c, dev):
    """Both warm-ups for the Config `c` (the same settings, and so the same cache entries, as `python train.py ...`)
    on device `dev`, then the policy's held-out greedy and sampled scores. HF mode: the checkpoint as is, then the
    draft's warm-up."""
    torch.set_num_threads(c.threads)
    tsk = task_from_config(c)  # as experiment.build_task: the same key
    t0 = time.time()
    if c.hf_mode:  # the checkpoint as is (no SFT), in the run's dtype, as experiment.build_policy loads it
        dt = getattr(torch, run_dtype(c, dev))
        policy, key, loaded = from_pretrained(c.model, dtype=dt, device=dev), hf_policy_key(c.model), True
    else:
        policy, key, loaded = warm_policy(PolicySpec.from_config(c, tsk, dev), cache_dir=c.cache_dir, device=dev,
                                          log_every=max(c.sft_steps // 12, 1), chunk_mib=c.chunk_mib)
    print(f"policy {key} ({'loaded' if loaded else 'trained'}) in {time.time() - t0:.0f}s")
    if not (c.no_spec or c.draft):  # then the draft's warm-up, as train.py would: a later run finds both cached
        t0 = time.time()
        _, loaded = warm_draft(policy, draft_spec(c, tsk, key, dev), cache_dir=c.cache_dir,
                               log_every=max(c.draft_warmup_steps // 4, 1), chunk_mib=c.chunk_mib)
        print(f"draft ({'loaded' if loaded else 'trained'}) in {time.time() - t0:.0f}s")
    for T in (0.0, 1.0):
        print(f"held-out, temperature {T}:", evaluate_policy(policy, tsk, tsk.eval_set(256), tsk.max_new_tokens,
                                                            temperature=T, rows=c.rollout_batch))


if __name__ == "__main__":
    from harness.config import parse_args  # here, not in main: the harness is not the warm-ups' code (their cache key)
    from parallel.cli import describe, run_main
    # -h / --help: train.py's flags, exit 0; an error (a bad flag, a full disk, a NaN loss): one line, exit 1
    from harness.mesh import pick_device

    def _main():
        c = parse_args(sys.argv[1:], usage=describe(__doc__, __file__))
        return main(c, pick_device(c))
    run_main(_main, __file__)
