"""The speculators library (vllm-project/speculators 0.9.0) as an outside oracle: runs INSIDE its own environment
(`bash .ci/speculators_env.sh`; tests/speculators_util.py finds the python and calls this script), never imported by
cospec. Files travel as torch.save'd dicts; everything runs in fp32 on the CPU, deterministically.

    python tests/speculators_oracle.py create FAMILY OUT_DIR --spec JSON    # a random draft, library classes
    python tests/speculators_oracle.py forward FAMILY DRAFT_DIR IN.pt OUT.pt  # the library's training forward
    python tests/speculators_oracle.py convert-dflash ZLAB_DIR OUT_DIR VERIFIER_DIR [--aux-layer-ids JSON]

FAMILY is eagle3, dflash or dspark. `create` builds the draft with the family's `from_training_args` (verifier
embedding and LM head loaded from the verifier folder named in --spec), sets every trainable weight to random values
(norm gains near 1, so a permuted or missing weight shows), saves it with `save_pretrained`, and prints a JSON line:
{"saved": [...], "left_out": [...], "trainable": [...]} (left_out: state-dict keys save_pretrained omits).

--spec (a JSON object, or a path to a JSON file):
    verifier              HF checkpoint folder (required); the draft's hidden size is the verifier's
    num_layers            draft decoder layers (default 1)
    num_attention_heads, num_key_value_heads, head_dim, intermediate_size, rms_norm_eps, rope_theta
                          the draft layer's shape (default: the verifier's)
    hidden_size           optional; must equal the verifier's (the library refuses any other)
    draft_arch            "llama" | "qwen3": the layer config class (default llama for eagle3, qwen3 for the blocks;
                          the block families always use the library's Qwen3 DFlash layer, q/k normed)
    draft_vocab_size      default the verifier's vocabulary; smaller: a reduced vocabulary given by
    draft_token_ids       its sorted target ids (default 0 .. draft_vocab_size - 1, the library's fallback);
                          t2d / d2t built by the library's build_vocab_mappings_from_distribution
    target_layer_ids      aux hidden-state ids (hidden_states index: 0 = embedding, i + 1 = output of layer i);
                          default the library's [2, L // 2, L - 3]
    block_size (8), mask_token_id (required for dflash / dspark), sample_from_anchor (library default per family)
    markov_rank (256), markov_head_type ("vanilla"), enable_confidence_head (true), confidence_head_with_markov (true)
    norm_before_residual, norm_before_fc, fc_norm, norm_output, embed_requires_grad (eagle3; default false)
    seed (0)

`forward` loads DRAFT_DIR with the family's `from_pretrained` (attention "eager", or IN.pt's attn_implementation),
checks that embed_tokens / lm_head / verifier_lm_head / verifier_norm are the verifier's, runs the model's training
forward on IN.pt, backpropagates the loss and saves OUT.pt. IN.pt keys:
    hidden_states [1, T, K*H], input_ids [1, T] long, loss_mask [1, T], verifier_last_hidden_states [1, T, H]
        (the last layer's output before the final norm: the model applies verifier_norm itself)
    document_ids [1, T] long (default zeros; -1 = padding), position_ids [1, T] long (default: the library's,
        arange(T) for the block families, 1 + arange(T) for eagle3)
    loss_fn: a name of losses/utils.py (kl_div, rkl, jsd, ce, tv, nla, lk_hybrid) or a JSON {name: weight}
        (default "kl_div"; always the eager implementations: the library's default is a Triton kernel)
    dflash / dspark: anchors [A] long (default: every valid position, sorted; given anchors must be ones the
        library could pick: loss_mask 1 and a < T - block_size), gamma (4.0), per_position_loss_weight
        ("fixed-exp-decay" | "dpace"), dpace_alpha (0.5); dspark: confidence_head_alpha (1.0)
    eagle3: ttt_steps (3), ttt_step_loss_decay (1.0)
    attn_implementation ("eager" | "sdpa"), seed (0)
OUT.pt keys: loss (scalar), metrics {name: tensor}, grads {name: fp32 tensor, every trainable parameter}, trainable
[names], and
    dflash / dspark: anchors [A], logits [A*bs, Vd] (what the loss sees; dspark: with the Markov bias),
        targets [A*bs, Vd] (teacher logits), loss_mask [A*bs] (aligned, anchor slot zeroed for dflash);
        dspark also base_logits [A*bs, Vd] (lm_head output, before the bias) and confidence_logits [A*bs]
    eagle3: logits [P, T, Vd] (step d's logits, unaligned: position i predicts token i + d + 1), targets [T, Vd],
        step_losses [P], draft_tokens [P, T], loss_mask [T] (as given)

`convert-dflash` runs the library's DFlashConverter on a z-lab-format DFlash checkpoint (validate on) and prints
{"saved": [...]}.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import torch  # noqa: E402

FAMILIES = ("eagle3", "dflash", "dspark")


def fail(msg: str):
    raise SystemExit(f"speculators_oracle: {msg}")


def model_class(family: str):
    from speculators.models import DFlashDraftModel, DSparkDraftModel, Eagle3DraftModel
    classes = {"eagle3": Eagle3DraftModel, "dflash": DFlashDraftModel, "dspark": DSparkDraftModel}
    if family not in classes:
        fail(f"FAMILY={family!r}: expected one of {FAMILIES}")
    return classes[family]


def read_spec(text: str) -> dict:
    if not text.lstrip().startswith("{"):
        with open(text) as f:
            text = f.read()
    spec = json.loads(text)
    if not isinstance(spec, dict) or "verifier" not in spec:
        fail("--spec: expected a JSON object with at least 'verifier' (an HF checkpoint folder)")
    if os.path.isdir(spec["verifier"]):  # the config records it: absolute, so the draft loads from anywhere
        spec["verifier"] = os.path.abspath(spec["verifier"])
    return spec


# ---------------------------------------------------------------------------------------------------------- create
def layer_config(family: str, spec: dict):
    """The draft decoder's transformers config, built as the library's training CLI builds it (all layers full
    attention), then the shape fields of the spec set on it."""
    from speculators.train.cli import create_transformer_layer_config
    num_layers = int(spec.get("num_layers", 1))
    arch = spec.get("draft_arch", "llama" if family == "eagle3" else "qwen3")
    cfg = create_transformer_layer_config(spec["verifier"], num_layers, arch, None, sliding_window=2048,
                                          full_attention_indices=list(range(num_layers)))
    if "hidden_size" in spec and spec["hidden_size"] != cfg.hidden_size:
        fail(f"--spec hidden_size={spec['hidden_size']}: expected the verifier's {cfg.hidden_size}")
    for key in ("num_attention_heads", "num_key_value_heads", "head_dim", "intermediate_size", "rms_norm_eps"):
        if key in spec:
            setattr(cfg, key, spec[key])
    if "rope_theta" in spec:
        cfg.rope_parameters = {"rope_type": "default", "rope_theta": float(spec["rope_theta"])}
    return cfg


def vocab_maps(spec: dict, target_vocab: int):
    """(d2t, t2d) for a reduced draft vocabulary, or (None, None)."""
    from speculators.train.vocab_mapping import build_vocab_mappings_from_distribution
    n = int(spec.get("draft_vocab_size", target_vocab))
    if n == target_vocab:
        return None, None
    ids = spec.get("draft_token_ids", list(range(n)))
    if len(ids) != n or len(set(ids)) != n or min(ids) < 0 or max(ids) >= target_vocab:
        fail(f"--spec draft_token_ids: expected {n} distinct ids in [0, {target_vocab})")
    return build_vocab_mappings_from_distribution({int(i): 1 for i in ids}, n, target_vocab)


def training_args(family: str, spec: dict, target_vocab: int) -> dict:
    kw = dict(verifier_name_or_path=spec["verifier"], draft_vocab_size=int(spec.get("draft_vocab_size", target_vocab)),
              target_layer_ids=spec.get("target_layer_ids"), draft_attn_impl="eager")
    if family == "eagle3":
        kw.update(ttt_steps=int(spec.get("ttt_steps", 3)), norm_before_residual=bool(spec.get("norm_before_residual",
                  False)))
        for key in ("norm_before_fc", "fc_norm", "norm_output", "embed_requires_grad"):
            kw[key] = bool(spec.get(key, False))
        return kw
    if spec.get("mask_token_id") is None:
        fail(f"--spec mask_token_id: required for {family}")
    kw.update(block_size=int(spec.get("block_size", 8)), mask_token_id=int(spec["mask_token_id"]),
              sample_from_anchor=spec.get("sample_from_anchor"))
    if family == "dspark":
        for key in ("markov_rank", "markov_head_type", "enable_confidence_head", "confidence_head_with_markov"):
            if key in spec:
                kw[key] = spec[key]
    return kw


@torch.no_grad()
def randomize(model, seed: int) -> list:
    """Every trainable parameter to random values: norm gains 1 + 0.1 N(0, 1), other vectors 0.1 N(0, 1),
    matrices N(0, 1 / fan_in). Returns the trainable names."""
    gen = torch.Generator().manual_seed(seed)
    names = []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        names.append(name)
        noise = torch.randn(p.shape, generator=gen, dtype=torch.float32)
        if p.dim() == 1:
            p.copy_(1 + 0.1 * noise if "norm" in name else 0.1 * noise)
        else:
            p.copy_(noise / p.shape[-1] ** 0.5)
    return names


def cmd_create(family: str, out_dir: str, spec_text: str):
    from safetensors import safe_open
    spec = read_spec(spec_text)
    cls = model_class(family)
    seed = int(spec.get("seed", 0))
    torch.manual_seed(seed)
    cfg = layer_config(family, spec)
    d2t, t2d = vocab_maps(spec, cfg.vocab_size)
    model = cls.from_training_args(cfg, t2d=t2d, d2t=d2t, **training_args(family, spec, cfg.vocab_size)).float()
    trainable = randomize(model, seed)
    model.save_pretrained(out_dir)
    with safe_open(os.path.join(out_dir, "model.safetensors"), framework="pt") as f:
        saved = sorted(f.keys())
    left_out = sorted(set(model.state_dict()) - set(saved))
    print(json.dumps({"saved": saved, "left_out": left_out, "trainable": trainable}))


# --------------------------------------------------------------------------------------------------------- forward
def load(family: str, draft_dir: str, attn: str):
    cls = model_class(family)
    config = cls.config_class.from_pretrained(draft_dir)
    config.transformer_layer_config._attn_implementation = attn  # never serialized: the CLI sets it the same way
    model = cls.from_pretrained(draft_dir, config=config).float()
    check_verifier_weights(model)
    return model


def check_verifier_weights(model):
    """embed_tokens, lm_head (a block draft's full vocabulary: the library never saves it), verifier_lm_head and
    verifier_norm equal the verifier's. An EAGLE-3 file holds its own lm_head, read from the file as it is."""
    from speculators.utils.loading import load_model_layers
    path = model.config.speculators_config.verifier.name_or_path
    w = load_model_layers(["embed_tokens.weight", "lm_head.weight", "model.norm.weight"], path)
    head = w.get("lm_head.weight", w["embed_tokens.weight"]).float()
    if model.use_draft_vocab:
        head = head[model.t2d.bool()]
    pairs = [("embed_tokens", model.embed_tokens.weight, w["embed_tokens.weight"]),
             ("verifier_lm_head", model.verifier_lm_head.weight, head),
             ("verifier_norm", model.verifier_norm.weight, w["model.norm.weight"])]
    if not model.use_draft_vocab and model.config.speculators_model_type != "eagle3":
        pairs.append(("lm_head", model.lm_head.weight, head))
    for name, got, want in pairs:
        if not torch.equal(got.float(), want.float()):
            fail(f"{name} of the loaded draft is not the verifier's ({path})")


def loss_config(spec):
    from speculators.losses import resolve_loss_config
    return resolve_loss_config(spec if isinstance(spec, str) else json.dumps(spec), "eager")


def tensor(inp: dict, key: str, shape_len: int, dtype=None, default=None):
    if key not in inp:
        if default is None:
            fail(f"IN.pt: missing {key!r}")
        return default
    t = torch.as_tensor(inp[key])
    if t.dim() != shape_len or t.shape[0] != 1:
        fail(f"IN.pt {key}: expected a [1, ...] tensor of {shape_len} dims, got {tuple(t.shape)}")
    return t.to(dtype) if dtype is not None else t


def batch(inp: dict) -> dict:
    ids = tensor(inp, "input_ids", 2, torch.long)
    T = ids.shape[1]
    b = dict(hidden_states=tensor(inp, "hidden_states", 3, torch.float32), input_ids=ids,
             loss_mask=tensor(inp, "loss_mask", 2).bool(),
             verifier_last_hidden_states=tensor(inp, "verifier_last_hidden_states", 3, torch.float32),
             document_ids=tensor(inp, "document_ids", 2, torch.long, torch.zeros(1, T, dtype=torch.long)))
    if "position_ids" in inp:
        b["position_ids"] = tensor(inp, "position_ids", 2, torch.long)
    for key, t in b.items():
        if t.shape[1] != T:
            fail(f"IN.pt {key}: expected length T={T} (input_ids'), got {tuple(t.shape)}")
    return b


def grads(model, trainable) -> dict:
    out = {}
    for name, p in model.named_parameters():
        if name in trainable and p.grad is not None:
            out[name] = p.grad.detach().float().clone()
    return out


def floats(metrics: dict) -> dict:
    return {k: torch.as_tensor(v).detach().float().clone() for k, v in metrics.items()}


def forward_block(family: str, model, inp: dict, b: dict) -> dict:
    import speculators.models.dflash.core as dcore
    import speculators.models.dspark.core as score
    from speculators.models.dflash.utils import select_anchors
    bs = model.block_size
    T = b["input_ids"].shape[1]
    valid = b["loss_mask"].bool().clone()
    valid[:, -bs:] = False  # select_anchors' rule: the last block_size positions are never anchors
    if "anchors" in inp:
        anchors = torch.as_tensor(inp["anchors"], dtype=torch.long).view(-1)
        if anchors.numel() == 0 or anchors.min() < 0 or anchors.max() >= T or not valid[0, anchors].all():
            fail(f"IN.pt anchors: expected positions a with loss_mask[a] = 1 and 0 <= a < T - block_size = {T - bs}")
    else:
        anchors = valid[0].nonzero().view(-1)
        if anchors.numel() == 0:
            fail("IN.pt loss_mask: no valid anchor (loss_mask 1 before the last block_size positions)")
    seen = {}

    def fixed_anchors(loss_mask, num_anchors, block_size):
        if num_anchors != anchors.numel():
            fail(f"internal: max_anchors {num_anchors} != {anchors.numel()} anchors")
        seen["anchors"] = anchors.clone()
        return anchors.clone(), torch.ones(num_anchors, dtype=torch.bool)

    mod = dcore if family == "dflash" else score  # compute_metrics as each family's forward calls it
    inner = mod.compute_metrics

    def capture(logits, targets, *rest, **kw):
        if family == "dspark":
            seen.update(logits=logits, targets=targets, confidence_logits=rest[0], loss_mask=rest[1])
        else:
            seen.update(logits=logits, targets=targets, loss_mask=rest[0])
        return inner(logits, targets, *rest, **kw)

    hook = model.lm_head.register_forward_hook(lambda m, i, o: seen.__setitem__("base_logits", o))
    dcore.select_anchors, mod.compute_metrics = fixed_anchors, capture
    try:
        kw = dict(loss_config=loss_config(inp.get("loss_fn", "kl_div")), gamma=float(inp.get("gamma", 4.0)),
                  max_anchors=int(anchors.numel()),
                  per_position_loss_weight=inp.get("per_position_loss_weight", "fixed-exp-decay"),
                  dpace_alpha=float(inp.get("dpace_alpha", 0.5)))
        if family == "dspark":
            kw.update(tv_loss_fn=loss_config("tv")["tv"][0],
                      confidence_head_alpha=float(inp.get("confidence_head_alpha", 1.0)))
        _, loss, metrics = model(**b, **kw)
    finally:
        dcore.select_anchors, mod.compute_metrics = select_anchors, inner
        hook.remove()
    out = dict(loss=loss, metrics=metrics, anchors=seen["anchors"], logits=seen["logits"][0],
               targets=seen["targets"][0], loss_mask=seen["loss_mask"][0])
    if family == "dspark":
        out["base_logits"] = seen["base_logits"][0]
        if seen["confidence_logits"] is not None:
            out["confidence_logits"] = seen["confidence_logits"][0]
    return out


def forward_eagle3(model, inp: dict, b: dict) -> dict:
    import speculators.models.eagle3.core as ecore
    inner, steps = ecore.compute_metrics, []

    def capture(logits, targets, loss_mask, prev_correct, ttt_step, *rest, **kw):
        loss, metrics = inner(logits, targets, loss_mask, prev_correct, ttt_step, *rest, **kw)
        steps.append(dict(logits=logits[0], targets=targets[0], loss=loss))
        return loss, metrics

    ecore.compute_metrics = capture
    try:
        draft_tokens, loss, metrics = model(**b, ttt_steps=int(inp.get("ttt_steps", 3)),
                                            ttt_step_loss_decay=float(inp.get("ttt_step_loss_decay", 1.0)),
                                            loss_config=loss_config(inp.get("loss_fn", "kl_div")))
    finally:
        ecore.compute_metrics = inner
    return dict(loss=loss, metrics=metrics, logits=torch.stack([s["logits"] for s in steps]),
                targets=steps[0]["targets"], step_losses=torch.stack([s["loss"] for s in steps]),
                draft_tokens=torch.cat(draft_tokens), loss_mask=b["loss_mask"][0])


def cmd_forward(family: str, draft_dir: str, in_path: str, out_path: str):
    inp = torch.load(in_path, weights_only=True)
    attn = inp.get("attn_implementation", "eager")
    if attn not in ("eager", "sdpa"):
        fail(f"IN.pt attn_implementation={attn!r}: expected 'eager' or 'sdpa'")
    torch.manual_seed(int(inp.get("seed", 0)))
    model = load(family, draft_dir, attn)
    model.train()
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    model.zero_grad(set_to_none=True)
    b = batch(inp)
    out = forward_eagle3(model, inp, b) if family == "eagle3" else forward_block(family, model, inp, b)
    out["loss"].backward()
    res = {k: (v.detach().float().clone() if torch.is_tensor(v) and v.is_floating_point() else v)
           for k, v in out.items() if k != "metrics"}
    res.update(metrics=floats(out["metrics"]), grads=grads(model, trainable), trainable=trainable)
    torch.save(res, out_path)
    print(json.dumps({"loss": float(out["loss"].detach()), "grads": len(res["grads"]), "trainable": len(trainable)}))


# --------------------------------------------------------------------------------------------------- convert-dflash
def cmd_convert_dflash(zlab_dir: str, out_dir: str, verifier_dir: str, aux_ids: str | None):
    from safetensors import safe_open
    from speculators.convert.dflash.converter import DFlashConverter
    DFlashConverter().convert(zlab_dir, out_dir, base_model=verifier_dir, validate=True,
                              aux_hidden_state_layer_ids=json.loads(aux_ids) if aux_ids else None)
    with safe_open(os.path.join(out_dir, "model.safetensors"), framework="pt") as f:
        print(json.dumps({"saved": sorted(f.keys())}))


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="command", required=True)
    c = sub.add_parser("create")
    c.add_argument("family"), c.add_argument("out_dir"), c.add_argument("--spec", required=True)
    f = sub.add_parser("forward")
    for a in ("family", "draft_dir", "in_pt", "out_pt"):
        f.add_argument(a)
    v = sub.add_parser("convert-dflash")
    for a in ("zlab_dir", "out_dir", "verifier_dir"):
        v.add_argument(a)
    v.add_argument("--aux-layer-ids", default=None, help="JSON list: aux_hidden_state_layer_ids (default: derived)")
    a = p.parse_args(argv)
    torch.set_default_dtype(torch.float32)
    if a.command == "create":
        cmd_create(a.family, a.out_dir, a.spec)
    elif a.command == "forward":
        model_class(a.family)
        cmd_forward(a.family, a.draft_dir, a.in_pt, a.out_pt)
    else:
        cmd_convert_dflash(a.zlab_dir, a.out_dir, a.verifier_dir, a.aux_layer_ids)


if __name__ == "__main__":
    sys.exit(main())
