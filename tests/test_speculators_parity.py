"""cospec's drafts against the speculators library (0.9.0, in its own environment: tests/speculators_oracle.py), per
family, in fp32 on fixed inputs (the policy's own taps of one sequence; explicit anchors for the block drafts):

  forward, cospec -> library   a cospec draft exported in the speculators format (write_servables, <out>/draft)
                               and run by the library's own model gives cospec's logits (DSpark: the Markov-biased
                               logits and the confidence logits too; EAGLE-3: every TTT pass), max |diff| <= 2e-5 on
                               logits of size ~1
  forward, library -> cospec   a draft the library created (its init, randomised, its save_pretrained) loads with
                               --draft's loader and gives the library's logits, the same bound
  training                     the library's training loss and gradients on the same batch, with the loss that
                               matches cospec's (DFlash and EAGLE-3: KL; DSpark: 0.1 KL + 1.8 TV + the confidence
                               BCE): every gradient within 1e-4 of cospec's relative to its norm

The terms that differ, each pinned here: the loss values, by the teacher's entropy (cospec writes CE(p, q), the library
KL(p || q) = CE(p, q) - H(p): equal gradients, values apart by sum w m H(p) / sum m); EAGLE-3's LM head (Vd, H), which
cospec trains and exports and the library freezes at the verifier's rows. Conventions (serving/speculators_format.py):
the library's aux ids are cospec's taps + 1; cospec's loss mask is per prediction (row t: x_{t+1} is trained) where
the library's is per token; the library's EAGLE-3 data pairs x_{i+1} with row i's state (its shift_batch). Where a
response starts the two count different chains (tests/test_draft_loss.py pins cospec's); the batches here are chosen
where they agree. Marked slow (it runs the library's environment). ~90 s on 2 cores (3 creates, 6 library forwards)."""
import json
import math
import os

import pytest
import torch
import torch.nn.functional as F

from draft_block import block_targets
from draft_dflash import DFlashDraft
from draft_dspark import DSparkDraft
from draft_loss import make_teacher
from harness.draft_formats import load_draft
from model import ModelConfig, Transformer
from parallel.ring import as_ring
from serving.export import write_servables
from serving.speculators_format import RENAMES
from speculators_util import run_oracle, speculators_python

pytestmark = pytest.mark.slow

T, N_PROMPT, W, GAMMA = 16, 4, 4, 4.0
FAMILIES = {
    "dflash": lambda p: DFlashDraft.from_target(p, mask_token_id=5, block_size=W, num_layers=2, tap_layers=(0, 2)),
    "dspark": lambda p: DSparkDraft.from_target(p, mask_token_id=5, block_size=W, num_layers=2, tap_layers=(0, 2),
                                                markov_rank=4),
}
LOSS = {"dflash": "kl_div", "dspark": json.dumps({"kl_div": 0.1, "tv": 1.8})}
CE_WEIGHT = {"dflash": 1.0, "dspark": 0.1}


@pytest.fixture(scope="module")
def policy():
    speculators_python()
    torch.manual_seed(0)
    return Transformer(ModelConfig.preset("tiny", qk_norm=True)).eval()


def _randomised(d, seed):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():  # off the init (zero Markov head, unit norms), so a swapped tensor shows
        for p in d.parameters():
            p.add_(0.1 * torch.randn(p.shape, generator=g))
    return d


def _batch(policy, draft):
    """One sequence: its taps, the policy's logits (teacher), both loss masks, the anchors both sides can take."""
    g = torch.Generator().manual_seed(7)
    tokens = torch.randint(6, policy.cfg.vocab_size, (T,), generator=g)
    cu = torch.tensor([0, T], dtype=torch.int32)
    L = policy.cfg.num_hidden_layers
    with torch.no_grad():
        out = policy(tokens, cu, tap_layers=tuple(sorted(set(draft.tap_layers) | {L - 1})))
    row_mask = torch.zeros(T, dtype=torch.bool)  # cospec: row t trains x_{t+1} (a response token)
    row_mask[N_PROMPT - 1: T - 1] = True
    token_mask = torch.zeros(T, dtype=torch.bool)  # the library: token t is a response token
    token_mask[N_PROMPT:] = True
    anchors = torch.arange(N_PROMPT, T - W)  # x_a, x_{a+1} response tokens (cospec), a < T - W (the library)
    return dict(tokens=tokens, cu=cu, taps={t: out.taps[t] for t in draft.tap_layers}, last=out.taps[L - 1],
                logits=out.logits, row_mask=row_mask, token_mask=token_mask, anchors=anchors)


def _oracle_forward(family, path, b, tmp_path):
    inp = dict(hidden_states=torch.cat([b["taps"][t] for t in sorted(b["taps"])], -1)[None],
               input_ids=b["tokens"][None], loss_mask=b["token_mask"][None].float(),
               verifier_last_hidden_states=b["last"][None], anchors=b["anchors"], gamma=GAMMA,
               loss_fn=LOSS[family])
    torch.save(inp, tmp_path / "in.pt")
    run_oracle("forward", family, path, tmp_path / "in.pt", tmp_path / "out.pt")
    return torch.load(tmp_path / "out.pt")


def _cospec(draft, b):
    """cospec's block logits (A*W, V) (DSpark: Markov-biased) and confidence logits, and its training loss on the
    anchors (draft_block.train_blocks' steps with the anchors given) with the gradients."""
    draft.zero_grad()
    a, tokens, cu = b["anchors"], b["tokens"], b["cu"]
    ring = as_ring(None)
    halo = max(draft.teacher_offsets) + 1
    teacher = make_teacher(b["logits"], None, None, T, draft.cfg.vocab_size, cu, halo, ring)
    valid, src, count = block_targets(b["row_mask"], cu, a, draft.teacher_offsets, halo, ring)
    h = draft.block_forward(b["taps"], tokens, cu, a)  # (A, W, H)
    slot = torch.arange(W)
    prev = tokens[(a[:, None] + slot).clamp_max(T - 1)]  # (A, W) x_{a+k}
    if isinstance(draft, DSparkDraft):
        z = draft.markov_logits(h, prev)
        conf = draft.confidence_logit(draft.norm(h), draft.markov_in(prev))
    else:
        z, conf = draft.logits(h), None
    loss, _ = draft.block_loss(h, teacher, valid, src, count, gamma=GAMMA, chunk=64,
                               slot_tokens=lambda k: prev[:, k])
    loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in draft.named_parameters()}
    return z.detach().flatten(0, 1), None if conf is None else conf.detach().flatten(), loss.detach(), grads


def _entropy_term(family, o):
    """sum w m H(p) / sum m over the library's slots: the loss gap KL = CE - H(p) leaves (times the CE weight)."""
    p = F.softmax(o["targets"].double(), -1)
    ent = -(p * F.log_softmax(o["targets"].double(), -1)).sum(-1)  # (A*W,)
    pos = torch.arange(ent.shape[0]) % W
    w = torch.exp(-(pos - int(family == "dflash")).clamp_min(0) / GAMMA)
    m = o["loss_mask"].double()
    return CE_WEIGHT[family] * float((w * m * ent).sum() / m.sum())


def _spec_name(name):
    return {v: k for k, v in RENAMES.items()}.get(name, name)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_cospec_draft_in_the_library(tmp_path, policy, family):
    draft = _randomised(FAMILIES[family](policy), 1)
    out = write_servables(str(tmp_path / "run"), policy, draft, dtype=torch.float32)
    listing = json.load(open(os.path.join(out["draft"], "formats.json")))
    b = _batch(policy, draft)
    o = _oracle_forward(family, os.path.join(out["draft"], listing["speculators"]), b, tmp_path)
    assert torch.equal(o["anchors"], b["anchors"])
    z, conf, loss, grads = _cospec(draft, b)
    assert (z - o["logits"]).abs().max() <= 2e-5, "forward: the library's logits differ from cospec's"
    if conf is not None:
        assert (conf - o["confidence_logits"]).abs().max() <= 2e-5
    # training: the same gradients; the loss apart by exactly the teacher-entropy term
    assert abs(float(loss) - float(o["loss"]) - _entropy_term(family, o)) <= 1e-5 * max(1.0, abs(float(loss)))
    assert set(map(_spec_name, grads)) == set(o["grads"])
    for n, g in grads.items():
        ref = o["grads"][_spec_name(n)]
        assert (g - ref).norm() <= 1e-4 * ref.norm().clamp_min(1e-8), n


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_library_draft_in_cospec(tmp_path, policy, family):
    from serving.hf_io import save_pretrained
    save_pretrained(policy, str(tmp_path / "policy"))
    spec = dict(verifier=str(tmp_path / "policy"), num_layers=2, block_size=W, mask_token_id=5,
                target_layer_ids=[1, 3], seed=4, **({"markov_rank": 4} if family == "dspark" else {}))
    run_oracle("create", family, tmp_path / "d", "--spec", json.dumps(spec))
    draft = load_draft(str(tmp_path / "d"), policy, drafter=family)
    assert draft.tap_layers == (0, 2)
    b = _batch(policy, draft)
    o = _oracle_forward(family, tmp_path / "d", b, tmp_path)
    z, conf, _, _ = _cospec(draft, b)
    assert (z - o["logits"]).abs().max() <= 2e-5
    if conf is not None:
        assert (conf - o["confidence_logits"]).abs().max() <= 2e-5
    assert math.isfinite(float(o["loss"]))


# ------------------------------------------------------------------------------------------------------------ EAGLE-3
P = 3  # TTT passes (the library's ttt_steps), pass weight 0.8 both sides


def _eagle3_batch(policy, draft):
    """A sequence that is all response (cospec's and the library's loss masks then count the same chains; where they
    differ, at a response's first tokens, tests/test_draft_loss.py pins cospec's rule) and the library's inputs:
    its data pipeline pairs x_{i+1} with the state of row i (speculators' eagle3/data.py shift_batch)."""
    b = _batch(policy, draft)
    b["row_mask"] = torch.zeros(T, dtype=torch.bool)
    b["row_mask"][: T - 1] = True
    m = torch.ones(T)
    m[-1] = 0  # no x_T: the last row predicts nothing (the library would train on its teacher anyway)
    h = torch.cat([b["taps"][t] for t in sorted(b["taps"])], -1)
    b["library"] = dict(hidden_states=h[:-1][None], input_ids=b["tokens"][1:][None], loss_mask=m[1:][None],
                        verifier_last_hidden_states=b["last"][1:][None], ttt_steps=P, ttt_step_loss_decay=0.8,
                        loss_fn="kl_div")
    return b


def _eagle3_oracle(path, b, tmp_path):
    torch.save(b["library"], tmp_path / "in.pt")
    run_oracle("forward", "eagle3", path, tmp_path / "in.pt", tmp_path / "out.pt")
    return torch.load(tmp_path / "out.pt")


def _eagle3_logits_match(draft, b, o):
    hs = draft.ttt_forward(b["taps"], b["tokens"], b["cu"], P)
    for d in range(P):  # the library's step d at row i = cospec's pass d + 1 at anchor i: x_{i+d+2}
        n = T - 2 - d
        assert (draft.logits(hs[d])[:n] - o["logits"][d][:n]).abs().max() <= 2e-5, d


def test_eagle3_cospec_draft_in_the_library(tmp_path, policy):
    from draft import Eagle3Draft
    draft = _randomised(Eagle3Draft.from_target(policy, draft_vocab=torch.arange(0, policy.cfg.vocab_size, 2)), 2)
    out = write_servables(str(tmp_path / "run"), policy, draft, dtype=torch.float32)
    b = _eagle3_batch(policy, draft)
    o = _eagle3_oracle(os.path.join(out["draft"], "speculators"), b, tmp_path)
    with torch.no_grad():
        _eagle3_logits_match(draft, b, o)
    draft.zero_grad()
    loss, _ = draft.ttt_loss(b["taps"], b["tokens"], b["cu"], b["logits"], loss_mask=b["row_mask"], num_passes=P,
                             pass_weight=0.8)
    loss.backward()
    loss = loss.detach()
    # the named terms: the teacher's entropy (CE vs KL; the teacher renormalised over the draft vocabulary on both
    # sides) and the LM head, trained by cospec ((Vd, H), exported) and frozen at the verifier's rows by the library
    p = F.log_softmax(o["targets"].double(), -1)
    ent = -(p.exp() * p).sum(-1)  # (T - 1,)
    m = b["library"]["loss_mask"][0].double()
    gap = sum(0.8 ** d * float((ent[d:] * m[d:]).sum() / m[d:].sum()) for d in range(P))
    assert abs(float(loss) - float(o["loss"]) - gap) <= 1e-5 * float(loss)
    assert draft.lm_head.weight.grad.abs().sum() > 0 and "lm_head.weight" not in o["grads"]
    for n, prm in draft.named_parameters():
        if n == "lm_head.weight":
            continue
        ref = o["grads"]["layers.0." + n.removeprefix("midlayer.") if n.startswith("midlayer.") else n]
        assert (prm.grad - ref).norm() <= 1e-4 * ref.norm(), n


def test_eagle3_library_draft_in_cospec(tmp_path, policy):
    from serving.hf_io import save_pretrained
    save_pretrained(policy, str(tmp_path / "policy"))
    V = policy.cfg.vocab_size
    spec = dict(verifier=str(tmp_path / "policy"), num_layers=1, target_layer_ids=[1, 2, 3], draft_vocab_size=49,
                draft_token_ids=list(range(0, V, 2)), draft_arch="llama", seed=5)
    run_oracle("create", "eagle3", tmp_path / "d", "--spec", json.dumps(spec))
    draft = load_draft(str(tmp_path / "d"), policy, drafter="eagle3")
    assert draft.tap_layers == (0, 1, 2) and draft.cfg.draft_vocab_size == 49
    assert torch.equal(draft.draft_to_target, torch.arange(0, V, 2))
    b = _eagle3_batch(policy, draft)
    o = _eagle3_oracle(tmp_path / "d", b, tmp_path)
    with torch.no_grad():
        _eagle3_logits_match(draft, b, o)


# ------------------------------------------------------------------------------------- a published format, converted
def _zlab_draft(path, policy, seed=6):
    """A small DFlash draft written as z-lab publishes one (e.g. z-lab/Qwen3-8B-DFlash-b16: a Qwen3 config for the
    draft's layers, architectures DFlashDraftModel with its auto_map, block_size and num_target_layers at the top,
    dflash_config {mask_token_id, target_layer_ids}; weights fc, hidden_norm, layers.*, norm), by hand, not by
    cospec's exporter."""
    from safetensors.torch import save_file
    c = policy.cfg
    H, D, Hq, Hkv, I, n = c.hidden_size, c.head_dim, c.num_attention_heads, c.num_key_value_heads, 64, 2
    cfg = {"architectures": ["DFlashDraftModel"], "auto_map": {"AutoModel": "dflash.DFlashDraftModel"},
           "model_type": "qwen3", "block_size": W, "num_target_layers": c.num_hidden_layers,
           "dflash_config": {"mask_token_id": 5, "target_layer_ids": [0, 2]}, "hidden_size": H,
           "intermediate_size": I, "num_hidden_layers": n, "num_attention_heads": Hq, "num_key_value_heads": Hkv,
           "head_dim": D, "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "max_position_embeddings": 256,
           "vocab_size": c.vocab_size, "hidden_act": "silu", "attention_bias": False, "tie_word_embeddings": False,
           "torch_dtype": "float32"}
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: 0.1 * torch.randn(*s, generator=g)  # noqa: E731
    sd = {"fc.weight": r(H, 2 * H), "hidden_norm.weight": 1 + r(H), "norm.weight": 1 + r(H)}
    for i in range(n):
        p = f"layers.{i}."
        sd.update({p + "input_layernorm.weight": 1 + r(H), p + "post_attention_layernorm.weight": 1 + r(H),
                   p + "self_attn.q_proj.weight": r(Hq * D, H), p + "self_attn.k_proj.weight": r(Hkv * D, H),
                   p + "self_attn.v_proj.weight": r(Hkv * D, H), p + "self_attn.o_proj.weight": r(H, Hq * D),
                   p + "self_attn.q_norm.weight": 1 + r(D), p + "self_attn.k_norm.weight": 1 + r(D),
                   p + "mlp.gate_proj.weight": r(I, H), p + "mlp.up_proj.weight": r(I, H),
                   p + "mlp.down_proj.weight": r(H, I)})
    os.makedirs(path)
    save_file(sd, os.path.join(path, "model.safetensors"))
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg, f)


def test_zlab_draft_and_its_speculators_conversion(tmp_path, policy):
    """cospec loads a z-lab-format DFlash draft, and the same draft after the library's own converter
    (speculators.convert.dflash.DFlashConverter): the same draft, the same logits."""
    from serving.hf_io import save_pretrained
    save_pretrained(policy, str(tmp_path / "policy"))
    _zlab_draft(str(tmp_path / "zlab"), policy)
    run_oracle("convert-dflash", tmp_path / "zlab", tmp_path / "converted", tmp_path / "policy")
    a = load_draft(str(tmp_path / "zlab"), policy)
    b = load_draft(str(tmp_path / "converted"), policy)
    assert json.load(open(tmp_path / "converted" / "config.json"))["aux_hidden_state_layer_ids"] == [1, 3]
    assert a.tap_layers == b.tap_layers == (0, 2) and a.cfg == b.cfg
    batch = _batch(policy, a)
    za, zb = _cospec(a, batch)[0], _cospec(b, batch)[0]
    assert torch.equal(za, zb)
    o = _oracle_forward("dflash", tmp_path / "converted", batch, tmp_path)  # and the library agrees
    assert (za - o["logits"]).abs().max() <= 2e-5
