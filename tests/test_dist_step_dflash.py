"""dist_step.py with DFlash drafts (--drafter dflash): one GRPO + co-training step under (dp, pp, cp) equals
reference_step.cotrain_step, fp64 within 1e-8, in the layouts tests/test_dist_step.py checks, with its batch, GRPO
config and checks (policy, drafts, losses, statistics after step + refit). The drafts' shared embedding is NaN
except the MASK row: the update path reads e(x_a) from the embedding tap (stage 0's, through TapChannel) and only
e(MASK) from the shared embedding. One process runs here; one 4-process spawn runs the layouts. ~60 s on 2 CPU cores."""
import pytest
import torch
import torch.distributed as dist
from dist_util import run_distributed

from dist_step import DistCotrainer
from draft_dflash import DFlashDraft
from model import ModelConfig, Transformer
from parallel.grid import Grid
from rl_loop import DraftTrainer
from reference_step import cotrain_step
from test_dist_step import LAYOUTS, MICRO, TOL, _max_diff, _summary, grpo, make_batch, make_policy_opt, state

MASK = 5


def make_models():
    torch.manual_seed(0)
    policy = Transformer(ModelConfig.preset("tiny", num_hidden_layers=4, tie_word_embeddings=True)).double()
    drafts = []
    for lam, seed in ((1.0, 1), (0.5, 2)):  # the rollout draft and a shadow one (like train.py's cold arm)
        torch.manual_seed(seed)
        d = DFlashDraft.from_target(policy, mask_token_id=MASK, block_size=4)
        drafts.append(DraftTrainer(d, torch.optim.AdamW(d.parameters(), lr=1e-2, weight_decay=0.0), lam=lam,
                                   grad_clip=1.0, opts=dict(anchors=3, seed=seed)))
    return policy, drafts


def run_case(grid, ref, **kw) -> dict:
    policy, drafts = make_models()
    batch = make_batch(policy)
    for tr in drafts:  # only the MASK row of the shared embedding may be read on the update path
        poisoned = torch.full_like(tr.draft.embed_weight, float("nan"))
        poisoned[MASK] = tr.draft.embed_weight[MASK]
        tr.draft.register_buffer("embed_weight", poisoned, persistent=False)
    ct = DistCotrainer(policy, drafts, grid, make_policy_opt, grad_clip=0.5, **kw)
    st = ct.step(batch, grpo("global-token"), MICRO)
    ct.refit(policy)
    got = {"stats": _summary(st), **state(policy, drafts)}
    return {k: _max_diff(got[k], ref[k]) for k in got}


CASES = [(lay, {}) for lay in LAYOUTS] + [((1, 2, 2), {"logprob_chunk": 3})]


def _worker(rank, world, cases, ref):
    out = []
    for (dp, pp, cp), kw in cases:
        try:
            out.append({"case": ((dp, pp, cp), kw), "diff": run_case(Grid.build(pp=pp, cp=cp, dp=dp), ref, **kw)})
        except Exception as e:  # noqa: BLE001
            out.append({"case": ((dp, pp, cp), kw), "error": f"{type(e).__name__}: {e}"})
        dist.barrier()
    return out


@pytest.fixture(scope="module")
def reference():
    policy, drafts = make_models()
    st = cotrain_step(policy, make_policy_opt(policy.parameters()), make_batch(policy), grpo("global-token"), drafts,
                      micro_batches=MICRO, policy_grad_clip=0.5)
    assert all(l > 0 for l in st["loss_draft"]) and all(m["count"][0] > 0 for m in st["draft_metrics"])
    return {"stats": _summary(st), **state(policy, drafts)}


def test_one_process_update_path_matches_single_process(reference):
    diff = run_case(Grid(), reference)
    assert all(v <= TOL for v in diff.values()), diff


@pytest.fixture(scope="module")
def world4(reference):
    return run_distributed(_worker, 4, args=(CASES, reference), timeout=180)


@pytest.mark.parametrize("case", CASES, ids=[f"dp{d}-pp{p}-cp{c}{''.join('-' + k for k in kw)}"
                                             for (d, p, c), kw in CASES])
def test_step_matches_single_process(world4, case):
    i = CASES.index(case)
    for rank, res in enumerate(world4):
        r = res[i]
        assert r["case"] == case
        assert "error" not in r, f"{case} rank {rank}: {r.get('error')}"
        bad = {k: v for k, v in r["diff"].items() if not v <= TOL}
        assert not bad, f"{case} rank {rank}: max |dist - single process| {bad} > {TOL}"
