"""The memory plan (harness/memory_model.py) against what a real step allocates (harness/memory_track.py).

Seven runs at reduced size, each one real RL step of train.py's phases (harness/rollout.rollout, harness/update.update;
the warm-ups at a few steps, cached per test): the built-in task in fp32 with every control arm; HF mode on a random
Qwen3 at V = 151936 (the LM head streamed 6 rows at a time), in fp32 and in bf16; bf16 with
--activation_checkpointing; a DFlash and a DSpark draft; and pp 2 x cp 2 with --zero1 on 4 gloo processes (each rank
checks its own stage). Every component the plan names is compared with the tracker's count of the same thing:
persistent state by walking the objects (weights, grads, optimizer, each copy, the drafts' optimizers, TapChannel's
slots), the KV caches at their largest (SpecStats.kv_peak_bytes), and the phases' transient peaks (the update's split
into the policy's and the drafts' saved tensors, vocabulary-sized blocks and the rest) -- each within 15% (components
under 1 KiB in both are too small to compare), the total within 10%. RSS growth over the step is printed beside it,
never asserted.

    python -m pytest -q -s tests/test_memory_plan.py      # -s prints the plan-vs-measured tables (docs/memory.md)

Seconds added (pytest --durations, 2 shared cores, two runs): fp32 4-5 s, bf16 3 s, V = 151936 7-15 s, pp 2 x cp 2
22-32 s; the plan command and --zero1=auto < 1 s; the prefill term against speculative.prefill 15-20 s; 60-70 s in
all. The block families' steps (DFlash, DSpark): ~2 s each; V = 151936 in bf16 ~5 s.
"""
from __future__ import annotations

import sys

import pytest
import torch

from harness import memory_model as mm
from harness import memory_track as mt
from harness.config import parse_args
from harness.experiment import build
from harness.mesh import Mesh
from harness.rollout import rollout
from harness.update import update
from modeling.layers import rope_cos_sin
from parallel.grid import Grid

COMPONENT_TOL, TOTAL_TOL, SMALL = 0.15, 0.10, 1024
BY_VOCAB = ("verify_logits", "logits_chunks", "head_buffers")  # told apart by a dimension of size V: only at a V no
# other dimension has (the tiny presets' V = 18 is also a token count); they are in the phase peaks at every V
DRAFT_FILES = ("draft_ttt.py", "draft_loss.py", "draft.py", "draft_block.py", "draft_dflash.py", "draft_dspark.py")
POLICY_FILES = ("model.py",)  # the policy's forward (its layers and attention run below it; backward does not)


def classifier(m):
    """head for (V, H)-shaped tensors, kv / logits by shape (memory_track.vocab_classifier), else "draft" for what
    the drafts' code makes and "policy" for what the policy's forward makes (what it saves for backward)."""
    by_shape = mt.vocab_classifier(m.vocab_size, m.hidden_size, m.num_key_value_heads, m.head_dim)

    def classify(t):
        if tuple(t.shape) in ((m.vocab_size, m.hidden_size), (m.hidden_size, m.vocab_size)):
            return "head"
        cat = by_shape(t)
        if cat is None:
            f, policy = sys._getframe(2), False
            while f is not None:
                if f.f_code.co_filename.endswith(DRAFT_FILES):
                    return "draft"
                policy = policy or f.f_code.co_filename.endswith(POLICY_FILES)
                f = f.f_back
            return "policy" if policy else None
        return cat
    return classify


def lengths(batch, tokens: int, cfg, mesh) -> tuple:
    """(tokens per sequence of the update's largest micro-batch, and of this rank's rollout rows: the longest prompt,
    the longest response, the mean sequence) -- what the plan is for: its micro-batches are alike, the step's differ,
    and its peak is the largest's. tokens: that micro-batch's tokens on one CP rank."""
    cu = batch.cu_seqlens.tolist()
    rows = [r for _, block in mesh.blocks(batch.num_seqs, cfg.rollout_batch) for r in block]
    resp = [int(batch.resp_mask[cu[r]:cu[r + 1]].sum()) for r in rows]
    n = [cu[r + 1] - cu[r] for r in rows]
    seqs = cfg.prompts_per_step * cfg.group_size / cfg.updates / cfg.micro_batches
    return tokens * mesh.grid.cp / seqs, max(a - b for a, b in zip(n, resp)), max(resp), sum(n) / len(n)


class LargestMicrobatch:
    """Records the most tokens a micro-batch of PipelineSchedule.step holds on this rank."""

    def __enter__(self):
        from pipeline import PipelineSchedule
        self.tokens, self.cls, self.step = 0, PipelineSchedule, PipelineSchedule.step

        def step(sched, mbs, *a, **k):
            mbs = list(mbs)
            self.tokens = max([self.tokens] + [mb.tokens.shape[0] for mb in mbs])
            return self.step(sched, mbs, *a, **k)
        PipelineSchedule.step = step
        return self

    def __exit__(self, *exc):
        self.cls.step = self.step


def measure(s, mesh) -> tuple:
    """One RL step under the trackers -> (measured components, the lengths the plan needs, RSS growth)."""
    m, rss0 = s.policy.cfg, mt.rss_bytes()
    dt = next(s.policy.parameters()).dtype  # the RoPE table, built once per process at the first forward (rank 0
    rope_cos_sin(torch.zeros(1, dtype=torch.long), m.head_dim, m.rope_theta, dt, bound=m.max_position_embeddings)
    # builds it in the warm-ups): its one-time fp64 construction is not a step's memory
    problems = s.task.sample(s.cfg.prompts_per_step, s.rng)
    with mt.kv_peaks() as kv, mt.StorageTracker(classifier(m)) as roll:
        batch, _ = rollout(s, mesh, problems, {})
    offline, s.offline = s.offline, None  # the control's own step is timed and sized apart
    with mt.StorageTracker(classifier(m)) as upd, LargestMicrobatch() as largest:
        update(s, batch, {})
    s.offline = offline
    if offline is not None:
        offline.step()
    out = mt.held(s)
    out["kv_cache"] = max(kv.peaks)
    out["rollout_peak"], out["update_peak"] = roll.peak(), upd.peak()
    out["draft_activations"], out["logits_chunks"] = upd.peak("draft"), upd.peak("logits")
    out["activations"] = upd.peak("policy")
    out["head_buffers"], out["verify_logits"] = upd.peak("head"), roll.peak("logits")
    out["persistent"] = sum(v for k, v in out.items() if k in mt.held(s))
    out["total"] = out["persistent"] + max(out["rollout_peak"], out["update_peak"])
    return out, lengths(batch, largest.tokens, s.cfg, mesh), mt.rss_bytes() - rss0


def compare(cfg, s, grid, measured, lens, rss, rank0=True, over=None) -> list:
    """The plan for this rank beside the measurement: a printed table, and the rows outside their tolerance. over:
    {component: r} planned conservatively: between the measurement and r times it."""
    run = mm.Run(s.policy.cfg, pp=grid.pp, cp=grid.cp, dp=grid.dp, seq=lens[0], prompt=lens[1],
                 rollout_seq=lens[3], dtype="bf16" if next(s.policy.parameters()).dtype == torch.bfloat16 else "fp32")
    plan = mm.rank_plan(cfg, run, grid.pp_rank, rank0=rank0, max_new_tokens=s.task.max_new_tokens,
                        longest_new=lens[2])
    bad, rows = [], [f"{cfg.name} stage {grid.pp_rank} (RSS growth over the step {rss / 2**20:.1f} MiB)"]
    for key, got in measured.items():
        if key in BY_VOCAB and s.policy.cfg.vocab_size < 1000:
            continue
        want = plan.get(key, 0)  # stray_grads: none planned
        tol = TOTAL_TOL if key == "total" else COMPONENT_TOL
        ok = max(want, got) < SMALL or abs(want - got) <= tol * max(got, 1)
        if over and key in over:
            ok = got <= want <= over[key] * got
        rows.append(f"  {key:18s} plan {want:11.0f}  measured {got:11.0f}  {want / max(got, 1):6.3f}"
                    f"{'' if ok else '  <-- outside'}")
        if not ok:
            bad.append(f"{key}: plan {want} vs measured {got}")
    rows.append("  plan only: " + ", ".join(f"{k} {v:.0f}" for k, v in plan.items() if k not in measured))
    print("\n".join(rows), flush=True)
    return bad


def one_process(tmp_path, argv, over=None) -> list:
    cfg = parse_args(["--preset", "test", "--cache_dir", str(tmp_path / "cache"), "--out", str(tmp_path / "out"),
                      "--warmup_threads=1", "--steps=1"] + argv)
    mesh = Mesh(Grid(), torch.device("cpu"))
    s = build(cfg, mesh, log=lambda *a, **k: None)
    measured, lens, rss = measure(s, mesh)
    return compare(cfg, s, mesh.grid, measured, lens, rss, over=over)


def test_plan_matches_a_fp32_step_with_every_arm(tmp_path, one_thread):
    assert one_process(tmp_path, ["--name=fp32"]) == []


@pytest.mark.parametrize("family", ["dflash", "dspark"])
def test_plan_matches_a_block_draft_step(tmp_path, one_thread, family):
    """A block family's draft: its copies and optimizer (DSpark's Markov head included), its KV cache (L_d layers,
    room for a block) and the anchors' blocks it saves for backward. The rollout's peak is planned over what it is
    (the prefill's term is EAGLE-3's, whose draft holds the taps through its trunk): measured 1.22x on this preset."""
    assert one_process(tmp_path, [f"--name={family}", f"--drafter={family}", "--offline_arm=false"],
                       over={"rollout_peak": 1.3}) == []


def test_plan_matches_a_bf16_step_with_activation_checkpointing(tmp_path, one_thread):
    assert one_process(tmp_path, ["--name=bf16_ac", "--dtype=bf16", "--activation_checkpointing",
                                  "--offline_arm=false"]) == []


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])  # bf16: the LM head's dW straight into .main_grad
def test_plan_matches_a_step_at_qwen_vocabulary(tmp_path, one_thread, dtype):
    from hf_util import write_jsonl, write_tiny_qwen3
    qwen = write_tiny_qwen3(tmp_path / "qwen3", "What is + ? 0 1 2 3 4 5".split())
    rows = [{"prompt": f"What is {a} + {b} ?", "answer": a + b} for a in range(3) for b in range(3)]
    data = write_jsonl(tmp_path / "p.jsonl", rows)
    assert one_process(tmp_path, ["--name=qwen_vocab", "--model", str(qwen), "--data", str(data), f"--dtype={dtype}",
                                  "--eval_fraction=0.3", "--max_new_tokens=6", "--rollout_batch=4", "--chunk_mib=4",
                                  "--draft_warmup_steps=1", "--draft_warmup_batch=2", "--draft_warmup_pool=4",
                                  "--cold_arm=false"]) == []


def _dist_rank(rank, world, tmp):
    """One rank of the pp 2 x cp 2 --zero1 run: build (rank 0 first), measure, compare its own stage."""
    from parallel.waits import set_timeout
    set_timeout(120)
    cfg = parse_args(["--preset", "test", "--name=pp2cp2_zero1", "--cache_dir", f"{tmp}/cache", "--out",
                      f"{tmp}/out", "--warmup_threads=1", "--steps=1", "--pp=2", "--cp=2", "--zero1",
                      "--rollout_batch=2", "--offline_arm=false", "--micro_batches=1"])
    mesh = Mesh(Grid.build(pp=2, cp=2, dp=1), torch.device("cpu"), rank, world)
    s = build(cfg, mesh, log=lambda *a, **k: None)
    measured, lens, rss = measure(s, mesh)
    return compare(cfg, s, mesh.grid, measured, lens, rss, rank0=rank == 0)


def test_plan_matches_each_rank_of_a_pp2_cp2_zero1_step(tmp_path):
    from dist_util import run_distributed
    results = run_distributed(_dist_rank, world_size=4, args=(str(tmp_path),), timeout=300)
    assert [row for rows in results for row in rows] == []


def test_zero1_auto_is_on_only_on_cuda_where_the_plan_needs_it():  # 0.1 s
    from types import SimpleNamespace as Mesh3
    from model import ModelConfig
    cfg, m = parse_args(["--preset", "test", "--zero1=auto"]), ModelConfig.preset("tiny")
    assert cfg.zero1 == "auto" and parse_args(["--zero1"]).zero1 is True and parse_args(["--zero1=0"]).zero1 is False
    with pytest.raises(ValueError, match="--zero1"):
        parse_args(["--zero1=maybe"])
    grid = Mesh3(pp=2, cp=2, dp=1)
    assert mm.resolve_zero1(cfg, m, grid, "cpu", 8, device_bytes=1) is False  # the CPU: off
    assert mm.resolve_zero1(cfg, m, grid, "cuda", 8, device_bytes=1) is True  # over the device without it: on
    assert mm.resolve_zero1(cfg, m, grid, "cuda", 8, device_bytes=2 ** 40) is False  # fits without it
    assert mm.resolve_zero1(cfg, m, Mesh3(pp=2, cp=1, dp=1), "cuda", 8, device_bytes=1) is False  # one rank a stage
    assert mm.resolve_zero1(parse_args(["--zero1"]), m, grid, "cpu", 8) is True  # as given


def test_plan_command_prints_every_stage_and_refuses_bad_meshes(capsys, tmp_path):  # 0.3 s
    from harness import memory_plan
    memory_plan.main(["--model", "tiny", "--gpus", "4", "--pp", "2", "--cp", "2", "--seq", "64",
                      "--max_new_tokens", "16", "--device_gib", "8", "--recommend"])  # 8: the CUDA context and NCCL fit
    out = capsys.readouterr().out
    assert "stage 1" in out and "largest rank" in out and ": fits" in out and "recommend (4 GPUs" in out
    with pytest.raises(ValueError, match="--gpus=8"):
        memory_plan.main(["--model", "tiny", "--gpus", "8", "--pp", "2", "--cp", "2", "--dp", "1"])
    with pytest.raises(ValueError, match="--model="):
        memory_plan.main(["--model", str(tmp_path / "nowhere.json")])
    with pytest.raises(ValueError, match="--seq=16"):
        memory_plan.main(["--model", "tiny", "--seq", "16", "--max_new_tokens", "16"])
    with pytest.raises(ValueError, match="--tap_layers=0,1: expected 3"):
        memory_plan.main(["--model", "tiny", "--tap_layers=0,1"])


@pytest.mark.parametrize("preset,P,scores_mib", [("tiny", 64, 256.0), ("tiny", 512, 256.0), ("tiny", 512, 0.25),
                                                 ("small", 256, 256.0)])
def test_prefill_term_matches_a_real_prefill(preset, P, scores_mib, monkeypatch):  # 3-6 s each
    """memory_model.prefill_bytes against the transient peak of speculative.prefill (the policy's forward over B = 2
    prompts with the draft's taps, then the draft's trunk), the KV caches aside (they survive the call): within 20%
    (it sums a layer's tensors that are not all alive at once), at one attention block over the whole prompt and at
    blocks of a few rows."""
    import modeling.layers as layers
    from draft import Eagle3Draft
    from model import ModelConfig, Transformer
    from speculative import prefill
    monkeypatch.setattr(layers, "CACHED_SCORES_MIB", scores_mib)
    monkeypatch.setattr(mm, "CACHED_SCORES_MIB", scores_mib)
    torch.manual_seed(0)
    policy = Transformer(ModelConfig.preset(preset, num_hidden_layers=4)).eval()
    draft = Eagle3Draft.from_target(policy)
    prompts = [torch.randint(policy.cfg.vocab_size, (P,)) for _ in range(2)]
    m = policy.cfg  # the RoPE table is built once per process, not per prefill (as in measure)
    rope_cos_sin(torch.zeros(1, dtype=torch.long), m.head_dim, m.rope_theta, torch.float32, bound=4096)
    with torch.no_grad(), mt.StorageTracker() as tr:
        state = prefill(policy, draft, prompts, 3, 1.0, None, 8, torch.Generator().manual_seed(0))  # caches alive
    want, got = mm.prefill_bytes(m, 2, P, len(draft.tap_layers), 4), tr.peak()
    del state
    print(f"prefill {preset} P={P} scores_mib={scores_mib}: plan {want} measured {got} ({want / got:.3f})")
    assert 0.9 * got <= want <= 1.25 * got, f"plan {want} vs measured {got} ({want / got:.3f})"
