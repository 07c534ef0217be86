"""Nothing in the RL step grows with tokens x vocabulary. One whole RL step in HF mode (train.py --steps=1 on a random
Qwen3 at Qwen's vocabulary V = 151936: the draft warm-up, the step's rollouts and reference log-probs, the update with
every draft arm, the offline-extended control's sampling and training, the evals of every arm) runs under a recorder of
every op's outputs (a TorchDispatchMode), which keeps the largest tensor with a dimension of size V. The LM head and
what is shaped like it -- its gradient, optimizer state, W / tau, the draft's full-vocabulary head -- (V, H) in all
runs alike, are set aside: they grow with V, not with tokens. Run twice, at a small --chunk_mib so that the byte
budget binds in both (6 rows of logits per chunk), the second with ~4x the tokens: prompts ~2x longer, responses 2x
longer, groups 2x larger. The largest vocabulary-sized tensor must not grow: prefill forms logits at one position per
row, the reference, the update and the warm-ups stream their logits through the LM head chunk by chunk, and generation
runs --rollout_batch rows at a time.

~25 s in a full-suite run on 2 cores (73 s on a loaded machine: most of it the two runs, ~10 s building the random
Qwen3 checkpoint).
"""
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from harness import report
from harness.config import parse_args
from hf_util import write_jsonl, write_tiny_qwen3
from train import train

V, H = 151936, 32
WORDS = "What is + ? 0 1 2 3 4 5".split()


class VocabRecorder(TorchDispatchMode):
    """The largest output (numel) of any op with a dimension of size V, (V, H)-shaped ones aside."""

    def __init__(self):
        super().__init__()
        self.numel, self.shape, self.op = 0, None, None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if (isinstance(t, torch.Tensor) and V in t.shape and t.numel() > self.numel
                    and tuple(t.shape) not in ((V, H), (H, V))):
                self.numel, self.shape, self.op = t.numel(), tuple(t.shape), str(func)
        return out


@pytest.fixture(scope="module")
def qwen(tmp_path_factory):
    return str(write_tiny_qwen3(tmp_path_factory.mktemp("qwen") / "qwen3", WORDS))


def one_step(model, tmp_path, name, *, repeat: int, new_tokens: int, group: int) -> VocabRecorder:
    """train.py --steps=1 under the recorder; prompts 'What is a + b (+ a + b)* ?', repeat terms."""
    rows = [{"prompt": "What is " + " + ".join([str(a), str(b)] * repeat) + " ?", "answer": a + b}
            for a in range(3) for b in range(3)]
    data = write_jsonl(tmp_path / f"{name}.jsonl", rows)
    cfg = parse_args(["--preset", "test", "--model", model, "--data", data, "--eval_fraction=0.3", "--steps=1",
                      f"--max_new_tokens={new_tokens}", f"--group_size={group}", "--rollout_batch=4",
                      "--chunk_mib=4", "--warmup_threads=1", "--draft_warmup_steps=1", "--draft_warmup_batch=2",
                      "--draft_warmup_pool=4", "--updates=1", "--micro_batches=1", "--eval_samples=1",
                      "--cold_arm=false",  # the cold arm runs the co-trained arm's code: the time, not the coverage
                      "--cache_dir", str(tmp_path / f"cache_{name}"),
                      "--out", str(tmp_path / f"run_{name}")])
    rec = VocabRecorder()
    with rec:
        summary = train(cfg)
    assert summary["steps"] == 1
    return rec


def test_the_largest_vocabulary_sized_tensor_does_not_grow_with_the_steps_tokens(qwen, tmp_path, monkeypatch):
    monkeypatch.setattr(report, "plot_run", lambda *a, **k: None)  # train.png: matplotlib's seconds, no tensors
    small = one_step(qwen, tmp_path, "small", repeat=1, new_tokens=6, group=2)  # 4 rows of 6 + 6 tokens
    big = one_step(qwen, tmp_path, "big", repeat=2, new_tokens=12, group=4)  # 8 rows of 10 + 12 tokens: 3.7x
    print(f"largest (.., V) tensor: small {small.shape} ({small.op}), big {big.shape} ({big.op})")
    assert small.numel > 0
    assert big.numel <= small.numel, (f"a vocabulary-sized tensor grew with the tokens: {small.shape} from "
                                      f"{small.op} -> {big.shape} from {big.op}")
