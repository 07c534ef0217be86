"""The trainer's pipeline stage IS the rollout policy's parameters (dist_step.stage_of): same tensors (data_ptr), so a
process holds one copy of its stage's weights, not two; after a step the policy already has the update, refit copies
nothing on a 1 x 1 x 1 mesh, and under bf16 (a flat buffer of working weights, zero1.ShardedOptimizer) the policy and
the drafts' shared embedding follow the buffer. The pp > 1 stages are built in one process (stage_of needs no process
group); tests/test_dist_step.py holds the step + refit to the single-process step on gloo ranks.
Adds ~3 s (measured 2.6 s for the file at load 5 on 2 cores).
"""
import copy

import torch
from test_dist_step import grpo, make_batch, make_models, make_policy_opt

from dist_step import DistCotrainer, _owner, stage_of
from parallel.grid import Grid
from parallel.pp_schedule import split_layers
from pipeline import build_stage


def param_bytes(*modules) -> int:
    """Bytes of the distinct storages behind the modules' parameters: what the process holds for them."""
    seen = {}
    for m in modules:
        for p in m.parameters():
            st = p.untyped_storage()
            seen[st.data_ptr()] = st.nbytes()
    return sum(seen.values())


def test_one_process_stage_is_the_policy_and_a_step_updates_it_in_place():
    policy, drafts = make_models()
    batch = make_batch(policy)
    before = param_bytes(policy)
    old_stage = build_stage(policy.cfg, (0, policy.cfg.num_hidden_layers), policy.state_dict(), torch.float64)
    assert param_bytes(policy, old_stage) == 2 * before  # the copy this replaces
    ct = DistCotrainer(policy, drafts, Grid(), make_policy_opt, grad_clip=0.5)
    full = dict(policy.named_parameters())
    for name, p in ct.stage.named_parameters():
        assert p is full[name] and p.data_ptr() == full[name].data_ptr(), name
    assert param_bytes(policy, ct.stage) == before  # dropped by the stage's size
    w0 = copy.deepcopy(policy.state_dict())
    ct.step(batch, grpo("global-token"), 2)
    moved = {k: v.clone() for k, v in policy.state_dict().items()}
    assert all(not torch.equal(moved[k], w0[k]) for k in w0)  # updated without refit
    ct.refit(policy)  # nothing left to copy
    assert all(torch.equal(v, moved[k]) for k, v in policy.state_dict().items())


def test_pipeline_stages_alias_what_they_own():
    policy, _ = make_models()  # tied embeddings: the last stage holds a copy of the embedding under pp > 1
    n, full = policy.cfg.num_hidden_layers, dict(policy.named_parameters())
    split = split_layers(n, 2)
    for s in range(2):
        stage = stage_of(policy, split, s)
        old = build_stage(policy.cfg, split[s], policy.state_dict(), torch.float64)
        for name, p in stage.named_parameters():
            assert torch.equal(p, full[name]), name
            assert (p.data_ptr() == full[name].data_ptr()) == (_owner(name, split) == s), name
        not_owned = sum(p.numel() * p.element_size() for name, p in stage.named_parameters()
                        if _owner(name, split) != s)
        assert param_bytes(policy, stage) == param_bytes(policy) + not_owned  # the tied copy on the last stage only
        assert param_bytes(policy, old) - param_bytes(policy, stage) == param_bytes(old) - not_owned
        assert (not_owned > 0) == (s == 1)


def test_bf16_flat_buffer_keeps_the_alias_and_the_drafts_embedding():
    policy, drafts = make_models()
    batch = make_batch(policy)
    policy.to(torch.bfloat16)
    for tr in drafts[:1]:
        tr.draft.to(torch.bfloat16).attach(policy)
    ct = DistCotrainer(policy, drafts[:1], Grid(), lambda ps: torch.optim.SGD(ps, lr=0.05), grad_clip=1e9)
    flat = ct.opt.flat.untyped_storage().data_ptr()  # the working weights moved into one buffer (.data rebound)
    assert all(p.untyped_storage().data_ptr() == flat for p in policy.parameters())
    d = drafts[0].draft
    assert d.embed_weight.data_ptr() == policy.embed.weight.data_ptr()  # re-attached to the moved embedding
    e0 = policy.embed.weight.clone()
    ct.step(batch, grpo("global-token"), 2)
    assert not torch.equal(policy.embed.weight, e0) and torch.equal(d.embed_weight, policy.embed.weight)
