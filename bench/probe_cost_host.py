"""The host's work around the model calls, probed for harness/cost_model.py by bench/probe_cost.py (which imports this
file and stores what it returns in the device json). Each probe times the project's REAL function on random weights /
random rollouts, CPU seconds of one process, at the timing rule of probe_cost.cpu_s (best of --repeats calls, best of
--rounds rounds):

  o_row     per rollout row outside generate and the reference: the task's scoring (task.score), packing the block
            (RolloutBatch.from_rollouts), and per row of the whole step the gather's concatenation
            (harness.rollout.concat_batches) and the group advantages (rl_loop.group_advantages)
  o_upd     per optimisation step of the policy outside its layers' and LM head's compute and AdamW's bytes: the
            GRPO weights and the micro-batch's packing (dist_step.microbatches), zero_grad, the whole-policy grad
            clip, the optimizer step's own work, the refit of the rollout copy (DistCotrainer.step + refit)
  o_tok_fb    plus this much per token of the micro-batch (forward + backward outside the layers: the embedding, the
            final norm, the fused LM-head log-probs, the GRPO token loss)
  o_dopt    per trained draft and update: its grad clip and AdamW step (dist_step runs them after the TTT is timed:
            a run counts them in policy_train)

o_upd and o_tok_fb come from DistCotrainer.step on a 1-layer policy at two sequence counts: what is left past the
model's own count of that step (its layer by the layer probe's figures, its LM head's FLOPs / F, AdamW's 28 bytes per
weight / BW) is o_upd + tokens o_tok_fb: an exact 2 x 2 solve.

    python bench/probe_cost_host.py --device bench/results/cost_device_cpu.json   # these four alone (~20 s), printed
"""
from __future__ import annotations

import json
import os
import random
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from backends.attention_padded import padded_causal_attention  # noqa: E402
from backends.fused_logprob import budget_rows  # noqa: E402
from branch_mask import cu_seqlens_from_lengths  # noqa: E402
from dist_step import DistCotrainer  # noqa: E402
from draft import Eagle3Draft  # noqa: E402
from harness.cost_inputs import Arch, attn_flops, dense_flops, head_flops  # noqa: E402
from modeling.mixed_precision import clip_grads_, master_optimizer  # noqa: E402
from parallel.grid import Grid  # noqa: E402
from rl_loop import GRPOConfig, RolloutBatch, group_advantages  # noqa: E402


def random_batch(vocab: int, S: int, T: int, prompt: int = 11, seed: int = 3) -> RolloutBatch:
    """S rollouts of T tokens (the first `prompt` the prompt), random tokens / old log-probs / advantages."""
    g = torch.Generator().manual_seed(seed)
    tok = torch.randint(0, vocab, (S * T,), generator=g)
    resp = (torch.arange(S * T) % T) >= prompt
    old = -torch.rand(S * T, generator=g) * resp
    return RolloutBatch(tok, cu_seqlens_from_lengths(torch.full((S,), T)), resp, old,
                        torch.randn(S, generator=g), torch.ones(S, dtype=torch.bool))


def probe_update(m1, arch: Arch, F: float, BW: float, o: dict, seqs: tuple, T: int, cpu_s, repeats: int) -> dict:
    """o_upd, o_tok_fb: the real update step (no drafts) and refit of a 1-layer policy at world size 1, as the run
    builds it, past what the model already counts: its layer as the layer probe's figures in `o` count it (dense
    3 flops / F, attention 3 flops / F_attn, o_layer_fb, o_seq_fb per sequence), the LM head's 3 flops / F and
    AdamW's 28 bytes per weight / BW."""
    ct = DistCotrainer(m1, [], Grid(), lambda ps: torch.optim.AdamW(ps, lr=1e-7, betas=(0.9, 0.99)), grad_clip=1.0,
                       attn_fn=padded_causal_attention, attn_backend="torch",
                       logprob_chunk=budget_rows(arch.vocab, 256.0))
    grpo, rest, weights = GRPOConfig(), {}, sum(p.numel() for p in m1.parameters())
    for S in seqs:
        batch = random_batch(arch.vocab, S, T)

        def step():
            ct.step(batch, grpo, 1, train_drafts=False)
            ct.refit(m1)
        layer = (3 * dense_flops(arch, S * T) / F + 3 * attn_flops(arch, S * T, T / 2) / o["F_attn"]
                 + o["o_layer_fb"] + S * o["o_seq_fb"])
        rest[S] = cpu_s(step, repeats) - layer - 3 * head_flops(arch, S * T) / F - 28 * weights / BW
    s1, s2 = sorted(seqs)
    per_tok = (rest[s2] - rest[s1]) / ((s2 - s1) * T)
    return {"o_upd": rest[s1] - s1 * T * per_tok, "o_tok_fb": per_tok}


def probe_draft_opt(m5, cpu_s, repeats: int) -> dict:
    """o_dopt: a draft trainer's grad clip and AdamW step (rl_loop.DraftTrainer's optimizer, master_optimizer)."""
    torch.manual_seed(4)
    d = Eagle3Draft.from_target(m5, tap_layers=(0, 1, 2))
    opt = master_optimizer(d.parameters(), lambda ps: torch.optim.AdamW(ps, lr=1e-7, weight_decay=0.0))
    ps = [p for p in d.parameters() if p.requires_grad]
    for p in ps:
        p.grad = torch.randn_like(p)

    def step():
        clip_grads_(ps, 1.0)
        opt.step()
    return {"o_dopt": cpu_s(step, repeats * 5)}


def probe_rows(B: int, G: int, blocks: int, cpu_s, repeats: int) -> dict:
    """o_row: scoring and packing `blocks` blocks of B rows of the built-in task (its demonstrations as the responses,
    random log-probs), then the step's concatenation and group advantages, per row."""
    from harness.config import Config
    from harness.rollout import concat_batches
    from tasks.protocol import factory
    cfg = Config()
    task, rng = factory(cfg.task)(cfg), random.Random(5)
    probs = [p for p in task.sample(B * blocks // G, rng) for _ in range(G)]
    prompts = [task.encode_prompt(p) for p in probs]
    toks = [d[n:] for d, n in (task.encode_demo(p, rng) for p in probs)]
    lps = [-torch.rand(t.numel()) for t in toks]

    def step():
        parts, R = [], []
        for i in range(0, len(probs), B):
            r, _ = task.score(probs[i: i + B], toks[i: i + B])
            R.append(r)
            parts.append(RolloutBatch.from_rollouts(prompts[i: i + B], toks[i: i + B], lps[i: i + B],
                                                    torch.zeros(B), torch.ones(B, dtype=torch.bool)))
        concat_batches(parts)
        group_advantages(torch.cat(R), G)
    return {"o_row": cpu_s(step, repeats) / len(probs)}


def cpu_times(fn, repeats: int) -> list:
    """CPU seconds of each of `repeats` calls of fn(), after one untimed warm-up call."""
    fn()
    out = []
    for _ in range(repeats):
        t = time.process_time()
        fn()
        out.append(time.process_time() - t)
    return out


def median_cpu_s(fn, repeats: int) -> float:
    """The median CPU seconds of `repeats` calls of fn() (probe_cost.cpu_s's rule, one round)."""
    return statistics.median(cpu_times(fn, repeats))


def models(name: str, seed: int = 0):
    """(1-layer, 5-layer) random policies of preset `name`."""
    from model import ModelConfig, Transformer
    torch.manual_seed(seed)
    return tuple(Transformer(ModelConfig.preset(name, num_hidden_layers=n)) for n in (1, 5))


def main(argv=None):
    """The four figures alone, on the layer figures of an existing device file (what bench/probe_cost.py stores)."""
    from parallel.cli import parser
    ap = parser(__doc__, __file__)
    ap.add_argument("--device", default="bench/results/cost_device_cpu.json", help="a device json with F, BW, F_attn, "
                    "o_layer_fb, o_seq_fb (bench/probe_cost.py writes one)")
    ap.add_argument("--repeats", type=int, default=7, help="calls per timing (their median)")
    a = ap.parse_args(argv)
    torch.set_num_threads(1)
    with open(a.device) as f:
        dev = json.load(f)
    m1, m5 = models("mini")
    arch, o = Arch.load("mini"), dict(dev["overheads"], F_attn=dev["F_attn"])
    out = probe_update(m1, arch, dev["F"], dev["BW"], o, (16, 64), 32, median_cpu_s, a.repeats)
    out.update(probe_draft_opt(m5, median_cpu_s, a.repeats), **probe_rows(32, 8, 8, median_cpu_s, a.repeats))
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    from parallel.cli import run_main  # an error: one line, exit 1 (COSPEC_TRACEBACK=1: the traceback)
    run_main(main, __file__)
