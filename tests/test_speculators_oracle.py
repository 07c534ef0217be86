"""The speculators oracle itself (tests/speculators_oracle.py in .venv-speculators, through tests/speculators_util.py):
for each family a random draft made by the library's own classes over a tiny random Qwen3 verifier written here, run
through the library's training forward twice on fixed inputs. Both runs are equal bit for bit, finite, and the loss
has a non-zero gradient for every trainable parameter, the same set that `create` randomized. The weights that
save_pretrained leaves out are the library's documented ones (the verifier's, reloaded on load).
Adds ~90 s (3 creates + 6 forwards, one python start of the library's environment each; 88 s measured on a 2-core
machine at load average ~6). Marked slow: it runs the
library's environment (`pytest -q -m slow`; CI builds it with .ci/speculators_env.sh).
"""
import json

import pytest
import torch

from speculators_util import run_oracle, speculators_python

pytestmark = pytest.mark.slow

V, H, T, BLOCK, MASK = 64, 32, 24, 4, 63
SPECS = {  # the draft of each family; EAGLE-3's over a reduced vocabulary (48 of the 64 ids)
    "eagle3": dict(num_layers=1, target_layer_ids=[1, 2, 3], draft_vocab_size=48,
                   draft_token_ids=sorted(set(range(V)) - set(range(3, V, 4))), seed=3),
    "dflash": dict(num_layers=2, block_size=BLOCK, mask_token_id=MASK, target_layer_ids=[1, 3], seed=1),
    "dspark": dict(num_layers=1, block_size=BLOCK, mask_token_id=MASK, target_layer_ids=[1, 3], markov_rank=8,
                   seed=2),
}
LEFT_OUT = {"eagle3": {"verifier_lm_head.weight", "verifier_norm.weight"},
            "dflash": {"embed_tokens.weight", "lm_head.weight", "verifier_lm_head.weight", "verifier_norm.weight"}}
LEFT_OUT["dspark"] = LEFT_OUT["dflash"]


@pytest.fixture(scope="module")
def verifier(tmp_path_factory):
    """A random Qwen3 verifier, its LM head and final norm away from their init so the teacher is not uniform."""
    speculators_python()
    from transformers import Qwen3Config, Qwen3ForCausalLM
    torch.manual_seed(0)
    cfg = Qwen3Config(vocab_size=V, hidden_size=H, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=8, max_position_embeddings=128, tie_word_embeddings=False)
    model = Qwen3ForCausalLM(cfg)
    with torch.no_grad():
        model.lm_head.weight.normal_(0, 0.5)
        model.model.norm.weight.uniform_(0.5, 1.5)
    path = tmp_path_factory.mktemp("verifier")
    model.save_pretrained(str(path))
    return path


def inputs(family: str) -> dict:
    """Two packed documents (positions 0-13 and 14-23), loss on positions 6 onwards."""
    g = torch.Generator().manual_seed(7)
    taps = len(SPECS[family]["target_layer_ids"])
    loss_mask = torch.zeros(1, T, dtype=torch.bool)
    loss_mask[:, 6:] = True
    doc = torch.zeros(1, T, dtype=torch.long)
    doc[:, 14:] = 1
    inp = dict(hidden_states=torch.randn(1, T, taps * H, generator=g), input_ids=torch.randint(0, MASK, (1, T),
               generator=g), loss_mask=loss_mask, verifier_last_hidden_states=torch.randn(1, T, H, generator=g),
               document_ids=doc, position_ids=torch.cat([torch.arange(14), torch.arange(10)]).unsqueeze(0))
    if family == "eagle3":
        inp.update(ttt_steps=3, ttt_step_loss_decay=0.8)
    elif family == "dflash":
        inp.update(anchors=torch.tensor([6, 9, 15]), gamma=4.0)  # dspark: the default, every valid position
    return inp


def tensors(d, prefix=""):
    for k, v in d.items():
        if isinstance(v, dict):
            yield from tensors(v, f"{prefix}{k}.")
        elif torch.is_tensor(v):
            yield prefix + k, v


@pytest.mark.parametrize("family", ["eagle3", "dflash", "dspark"])
def test_create_then_forward_is_deterministic(family, verifier, tmp_path):
    spec = dict(SPECS[family], verifier=str(verifier))
    made = json.loads(run_oracle("create", family, tmp_path / "draft", "--spec", json.dumps(spec)))
    assert set(made["left_out"]) == LEFT_OUT[family]
    torch.save(inputs(family), tmp_path / "in.pt")
    outs = []
    for i in range(2):
        run_oracle("forward", family, tmp_path / "draft", tmp_path / "in.pt", tmp_path / f"out{i}.pt")
        outs.append(torch.load(tmp_path / f"out{i}.pt", weights_only=True))
    a, b = outs
    ta, tb = dict(tensors(a)), dict(tensors(b))
    assert ta.keys() == tb.keys()
    for k in ta:
        assert torch.equal(ta[k], tb[k]), f"{family}: {k} differs between two identical runs"
        assert torch.isfinite(ta[k].float()).all(), f"{family}: {k} is not finite"
    assert a["trainable"] == made["trainable"] and set(a["grads"]) == set(a["trainable"])
    for name, g in a["grads"].items():
        assert g.abs().sum() > 0, f"{family}: the loss has no gradient for {name}"
    vd = SPECS[family].get("draft_vocab_size", V)
    if family == "eagle3":
        assert a["logits"].shape == (3, T, vd) and a["targets"].shape == (T, vd) and a["step_losses"].shape == (3,)
    else:
        n = len(a["anchors"]) * BLOCK
        assert a["logits"].shape == a["targets"].shape == (n, vd) and a["loss_mask"].shape == (n,)
        if family == "dflash":
            assert a["anchors"].tolist() == [6, 9, 15]
        else:  # every position with loss_mask 1 before the last block: 6 .. T - BLOCK - 1
            assert a["anchors"].tolist() == list(range(6, T - BLOCK))
            assert a["confidence_logits"].shape == (n,)
            assert not torch.equal(a["base_logits"], a["logits"])  # the Markov bias is added
    assert a["loss"] > 0
