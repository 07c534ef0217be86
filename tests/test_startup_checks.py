"""Start-up checks of the GPU path: what cannot run is refused in one line before any model is built, and what can is
made to run.

1. mesh.pick_device: each rank its own GPU or a one-line error naming LOCAL_RANK, LOCAL_WORLD_SIZE, the visible count
   and CUDA_VISIBLE_DEVICES (CUDA faked: pick_device reads counts only); mesh.shared_gpus names two ranks on one GPU.
2. --attn_backend flash / triton on this CPU: train.py ends in one line naming --attn_backend and the device before
   the build (a build reached fails the test); flash's own needs on CUDA (package, bf16, triton for a block drafter).
3. --attn_backend flash with a block drafter: DFlash's and DSpark's loss with backend="flash" (the anchor attention on
   Triton, in its interpreter here) equals backend="torch" in fp32, value and gradients, within 1e-5.

Adds ~3 s to the suite on 2 busy cores (2.4-2.9 s over two runs, ~2.2 s of it the interpreted Triton kernels of
part 3; `python -m pytest -q tests/test_startup_checks.py --durations=5`).
"""
import importlib.util
import os

import pytest
import torch

import train
from draft_block import anchor_backend
from draft_dflash import DFlashDraft
from draft_dspark import DSparkDraft
from harness.config import Config
from harness.mesh import pick_device, shared_gpus
from model import ModelConfig, Transformer
from parallel.cli import run_main

# the interpreted Triton kernel gives a query that sees no key lse = ln 2 * log2(0) = -inf by design; numpy warns
pytestmark = [pytest.mark.usefixtures("one_thread"),
              pytest.mark.filterwarnings("ignore:divide by zero encountered in log2:RuntimeWarning")]


# ------------------------------------------------------------------------------------ 1. a GPU for every rank
def fake_cuda(monkeypatch, gpus: int, local_rank: int, local_world: int, visible=None):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: gpus)
    monkeypatch.setenv("LOCAL_RANK", str(local_rank))
    monkeypatch.setenv("LOCAL_WORLD_SIZE", str(local_world))
    if visible is None:
        monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    else:
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)


@pytest.mark.parametrize("gpus, rank, world, visible, want", [
    (8, 3, 8, None, "cuda:3"),  # torchrun on a node: every process sees every GPU
    (8, 3, 4, None, "cuda:3"),  # fewer processes than GPUs
    (1, 5, 8, "5", "cuda:0"),  # SLURM --gpus-per-task=1: each process sees its own GPU as device 0
    (1, 0, 1, None, "cuda:0"),
])
def test_pick_device_gives_each_rank_its_own_gpu(monkeypatch, gpus, rank, world, visible, want):
    fake_cuda(monkeypatch, gpus, rank, world, visible)
    for device in ("auto", "cuda"):
        assert pick_device(Config(device=device)) == torch.device(want)
    assert pick_device(Config(device="cpu")) == torch.device("cpu")


@pytest.mark.parametrize("device", ["auto", "cuda"])
def test_a_rank_without_its_own_gpu_is_an_error_not_the_cpu(monkeypatch, device):
    """Was: --device auto fell back to the CPU without a word when LOCAL_WORLD_SIZE > the visible GPUs."""
    fake_cuda(monkeypatch, 2, 3, 8, visible="0,1")
    with pytest.raises(ValueError) as e:
        pick_device(Config(device=device))
    line = str(e.value)
    assert "\n" not in line and line.startswith(f"--device={device}: ")
    for part in ("LOCAL_RANK=3", "LOCAL_WORLD_SIZE=8", "sees 2 GPUs", "CUDA_VISIBLE_DEVICES=0,1", "--device cpu",
                 "bind one GPU to each process"):
        assert part in line, (part, line)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    with pytest.raises(ValueError, match=r"sees 2 GPUs, so not every rank"):
        pick_device(Config(device=device))


def test_the_cpu_on_purpose_or_without_cuda(monkeypatch):
    fake_cuda(monkeypatch, 2, 3, 8)
    assert pick_device(Config(device="cpu")) == torch.device("cpu")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert pick_device(Config(device="auto")) == torch.device("cpu")


def test_two_ranks_on_one_gpu_are_named():
    assert shared_gpus([("a", "GPU-1"), ("a", "GPU-2"), ("b", "GPU-1"), ("b", "GPU-2")]) is None
    line = shared_gpus([("a", "GPU-1"), ("a", "GPU-2"), ("a", "GPU-1")])
    assert line.startswith("--device: ranks 0, 2 on host a share one GPU (GPU-1)") and "--device cpu" in line


# ------------------------------------------------------------------------ 2. a backend the device cannot run
def ends_before_the_build(monkeypatch, capsys, argv) -> str:
    """train.py's main as `python train.py` runs it: exit 1, one line on stderr, and no model built. -> that line."""
    def build(*a, **k):
        pytest.fail(f"{argv}: the run reached the build (model load, warm-ups) instead of refusing at start")
    monkeypatch.setattr(train, "build", build)
    with pytest.raises(SystemExit) as e:
        run_main(train.main, train.__file__, argv)
    err = capsys.readouterr().err
    assert e.value.code == 1 and err.count("\n") == 1 and "Traceback" not in err, (e.value.code, err)
    return err.strip()


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")
@pytest.mark.parametrize("backend", ["flash", "triton"])
def test_a_gpu_backend_on_the_cpu_ends_at_start(monkeypatch, capsys, tmp_path, backend):
    """Was: the config check passed, and the run failed only at its first update, after the warm-ups."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)  # triton on the CPU: only in Triton's interpreter
    line = ends_before_the_build(monkeypatch, capsys, ["--preset=test", f"--attn_backend={backend}",
                                                        f"--out={tmp_path / 'run'}", f"--cache_dir={tmp_path / 'c'}"])
    assert line.startswith(f"train.py: --attn_backend={backend} with the models on cpu: needs a CUDA device")
    assert "--attn_backend torch" in line, line
    assert not (tmp_path / "c").exists() and not (tmp_path / "run").exists()


def test_what_each_backend_needs(monkeypatch):
    assert Config(attn_backend="torch").attn_backend_on("cpu") == "torch"
    assert Config().attn_backend_on("cpu") == "torch"  # auto picks
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # the interpreter runs triton's kernels on CPU tensors (the tests)
    if importlib.util.find_spec("triton") is not None:
        assert Config(attn_backend="triton").attn_backend_on("cpu") == "triton"
    with pytest.raises(ValueError, match=r"^--attn_backend=flash with the models on cuda:0: flash-attn takes "
                                         r"fp16/bf16 only, got --dtype=fp32"):
        Config(attn_backend="flash", dtype="fp32").attn_backend_on("cuda:0")
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "triton" else real(name, *a))
    with pytest.raises(ValueError, match=r"^--attn_backend=triton with the models on cuda:0: needs the triton"):
        Config(attn_backend="triton").attn_backend_on("cuda:0")
    with pytest.raises(ValueError, match=r"with --drafter dflash needs the triton package too"):
        Config(attn_backend="flash", drafter="dflash", num_draft_tokens=3).attn_backend_on("cuda:0")
    if importlib.util.find_spec("flash_attn") is None:  # flash-attn's own check speaks for it
        with pytest.raises(ValueError, match=r"^--attn_backend=flash with the models on cuda:0: backend=\"flash\" is "
                                             r"unavailable here; it needs the flash_attn package"):
            Config(attn_backend="flash").attn_backend_on("cuda:0")


# ------------------------------------------------------------------- 3. flash with a block drafter trains
def test_the_anchor_kernel_under_each_backend():
    assert [anchor_backend(b) for b in ("torch", "triton", "flash")] == ["torch", "triton", "triton"]


@pytest.fixture(scope="module")
def policy_batch():
    torch.manual_seed(0)
    policy = Transformer(ModelConfig.preset("tiny")).float().eval()
    seqs = [torch.randint(1, 97, (n,)) for n in (13, 9, 18)]
    tokens = torch.cat(seqs)
    cu = torch.tensor([0, 13, 22, 40], dtype=torch.int32)
    mask = torch.ones(len(tokens), dtype=torch.bool)
    mask[cu[1:].long() - 1] = False  # the last row of a sequence predicts nothing
    mask[:4] = False  # a prompt
    return policy, tokens, cu, mask


@pytest.mark.parametrize("family", [DFlashDraft, DSparkDraft])
def test_a_block_draft_trains_under_flash(policy_batch, family):
    """Was: backend="flash" raised in attention_cp.anchor_branch_attention at the first update. Now the anchor
    attention runs on Triton (TRITON_INTERPRET=1 here) and the loss equals the torch kernel's (fp32, 1e-5)."""
    pytest.importorskip("triton", reason="the triton package is not installed (pip install -e '.[test]')")
    policy, tokens, cu, mask = policy_batch
    torch.manual_seed(1)
    extra = {"markov_rank": 8} if family is DSparkDraft else {}
    draft = family.from_target(policy, mask_token_id=0, block_size=4, **extra)
    with torch.no_grad():
        out = policy(tokens, cu, tap_layers=draft.tap_layers)
    got = {}
    for backend in ("torch", "flash"):
        draft.zero_grad()
        loss, m = draft.loss(out.taps, tokens, cu, out.logits, loss_mask=mask, anchors=3, seed=5, backend=backend)
        loss.backward()
        got[backend] = (loss.detach(), [p.grad.clone() for p in draft.parameters()], m["count"])
    (l0, g0, c0), (l1, g1, c1) = got["torch"], got["flash"]
    assert c0 == c1 and c0[0] > 0
    assert torch.allclose(l1, l0, rtol=1e-5, atol=1e-5), (l1, l0)
    for a, b in zip(g1, g0):
        assert torch.allclose(a, b, rtol=1e-5, atol=1e-5), (a - b).abs().max()
