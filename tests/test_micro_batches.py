"""--micro_batches is exact: it must divide an update's sequences (else one clear error, at the command line and in the
step itself), and the draft metrics -- tau_hat and every per-pass mean -- cover every micro-batch (count-weighted),
so they equal the one-micro-batch metrics; the losses keep their documented normalisation by the micro-batch count.

All in one process, fp64: reference_step.cotrain_step, dist_step.DistCotrainer on the 1 x 1 x 1 grid,
harness/update.py's merge over the updates of a step. Adds ~5 s on 2 loaded cores.
"""
from types import SimpleNamespace

import pytest

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny shapes: threads only add contention
import torch

from dist_step import DistCotrainer
from draft import Eagle3Draft
from harness.config import parse_args
from harness.watch import DraftWatch
from model import ModelConfig, Transformer
from parallel.grid import Grid
from rl_loop import DraftTrainer, GRPOConfig, RolloutBatch, draft_loss, group_advantages
from reference_step import cotrain_step

TOL = 1e-10
KEYS = ("loss_per_pass", "acc", "acc_cond", "alpha", "tau_hat", "count", "n_cond")


def _models(seed=0):
    torch.manual_seed(seed)
    policy = Transformer(ModelConfig.preset("tiny", vocab_size=17)).double()
    torch.manual_seed(seed + 1)
    draft = Eagle3Draft.from_target(policy).double()
    return policy, DraftTrainer(draft, torch.optim.SGD(draft.parameters(), lr=1.0), lam=0.5, grad_clip=1e9)


def _batch(seed=0, n_prompts=2, G=2):  # 4 sequences of different lengths: micro-batches of unequal token counts
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(3, 17, (int(torch.randint(2, 6, (1,), generator=g)),), generator=g)
               for _ in range(n_prompts * G)]
    resps = [torch.randint(3, 17, (int(torch.randint(3, 9, (1,), generator=g)),), generator=g)
             for _ in range(n_prompts * G)]
    logps = [-torch.rand(r.numel(), generator=g, dtype=torch.float64) for r in resps]
    A, valid = group_advantages(torch.tensor([1.0, 0.0, 0.0, 1.0] * n_prompts)[: n_prompts * G], G)
    b = RolloutBatch.from_rollouts(prompts, resps, logps, A.double(), valid)
    b.old_logp = b.old_logp.double()
    return b


def _step(micro, batch):
    policy, tr = _models()
    st = cotrain_step(policy, torch.optim.SGD(policy.parameters(), lr=1.0), batch, GRPOConfig(), [tr],
                      micro_batches=micro, policy_grad_clip=1e9)
    return st, policy, tr


def _diff(a, b):
    return max(abs(float(x) - float(y)) for k in KEYS for x, y in zip(*(([m[k]] if k == "tau_hat" else m[k])
                                                                          for m in (a, b))))


@pytest.mark.parametrize("micro", [3, 7])
def test_micro_batches_that_do_not_divide_the_update_are_refused(micro):
    b = _batch()  # 4 sequences: torch.chunk made 2 (3) or 4 (7) chunks, every loss divided by 3 or 7
    with pytest.raises(ValueError, match=rf"micro_batches={micro}: must divide the update's 4 sequences"):
        _step(micro, b)
    policy, tr = _models()
    with pytest.raises(ValueError, match=rf"micro_batches={micro}: must divide the update's 4 sequences"):
        DistCotrainer(policy, [tr], Grid(), lambda ps: torch.optim.SGD(ps, lr=1.0)).step(b, GRPOConfig(), micro)
    # --preset test: 2 prompts x 4 samples in 2 updates = 4 sequences per update
    with pytest.raises(ValueError, match=rf"--micro_batches={micro}: expected a divisor of each update's sequences "
                                         r"\(prompts_per_step \* group_size = 2 \* 4 sequences in updates=2 "):
        parse_args(["--preset=test", f"--micro_batches={micro}"])
    parse_args(["--preset=test", "--micro_batches=4"])  # a divisor passes


def test_metrics_cover_every_micro_batch_and_equal_the_one_micro_batch_metrics():
    b = _batch(1)
    one, p1, _ = _step(1, b)
    two, p2, tr2 = _step(2, b)
    assert _diff(one["draft_metrics"][0], two["draft_metrics"][0]) <= TOL
    assert abs(one["loss_policy"] - two["loss_policy"]) <= TOL  # global-token: no micro-batch count in it
    for a, c in zip(p1.parameters(), p2.parameters()):
        assert float((a - c).detach().abs().max()) <= TOL
    # the draft loss is a mean per micro-batch, averaged over the 2 of them (exactly 2: micro_batches divides S)
    policy, tr = _models()
    halves = []
    for idx in torch.arange(4).chunk(2):
        mb = b.select(idx)
        out = policy(mb.tokens, mb.cu_seqlens, tap_layers=tr.draft.tap_layers)
        halves.append(float(draft_loss(tr, out.taps, out.logits, mb)[0].detach()))
    assert abs(two["loss_draft"][0] - sum(halves) / 2) <= TOL
    # through dist_step (1 x 1 x 1 grid): the same merged metrics
    policy, tr = _models()
    st = DistCotrainer(policy, [tr], Grid(), lambda ps: torch.optim.SGD(ps, lr=1.0), grad_clip=1e9).step(
        b, GRPOConfig(), 2)
    assert _diff(one["draft_metrics"][0], st["draft_metrics"][0]) <= TOL


def test_the_step_reports_every_update_merged():
    from draft_ttt import merge_metrics
    from harness.update import update
    b = _batch(2, n_prompts=4)  # 8 sequences, 2 updates of 4
    b.ref_logp = b.old_logp - 0.1  # update() measures the KL drift from the rollouts
    policy, tr = _models()
    frozen = Eagle3Draft.from_target(policy).double()
    seen = []
    ct = DistCotrainer(policy, [tr], Grid(), lambda ps: torch.optim.SGD(ps, lr=0.1), grad_clip=1e9,
                       observers=[DraftWatch([frozen], options=tr)])
    real = ct.step
    ct.step = lambda *a, **k: seen.append(real(*a, **k)) or seen[-1]
    cfg = SimpleNamespace(updates=2, micro_batches=2, trains_drafts=lambda u: True)  # every update trains the drafts
    s = SimpleNamespace(cfg=cfg, perm_gen=torch.Generator().manual_seed(0),
                        cotrainer=ct, grpo=GRPOConfig(), offline=None, drafts={"cotrained": tr}, frozen=frozen,
                        policy=policy)
    out = update(s, b, {})
    assert len(seen) == 2
    for name, key in (("cotrained", "draft_metrics"), ("frozen", "observed_metrics")):
        want = merge_metrics([st[key][0] for st in seen])
        assert abs(out[f"tau_hat_{name}"] - want["tau_hat"]) <= TOL
        assert max(abs(x - y) for x, y in zip(out[f"alpha_{name}"], want["alpha"])) <= TOL
        assert abs(want["tau_hat"] - seen[-1][key][0]["tau_hat"]) > 1e-6  # not just the last update's
    assert abs(out["loss_draft"] - sum(st["loss_draft"][0] for st in seen) / 2) <= TOL
