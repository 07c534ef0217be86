#!/usr/bin/env bash
# What a first real run does, on a lent GPU node, within 10 minutes (the stage limits below add up to 590 s):
#   1. the numerical tests first: tests/test_attention_gpu.py, the triton and flash kernels inside ring_branch_attention
#      against dense fp64 attention at Qwen3-8B's head shape (D = 128, G = 4), lengths past one tile and with
#      causal-skipped tiles, forward and backward, within twice the error of dense bf16 attention; and
#      tests/test_anchor_attention_triton.py, the block drafters' anchor kernels (per-row key ends) against fp64;
#   2. a random Qwen3 checkpoint at the real vocabulary (151,936 ids; a word-level tokenizer of that size, nothing
#      downloaded);
#   3. train.py in HF mode under torchrun over the node's GPUs -- pp x cp where there are several (NCCL: the pipeline,
#      TapChannel, the zigzag ring) -- for 2 RL steps, bf16, with --attn_backend=triton and --activation_checkpointing
#      (as the 8B plan runs), then the block drafter (--drafter=dflash: the anchor kernels) on triton, then the
#      block drafter with flash (the policy on flash-attn, the blocks' anchor attention on triton:
#      draft_block.anchor_backend); each run's summary.json checked (finite numbers; a field may be null only where
#      the run legitimately has none: kl_last without a reference model).
# One line per stage on stdout; a failure names its stage, a stage that runs out of time says so; flash-attn missing
# makes its stages "skipped", never "ok". The last line counts the stages ok / skipped / failed; the exit status is 0
# iff none failed. The output tails go to bench/results/gpu_smoke.md.
#
#   bash bench/gpu_smoke.sh                  # from the repository root, on a machine with one or more NVIDIA GPUs
#
# GPUs -> layout: >= 4 (a multiple of 4): pp=2 x cp=2 x dp=n/4; 2 or 3: pp=2 over 2 of them; 1: world size 1 (it says
# what that leaves unchecked). Dry run of the same stages on CPU (gloo, the torch kernel, a small vocabulary; the
# numerical stage runs the CPU kernel's fp32 and bf16 checks instead, since the GPU tests need CUDA):
#   SMOKE_DEVICE=cpu SMOKE_NPROC=4 SMOKE_VOCAB=2000 SMOKE_BACKENDS=torch bash bench/gpu_smoke.sh
# tests/test_gpu_smoke.py runs that dry run (1 process) in the suite. SMOKE_WORK (scratch, default
# /tmp/cospec_gpu_smoke) and SMOKE_REPORT (default bench/results/gpu_smoke.md) move the files.
# The kernel benchmarks stay separate: bench/bench_attention_gpu.py, bench/gpu_long_forward.py.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${SMOKE_REPORT:-bench/results/gpu_smoke.md}
WORK=${SMOKE_WORK:-/tmp/cospec_gpu_smoke}
DEVICE=${SMOKE_DEVICE:-cuda}
VOCAB=${SMOKE_VOCAB:-151936}  # Qwen3's
BACKENDS=${SMOKE_BACKENDS:-triton flash}
DRAFTERS=${SMOKE_DRAFTERS:-eagle3 dflash}  # with the first backend; the others train dflash only
# stage limits (s): versions, numerical tests, checkpoint, then per training run (the first one compiles the
# kernels, a longer limit) the run and its summary
L_VERSIONS=20 L_NUMERICS=150 L_CKPT=45 L_TRAIN_FIRST=150 L_TRAIN=100 L_SUMMARY=10
N_RUNS=$(( $(wc -w <<<"$DRAFTERS") + $(wc -w <<<"$BACKENDS") - 1 ))
TOTAL_S=$(( L_VERSIONS + L_NUMERICS + L_CKPT + L_TRAIN_FIRST - L_TRAIN + N_RUNS * (L_TRAIN + L_SUMMARY) ))
mkdir -p "$(dirname "$OUT")" "$WORK"
export PYTHONUNBUFFERED=1 TRITON_DEFAULT_FP_FUSION=1
unset TRITON_INTERPRET  # compiled kernels, not the CPU interpreter
OK=0 SKIPPED=0 FAILED=0
printf '# GPU smoke run\n\n%s on %s; commit %s\n\n' "$(date -u +%Y-%m-%dT%H:%M:%SZ)" "$(hostname)" \
  "$(git rev-parse --short HEAD 2>/dev/null || echo '?')" > "$OUT"

stage() {  # stage NAME SECONDS COMMAND...: one line on stdout; the command and its output tail in the report
  local name=$1 limit=$2 log t0 rc dt verdict
  shift 2
  log=$(mktemp)
  t0=$(date +%s)
  timeout --kill-after=10 "$limit" "$@" >"$log" 2>&1
  rc=$?
  dt=$(( $(date +%s) - t0 ))
  verdict=ok
  if [ $rc -eq 124 ] || [ $rc -eq 137 ]; then verdict="FAILED: stage '$name' ran out of its ${limit} s limit"
  elif [ $rc -ne 0 ]; then verdict="FAILED (exit $rc)"; fi
  if [ $rc -ne 0 ]; then FAILED=$((FAILED + 1)); else OK=$((OK + 1)); fi
  echo "[$name] $verdict in ${dt}s$( [ $rc -ne 0 ] && echo ": $(grep -v '^\s*$' "$log" | tail -n 1 | cut -c1-160)")"
  printf '## %s: %s (%s s)\n\n```\n$ %s\n%s\n```\n\n' "$name" "$verdict" "$dt" "$*" "$(tail -n 80 "$log")" >> "$OUT"
  LAST_LOG=$(tail -n 200 "$log")
  rm -f "$log"
  return $rc
}

note() {  # a line on stdout and in the report
  echo "$*"
  printf '%s\n\n' "$*" >> "$OUT"
}

skipped() {  # skipped WHAT WHY: a stage that did not run, counted as skipped (never as ok)
  SKIPPED=$((SKIPPED + 1))
  note "[$1] skipped: $2"
}

note "stage limits add up to ${TOTAL_S} s"

# ---------------------------------------------------------------------------------------------------- the machine
if [ "$DEVICE" = cuda ]; then
  NGPU=$(python -c "import torch; print(torch.cuda.device_count())" 2>/dev/null || echo 0)
else
  NGPU=${SMOKE_NPROC:-1}
fi
stage "versions" "$L_VERSIONS" python -c "
import platform, torch
print('python', platform.python_version(), 'torch', torch.__version__, 'cuda', torch.version.cuda)
if '$DEVICE' == 'cuda':
    assert torch.cuda.is_available(), 'CUDA is not available'
    print('devices', [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())])
for m in ('triton', 'flash_attn', 'transformers', 'tokenizers'):
    try:
        print(m, __import__(m).__version__)
    except ImportError as e:
        print(m, 'missing:', e)
" || { echo "no usable $DEVICE; stopping"; exit 1; }

# ------------------------------------------------------------------------------------------- the numerical tests
# The kernels against dense fp64 attention before anything trains on them: a wrong but finite kernel fails here.
if [ "$DEVICE" = cuda ]; then
  NUM_TESTS=(tests/test_attention_gpu.py tests/test_anchor_attention_triton.py)
else  # the GPU tests skip without CUDA: the torch kernel's fp32 and bf16 checks against fp64 instead
  NUM_TESTS=(tests/test_attention_cp.py -k "fp32_matches_dense_fp64 or bf16_runs_and_is_close")
fi
if stage "numerical tests: ${NUM_TESTS[*]}" "$L_NUMERICS" python -m pytest -q -rs -p no:cacheprovider "${NUM_TESTS[@]}"
then
  # pytest passes a run whose tests skipped: a skipped flash test is counted here as a skipped stage, not an ok one
  if grep -q "^SKIPPED.*flash" <<<"$LAST_LOG"; then
    skipped "numerical tests, flash backend" "flash-attn is not installed (the triton tests ran)"
  fi
  if [ "$DEVICE" = cuda ] && ! grep -qE "[0-9]+ passed" <<<"$LAST_LOG"; then
    FAILED=$((FAILED + 1)) OK=$((OK - 1))
    note "[numerical tests] FAILED: no test passed ($(tail -n 1 <<<"$LAST_LOG"))"
  fi
fi

if [ "$NGPU" -ge 4 ] && [ $((NGPU % 4)) -eq 0 ]; then NPROC=$NGPU; MESH="--pp=2 --cp=2"
elif [ "$NGPU" -ge 2 ]; then NPROC=2; MESH="--pp=2 --cp=1"
else NPROC=1; MESH="--pp=1 --cp=1"; fi
note "layout: $NPROC process(es) of $NGPU $DEVICE device(s), $MESH"
if [ "$NPROC" -lt 4 ]; then
  MISSING="the zigzag ring across devices (cp > 1)"
  [ "$NPROC" -lt 2 ] && MISSING="the pipeline and TapChannel over NCCL (pp > 1), $MISSING"
  [ "$NGPU" -ge 4 ] && MISSING="$MISSING: $NGPU devices are not a multiple of 4"
  note "not checked with $NPROC process(es): $MISSING"
fi

DTYPE=()
if HELP=$(python train.py --help 2>/dev/null) && grep -q -- "--dtype" <<<"$HELP"; then
  for d in bf16 bfloat16; do
    if grep -A0 -- "--dtype" <<<"$HELP" | grep -qw "$d"; then DTYPE=("--dtype=$d"); break; fi
  done
  note "precision: ${DTYPE[*]:-train.py has --dtype but lists neither bf16 nor bfloat16: its default}"
else
  note "precision: train.py has no --dtype flag: its default (fp32)"
fi

# ---------------------------------------------------------------------------------------------- the checkpoint
stage "random Qwen3 checkpoint, vocab $VOCAB" "$L_CKPT" python - "$WORK" "$VOCAB" <<'EOF'
import json, os, sys
import torch, transformers
from tokenizers import Tokenizer, models, pre_tokenizers, processors
work, V = sys.argv[1], int(sys.argv[2])
words = "What is + ? 0 1 2 3 4 5 6 7 8 9".split()
specials = ["<pad>", "<s>", "</s>", "<unk>", "<mask>"]  # <mask>: the block drafter's MASK
vocab = {w: i for i, w in enumerate(specials + words + [f"w{i}" for i in range(V - len(specials) - len(words))])}
assert len(vocab) == V, (len(vocab), V)
tk = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
tk.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
tk.add_special_tokens(specials)
tk.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
path = os.path.join(work, "qwen3")
os.makedirs(path, exist_ok=True)
tk.save(os.path.join(path, "tokenizer.json"))
with open(os.path.join(path, "tokenizer_config.json"), "w") as f:
    json.dump({"bos_token": "<s>", "eos_token": "</s>", "pad_token": "<pad>", "mask_token": "<mask>",
               "add_bos_token": True}, f)
torch.manual_seed(0)
cfg = transformers.Qwen3Config(vocab_size=V, hidden_size=256, intermediate_size=768, num_hidden_layers=4,
                               num_attention_heads=8, num_key_value_heads=4, head_dim=32, max_position_embeddings=4096,
                               tie_word_embeddings=True, bos_token_id=1, eos_token_id=2, pad_token_id=0)
transformers.Qwen3ForCausalLM(cfg).save_pretrained(path)
with open(os.path.join(work, "prompts.jsonl"), "w") as f:
    for a in range(10):
        for b in range(10):
            f.write(json.dumps({"prompt": f"What is {a} + {b} ?", "answer": a + b}) + "\n")
print(path, sum(os.path.getsize(os.path.join(path, n)) for n in os.listdir(path)) >> 20, "MiB")
EOF
CKPT_OK=$?

# ---------------------------------------------------------------------------------------------- the training runs
# A field of summary.json may be null only where the run legitimately has none: kl_last when it held no reference
# model (HF mode's default: --beta=0, no KL log, no offline arm).
SUMMARY_CHECK='
import json, math, os, sys
run = sys.argv[1]
s, c = json.load(open(run + "/summary.json")), json.load(open(run + "/config.json"))
hf = os.path.isdir(c["model"])  # HF mode: auto arms and the KL log are off (harness/config.py, Config.arm)
ref = c["beta"] > 0 or c["log_kl"] is True or c["offline_arm"] is True or (c["log_kl"] == "auto" and not hf)
nullable = set() if ref else {"kl_last"}
keys = ("reward_last", "kl_last", "accept_len_cotrained", "ar_tok_s")
bad = [k for k in keys if not (s[k] is None and k in nullable) and not (s[k] is not None and math.isfinite(s[k]))]
assert s["steps"] == 2 and not bad, ("steps", s["steps"], "null or not finite", bad)
print({k: s[k] for k in ("steps",) + keys}, "(null allowed: %s)" % (sorted(nullable) or "none"))'

train_stage() {  # train_stage BACKEND DRAFTER LIMIT [FLAGS...]: 2 RL steps in HF mode under torchrun, then its summary
  local backend=$1 drafter=$2 limit=$3
  shift 3
  if [ "$backend" = flash ] && { [ "$DEVICE" != cuda ] || ! python -c "import flash_attn" >/dev/null 2>&1; }; then
    skipped "train, --attn_backend=flash" "flash-attn is not installed (or no CUDA); README: GPUs"
    return 0
  fi
  if [ $CKPT_OK -ne 0 ]; then
    note "[train, --attn_backend=$backend --drafter=$drafter] FAILED: no checkpoint (its stage failed)"
    FAILED=$((FAILED + 1))
    return 1
  fi
  local run="$WORK/run_${backend}_$drafter"
  stage "train, torchrun x$NPROC $MESH, --attn_backend=$backend --drafter=$drafter${*:+ $*}, 2 RL steps" "$limit" \
    python -m torch.distributed.run --standalone --nproc_per_node="$NPROC" train.py --preset=test \
      --model="$WORK/qwen3" --data="$WORK/prompts.jsonl" --max_new_tokens=32 --eval_fraction=0.2 --steps=2 \
      --device="$DEVICE" --attn_backend="$backend" --drafter="$drafter" $MESH "${DTYPE[@]}" "$@" \
      --cache_dir="$WORK/cache_$backend" --out="$run" --overwrite \
  && stage "summary of the $backend $drafter run" "$L_SUMMARY" python -c "$SUMMARY_CHECK" "$run"
}
# The first run with activation checkpointing (the 8B plan's setting) and the longer limit (it compiles the kernels);
# the first backend trains every drafter, the others dflash (flash: the blocks' anchor attention on triton).
FIRST=1
for backend in $BACKENDS; do
  for drafter in $DRAFTERS; do
    if [ $FIRST -eq 1 ]; then train_stage "$backend" "$drafter" "$L_TRAIN_FIRST" --activation_checkpointing=true
    else train_stage "$backend" "$drafter" "$L_TRAIN"; fi
    FIRST=0
  done
  DRAFTERS=dflash
done

note "stages: $OK ok, $SKIPPED skipped, $FAILED failed"
echo "report: $OUT"
exit $(( FAILED > 0 ))
