"""A fourth draft family from one file and one registry row: docs/examples/mlp_drafter.py's MLP speculator, registered
with drafters.register, co-trains through the registry's trainer (drafters.make_trainer -> rl_loop.draft_loss, the
co-training step's loss) on a tiny policy's taps, its loss falls, and speculative.generate with it at temperature 0
reproduces plain greedy decoding. The config, the memory plan and the save / load path take it by asking its class.
~3 s.
"""
import pytest
import torch

from docs.examples.mlp_drafter import MLPDraft
from drafter import demo_policy, policy_samples
from harness import drafters
from harness import memory_model as mm
from harness.config import CHECKS, parse_args
from harness.config_checks import family_rows
from harness.draft_formats import load_draft
from model import greedy_generate
from rl_loop import RolloutBatch, draft_loss
from speculative import generate


@pytest.fixture
def mlp():
    drafters.register("mlp", drafters.Family(MLPDraft, (), ()))  # the one row a family adds
    yield "mlp"
    del drafters.FAMILIES["mlp"]
    CHECKS.update(family_rows(drafters.FAMILIES))  # the config's rules as they were


def rollouts(policy, n: int = 16, length: int = 24, prompt: int = 4) -> RolloutBatch:
    """n of the policy's own samples as a rollout batch: `prompt` tokens of prompt, the rest its response."""
    seqs = policy_samples(policy, n, length, seed=0)[0].view(n, length)
    return RolloutBatch.from_rollouts([s[:prompt] for s in seqs], [s[prompt:] for s in seqs],
                                      [torch.zeros(length - prompt)] * n, torch.zeros(n), torch.ones(n, dtype=bool))


def test_the_mlp_family_co_trains_and_drafts_losslessly(mlp):
    torch.set_num_threads(1)
    policy = demo_policy()
    draft = drafters.build_draft(mlp, policy, {})
    opt = torch.optim.AdamW(draft.parameters(), lr=1e-2)
    tr = drafters.make_trainer(mlp, draft, opt, {})
    mb = rollouts(policy)
    with torch.no_grad():
        out = policy(mb.tokens, mb.cu_seqlens, tap_layers=draft.tap_layers)
    losses, taus = [], []
    for _ in range(40):
        loss, m = draft_loss(tr, out.taps, out.logits, mb)
        opt.zero_grad()
        (tr.lam * loss).backward()
        torch.nn.utils.clip_grad_norm_(draft.parameters(), tr.grad_clip)
        opt.step()
        losses.append(float(loss.detach()))
        taus.append(m["tau_hat"])
    # the loss (soft CE summed over 3 positions, the policy's entropy its floor) falls, the predicted acceptance rises
    assert losses[-1] < losses[0] - 1 and taus[-1] > taus[0] + 0.2, (losses[::10], taus[::10])
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(1, policy.cfg.vocab_size, (n,), generator=g) for n in (5, 3, 8, 4)]
    ref = greedy_generate(policy, prompts, 20)
    for k in (1, 3):
        r = generate(policy, draft, prompts, max_new_tokens=20, num_draft_tokens=k, temperature=0)
        assert [t.tolist() for t in r.tokens] == [t.tolist() for t in ref], k
        assert r.stats.accepted > 0, k  # the trained draft's tokens are taken, not only the policy's own


def test_the_config_memory_plan_and_checkpoint_ask_the_family(mlp, tmp_path):
    cfg = parse_args([f"--drafter={mlp}", "--num_draft_tokens=3"])
    assert cfg.draft_family is MLPDraft and cfg.block_slots == 0
    with pytest.raises(ValueError, match=r"--tap_layers=0: expected .*for mlp, the policy's last layer"):
        parse_args([f"--drafter={mlp}", "--tap_layers=0"])
    with pytest.raises(ValueError, match=r"--block_size=4: only --drafter dflash / dspark read it"):
        parse_args([f"--drafter={mlp}", "--block_size=4"])
    run = mm.Run(model=demo_policy().cfg)
    assert mm.taps_of(cfg, run) == (run.model.num_hidden_layers - 1,)
    n, _ = mm.draft_numel(run.model, cfg, mm.taps_of(cfg, run))
    H = run.model.hidden_size
    assert n == 2 * H * H + 3 * H  # state_in, token_in (+ bias), the norm's weight and bias
    policy = demo_policy()
    draft = drafters.build_draft(mlp, policy, {})
    draft.save(str(tmp_path))
    again = drafters.architecture(str(tmp_path)).load(str(tmp_path), policy)
    assert all(torch.equal(a, b) for a, b in zip(draft.state_dict().values(), again.state_dict().values()))
    # --draft PATH: the folder's family is read from it through the registry, no format entry needed
    assert parse_args([f"--draft={tmp_path}"]).drafter == mlp
    loaded = load_draft(str(tmp_path), policy)
    assert type(loaded) is MLPDraft and all(torch.equal(a, b) for a, b in zip(draft.state_dict().values(),
                                                                               loaded.state_dict().values()))
