"""dist_step.py on real gloo processes: one GRPO + co-training step under (dp, pp, cp) equals the one-process oracle
(reference_step.cotrain_step).

The single-process step runs here (the oracle); one 4-process spawn then runs the five layouts one after another, and
three more loss normalisations, two --logprob_chunk layouts (no (T, V) logits) and two --zero1 layouts (the optimizer
state sharded; spawning costs seconds on 2 cores).
The drafts' shared embedding is NaN in every case: the update path must read e(x) from the embedding tap (stage 0's,
carried by TapChannel), not from a full policy copy. Every rank checks, after DistCotrainer.step + refit,
that its FULL policy and drafts (re-assembled for rollouts), the policy loss, both draft losses and the GRPO statistics
equal the oracle's (fp64 within 1e-8). The batch is hand-made (no generation): random advantages, one zero-variance
group, old log-probs near the policy's own at temperature 0.7 (so some ratios clip; every log-prob at that
temperature, the drafts' teacher untempered), a reference for the k3 penalty (beta > 0), two drafts,
tied embeddings (a copy on the first and the last stage) and a policy gradient that gets clipped.
"""
import pytest
import torch
import torch.distributed as dist
from dist_util import run_distributed

from dist_step import DistCotrainer
from draft import Eagle3Draft
from model import ModelConfig, Transformer
from parallel.grid import Grid
from rl_loop import DraftTrainer, GRPOConfig, RolloutBatch, next_token_logp
from reference_step import cotrain_step

LAYOUTS = [(1, 2, 2), (2, 2, 1), (2, 1, 2), (1, 4, 1), (1, 1, 4)]  # (dp, pp, cp)
# the other normalisations, each on a layout where it can go wrong (per-micro-batch means split over DP; CP shards).
NORMS = [("token-mean", (2, 2, 1)), ("constant", (1, 2, 2)), ("seq-mean", (2, 1, 2))]
# --logprob_chunk: GRPO's log-probs and the drafts' teacher from the final hidden, no (T, V) logits (pp and cp both)
FUSED = [("global-token", (1, 2, 2), {"logprob_chunk": 3}), ("token-mean", (2, 1, 2), {"logprob_chunk": 5})]
# --zero1: the stage's AdamW state sharded over its DP x CP ranks (the shard group; the cp group alone)
ZERO1 = [("global-token", (2, 1, 2), {"zero1": True}), ("token-mean", (1, 2, 2), {"zero1": True})]
CASES = [("global-token", lay, {}) for lay in LAYOUTS] + [(n, lay, {}) for n, lay in NORMS] + FUSED + ZERO1
MICRO = 4


TAU = 0.7  # the rollouts' temperature: every log-prob of the update is at tau (the drafts' teacher is softmax(z))


def grpo(norm):
    return GRPOConfig(eps_low=0.2, eps_high=0.28, beta=0.05, loss_norm=norm, max_len=8, temperature=TAU)


TOL = 1e-8


def make_models():
    torch.manual_seed(0)
    policy = Transformer(ModelConfig.preset("tiny", num_hidden_layers=4, tie_word_embeddings=True)).double()
    drafts = []
    for lam, seed in ((1.0, 1), (0.5, 2)):  # the rollout draft and a shadow one (like train.py's cold arm)
        torch.manual_seed(seed)
        d = Eagle3Draft.from_target(policy)
        drafts.append(DraftTrainer(d, torch.optim.AdamW(d.parameters(), lr=1e-2, weight_decay=0.0), lam=lam,
                                   grad_clip=1.0, num_passes=3))
    return policy, drafts


def make_policy_opt(params):
    return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.0, betas=(0.9, 0.99))


def make_batch(policy):
    g = torch.Generator().manual_seed(3)
    S = 8  # 4 groups of G = 2
    prompts = [torch.randint(policy.cfg.vocab_size, (int(torch.randint(2, 5, (1,), generator=g)),), generator=g)
               for _ in range(S)]
    resps = [torch.randint(policy.cfg.vocab_size, (int(torch.randint(3, 9, (1,), generator=g)),), generator=g)
             for _ in range(S)]
    lps = [torch.zeros(r.numel()) for r in resps]
    adv = torch.randn(S, generator=g)
    valid = torch.ones(S, dtype=torch.bool)
    valid[2:4] = False  # one zero-variance group (G = 2): skipped
    adv[~valid] = 0
    b = RolloutBatch.from_rollouts(prompts, resps, lps, adv, valid)
    with torch.no_grad():
        lp = next_token_logp(policy(b.tokens, b.cu_seqlens).logits, b.tokens, b.cu_seqlens, TAU)
    noise = 0.3 * torch.randn(lp.shape, generator=g, dtype=torch.float64)
    b.old_logp = torch.where(b.resp_mask, lp + noise, 0.0)
    b.ref_logp = torch.where(b.resp_mask, lp - noise.flip(0), 0.0)
    b.adv = b.adv.double()
    return b


def state(policy, drafts):
    return {"policy": {k: v.clone() for k, v in policy.state_dict().items()},
            "drafts": [{k: v.clone() for k, v in tr.draft.state_dict().items()} for tr in drafts]}


def _summary(st):
    return {"loss_policy": st["loss_policy"], "loss_draft": list(st["loss_draft"]), "clip_frac": st["clip_frac"],
            "ratio": st["ratio"], "k3": st["k3"], "grad_norm": st["grad_norm"],
            "tau_hat": [m["tau_hat"] for m in st["draft_metrics"]]}


def _max_diff(a, b):
    if isinstance(a, dict):
        return max(_max_diff(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return max(_max_diff(x, y) for x, y in zip(a, b))
    if isinstance(a, torch.Tensor):
        return float((a.double() - b.double()).abs().max()) if a.numel() else 0.0
    return abs(float(a) - float(b))


def run_case(grid, norm, ref, **kw) -> dict:
    """One DistCotrainer step + refit on `grid` -> max |difference| to the single-process reference, per part."""
    policy, drafts = make_models()
    batch = make_batch(policy)
    for tr in drafts:  # the update path reads e(x) from the embedding tap, never the shared embedding: poison it
        tr.draft.register_buffer("embed_weight", torch.full_like(tr.draft.embed_weight, float("nan")),
                                 persistent=False)
    ct = DistCotrainer(policy, drafts, grid, make_policy_opt, grad_clip=0.5, **kw)
    st = ct.step(batch, grpo(norm), MICRO)
    ct.refit(policy)
    got = {"stats": _summary(st), **state(policy, drafts)}
    return {k: _max_diff(got[k], ref[k]) for k in got}


def _worker(rank, world, cases, refs):
    out = []
    for norm, (dp, pp, cp), kw in cases:  # a case that raises is reported by its own test, the others still run
        try:
            out.append({"case": (norm, (dp, pp, cp), kw),
                        "diff": run_case(Grid.build(pp=pp, cp=cp, dp=dp), norm, refs[norm], **kw)})
        except Exception as e:  # noqa: BLE001
            out.append({"case": (norm, (dp, pp, cp), kw), "error": f"{type(e).__name__}: {e}"})
        dist.barrier()
    return out


def single_process(norm):
    policy, drafts = make_models()
    batch = make_batch(policy)
    st = cotrain_step(policy, make_policy_opt(policy.parameters()), batch, grpo(norm), drafts,
                      micro_batches=MICRO, policy_grad_clip=0.5)
    return {"stats": _summary(st), **state(policy, drafts)}


@pytest.fixture(scope="module")
def reference():
    return {norm: single_process(norm) for norm in {c[0] for c in CASES}}


@pytest.fixture(scope="module")
def world4(reference):
    return run_distributed(_worker, 4, args=(CASES, reference), timeout=120)


def test_reference_exercises_clipping_and_drafts(reference):
    s = reference["global-token"]["stats"]
    assert 0 < s["clip_frac"] < 1 and s["grad_norm"] > 0.5  # some ratios clip; the policy grads get clipped
    assert all(l > 0 for l in s["loss_draft"]) and s["k3"] > 0


@pytest.mark.parametrize("norm", sorted({c[0] for c in CASES}))
def test_one_process_update_path_matches_single_process(reference, norm):
    """World size 1, as train.py runs it: DistCotrainer on the 1 x 1 x 1 grid, no process group at all."""
    diff = run_case(Grid(), norm, reference[norm])
    assert all(v <= TOL for v in diff.values()), diff


def test_fused_logprobs_one_process_match_single_process(reference):
    """--logprob_chunk at world size 1: no (T, V) logits on the update path, the same step (cotrain_step's logits)."""
    diff = run_case(Grid(), "global-token", reference["global-token"], logprob_chunk=4)
    assert all(v <= TOL for v in diff.values()), diff


def test_activation_checkpointing_leaves_the_step_unchanged(reference):
    """--activation_checkpointing: every decoder layer recomputed in backward; the same step in fp64."""
    diff = run_case(Grid(), "global-token", reference["global-token"], activation_checkpointing=True)
    assert all(v <= TOL for v in diff.values()), diff


@pytest.mark.parametrize("case", CASES, ids=[f"{n}-dp{d}-pp{p}-cp{c}{''.join('-' + k for k in kw)}"
                                             for n, (d, p, c), kw in CASES])
def test_step_matches_single_process(world4, case):
    i = CASES.index(case)
    for rank, res in enumerate(world4):
        r = res[i]
        assert r["case"] == case
        assert "error" not in r, f"{case} rank {rank}: {r.get('error')}"
        bad = {k: v for k, v in r["diff"].items() if not v <= TOL}
        assert not bad, f"{case} rank {rank}: max |dist - single process| {bad} > {TOL}"
