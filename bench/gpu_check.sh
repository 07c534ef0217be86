#!/usr/bin/env bash
# The GPU check: what one lent GPU (an H100 80 GB or an H200 141 GB) runs in 10 minutes -- the stage limits (LIMIT
# below) add up to 600 s. Each stage runs under its own limit and prints one line: ok, skipped (with why) or FAILED
# (with the reason; a stage that runs out of its limit says so). The report holds each stage's command and the tail of
# its output, in markdown; each stage's JSON lies beside it. The last line counts the stages ok / skipped / failed; the
# exit status is 0 iff none failed.
#   1 versions        python, torch, CUDA, the GPU's name and memory, triton, flash_attn (bench/gpu_check_versions.py)
#   2 NCCL waits      the backend string of the run's composite group "cpu:gloo,cuda:nccl" (harness/mesh.py), the
#                     backend parallel.waits.backend_of picks for a CUDA tensor on it (NCCL: a stream wait), and the
#                     host time of a wait with and without a timeout, world size 1 (bench/gpu_check_waits.py)
#   3 LM head         forward + backward at V = 151936, H = 4096, bf16 vs fp32, errors vs fp64 (bench/lm_head_check.py)
#   4 kernels         tests/test_attention_gpu.py (the ring's triton and flash kernels, bf16, against fp64 at head_dim
#                     128, GQA 4) and tests/test_anchor_attention_triton.py (the block drafters' anchor kernels against
#                     fp64, head_dim 128, GQA 4, blocks of 5, bf16 among them)
#   5 update          one world-size-1 update per family with a 4-layer policy of Qwen3-8B's width: peak memory against
#                     the memory plan, and the first update's ratio pi / pi_old = 1 (bench/gpu_check_update.py)
#   6 ring attention  8K and 32K tokens at cp 4 (threads on the one GPU), triton, flash where it imports, torch at 8K
#                     (bench/gpu_check_attention.py, through bench/bench_attention_gpu.py)
#   7 rollouts        speculative vs autoregressive rollouts per family with 4 layers of Qwen3-8B's width at 64 and
#                     1024 rows (bench/gpu_check_rollout.py)
#   8 end to end      the RL step with speculation and co-training against plain GRPO: train.py --preset gpu, the same
#                     with --no_spec (its SFT warm-up cached by the first), then harness.report's step speedup
#   9 HF mode         a random Qwen3 at the real vocabulary (151936), train.py under torchrun over the node's GPUs for 2
#                     RL steps with --attn_backend=triton --activation_checkpointing (the 8B plan's settings)
# Of bench/gpu_smoke.sh's three training runs (all passed on one H200: bench/results/gpu_smoke.md) stage 9 keeps the
# first, the HF loader, tokenizer and torchrun path that no other stage takes; its numerical tests are stage 4. The
# DFlash run on triton is dropped (the anchor kernels are checked by stage 4 and run inside a DFlash and a DSpark update
# by stage 5), and so is the flash run (flash-attn is no dependency of the project: stages 4 and 6 check and time it
# where it is installed), for want of time.
#
#   bash bench/gpu_check.sh                        # repository root, a machine with a GPU: bench/results/gpu_check.md
#   CHECK_STAGES="5 7" bash bench/gpu_check.sh     # a rerun of those stages (the others count as skipped), its report
#                                                  # in bench/results/gpu_check_rerun.md
#   CHECK_DEVICE=cpu bash bench/gpu_check.sh       # the dry run: every stage at tiny size on the CPU (gloo, torch
#                                                  # kernels, V = 2000); its report in $CHECK_WORK, a temporary folder
# tests/test_gpu_check.py runs the dry run in the suite. CHECK_REPORT moves the report (its JSON goes beside it),
# CHECK_WORK the scratch (default /tmp/cospec_gpu_check, /tmp/cospec_gpu_check_cpu for the dry run), CHECK_NPROC the
# dry run's processes in stage 9 (default 1).
set -uo pipefail
cd "$(dirname "$0")/.."
DEVICE=${CHECK_DEVICE:-cuda}
WORK=${CHECK_WORK:-/tmp/cospec_gpu_check$([ "$DEVICE" = cpu ] && echo _cpu)}
if [ -n "${CHECK_REPORT:-}" ]; then OUT=$CHECK_REPORT
elif [ "$DEVICE" = cpu ]; then OUT=$WORK/gpu_check.md
elif [ -n "${CHECK_STAGES:-}" ]; then OUT=bench/results/gpu_check_rerun.md
else OUT=bench/results/gpu_check.md; fi
DIR=$(dirname "$OUT")
declare -A LIMIT=([versions]=15 [waits]=25 [lm_head]=45 [kernels]=55 [update]=90 [attention]=50 [rollout]=85
                  [e2e_spec]=95 [e2e_plain]=40 [e2e_speedup]=10 [hf_checkpoint]=20 [hf_train]=65 [hf_summary]=5)
TOTAL_S=0
for v in "${LIMIT[@]}"; do TOTAL_S=$((TOTAL_S + v)); done
if [ "$DEVICE" = cuda ]; then TINY=(); VOCAB=151936; BACKEND=triton; PRESET=gpu
else TINY=(--tiny); VOCAB=2000; BACKEND=torch; PRESET=test; fi
mkdir -p "$DIR" "$WORK"
export PYTHONUNBUFFERED=1 TRITON_DEFAULT_FP_FUSION=1
unset TRITON_INTERPRET  # compiled kernels, not the CPU interpreter (the anchor test sets it itself without CUDA)
OK=0 SKIPPED=0 FAILED=0
declare -A STATE
printf '# GPU check%s\n\n%s on %s; commit %s\n\n' "$([ "$DEVICE" = cpu ] && echo ', dry run on the CPU')" \
  "$(date -u +%Y-%m-%dT%H:%M:%SZ)" "$(hostname)" "$(git rev-parse --short HEAD 2>/dev/null || echo '?')" > "$OUT"

note() {  # a line on stdout and in the report
  echo "$*"
  printf '%s\n\n' "$*" >> "$OUT"
}

skipped() {  # skipped TITLE WHY: a stage (or part of one) that did not run, counted as skipped, never as ok
  SKIPPED=$((SKIPPED + 1))
  note "[$1] skipped: $2"
}

failed() {  # failed KEY TITLE WHY: a stage failed outside its command (a stage it needs did not pass, no test ran)
  FAILED=$((FAILED + 1)) STATE[$1]=failed
  note "[$2] FAILED: $3"
}

stage() {  # stage KEY TITLE COMMAND...: runs under LIMIT[KEY]; one line on stdout, its command and tail in the report
  local key=$1 title=$2 limit=${LIMIT[$1]} log t0 rc dt verdict why
  shift 2
  log=$(mktemp)
  t0=$(date +%s)
  timeout --kill-after=10 "$limit" "$@" >"$log" 2>&1
  rc=$?
  dt=$(( $(date +%s) - t0 ))
  if [ $rc -eq 0 ]; then
    OK=$((OK + 1)) STATE[$key]=ok verdict=ok
    echo "[$title] ok in ${dt}s"
  else
    FAILED=$((FAILED + 1)) STATE[$key]=failed why="exit $rc"
    if [ $rc -eq 124 ] || [ $rc -eq 137 ]; then why="it ran out of its ${limit} s limit"; fi
    verdict="FAILED: $why"
    echo "[$title] FAILED in ${dt}s: $why; its last line: $(grep -v '^\s*$' "$log" | tail -n 1 | cut -c1-200)"
  fi
  printf '## %s: %s (%s s of its %s)\n\n```\n$ %s\n%s\n```\n\n' "$title" "$verdict" "$dt" "$limit" "$*" \
    "$(tail -n 80 "$log")" >> "$OUT"
  LAST_LOG=$(tail -n 300 "$log")
  rm -f "$log"
  if [ $rc -eq 0 ]; then  # a part of the stage that could not run (flash-attn missing, a skipped test): skipped
    while IFS= read -r why; do skipped "$title" "$why"; done < <(sed -n 's/^SKIPPED //p' <<<"$LAST_LOG")
  fi
  return $rc
}

# run NUMBER "NEEDS..." KEY TITLE COMMAND...: the stage, if NUMBER is in CHECK_STAGES (unset: every stage) and every
# stage named in NEEDS passed
run() {
  local n=$1 needs=$2 dep
  shift 2
  if [ -n "${CHECK_STAGES:-}" ] && [[ " $CHECK_STAGES " != *" $n "* ]]; then
    skipped "$2" "stage $n is not in CHECK_STAGES=\"$CHECK_STAGES\""
    return 1
  fi
  for dep in $needs; do
    if [ "${STATE[$dep]:-}" != ok ]; then failed "$1" "$2" "it needs the stage '$dep', which did not pass"; return 1; fi
  done
  stage "$@"
}

note "stage limits add up to ${TOTAL_S} s"

# ---------------------------------------------------------------------------------------------------- 1 versions
if ! run 1 "" versions "versions" python bench/gpu_check_versions.py --device="$DEVICE" \
     --out="$DIR/gpu_check_versions.json" && [ "${STATE[versions]:-}" = failed ]; then
  note "no usable $DEVICE device: stopping"
  note "stages: $OK ok, $SKIPPED skipped, $FAILED failed"
  exit 1
fi

# ---------------------------------------------------------------------------- 2-7 one module or benchmark a stage
run 2 "" waits "NCCL waits" python bench/gpu_check_waits.py --device="$DEVICE" --out="$DIR/gpu_check_waits.json"
run 3 "" lm_head "LM head" python bench/lm_head_check.py "${TINY[@]}" --device="$DEVICE" \
  --out="$DIR/gpu_check_lm_head.json"
if [ "$DEVICE" = cuda ]; then KERNELS=(tests/test_attention_gpu.py tests/test_anchor_attention_triton.py)
else KERNELS=(tests/test_anchor_attention_triton.py -k gqa4_block5); fi  # the CPU: the block case, interpreted
if run 4 "" kernels "kernels vs fp64" python -m pytest -q -rs -p no:cacheprovider "${KERNELS[@]}" \
   && ! grep -qE "[0-9]+ passed" <<<"$LAST_LOG"; then  # a run whose tests all skipped checked nothing
  OK=$((OK - 1)) STATE[kernels]=failed
  failed kernels "kernels vs fp64" "no test passed ($(tail -n 1 <<<"$LAST_LOG"))"
fi
run 5 "" update "one update per family" python bench/gpu_check_update.py "${TINY[@]}" --device="$DEVICE" \
  --out="$DIR/gpu_check_update.json"
run 6 "" attention "ring attention" python bench/gpu_check_attention.py "${TINY[@]}" --device="$DEVICE" \
  --out="$DIR/gpu_check_attention.json"
run 7 "" rollout "rollouts per family" python bench/gpu_check_rollout.py "${TINY[@]}" --device="$DEVICE" \
  --cache_dir="$WORK/cache_rollout" --out="$DIR/gpu_check_rollout.json"

# ---------------------------------------------------------------------------------------------------- 8 end to end
E2E=(train.py --preset="$PRESET" --device="$DEVICE" --cache_dir="$WORK/cache_e2e" --overwrite)
run 8 "" e2e_spec "end to end: co-trained speculative run" python "${E2E[@]}" --out="$WORK/e2e_spec"
run 8 "" e2e_plain "end to end: plain GRPO run" python "${E2E[@]}" --no_spec --out="$WORK/e2e_plain"
if run 8 "e2e_spec e2e_plain" e2e_speedup "end to end: step speedup" python bench/gpu_check_e2e.py \
   "$WORK/e2e_spec" "$WORK/e2e_plain" --out="$DIR/gpu_check_e2e.json"; then  # harness.report RUN --baseline BASE
  note "$(grep '^==> ' <<<"$LAST_LOG")"
fi

# ------------------------------------------------------------------------------------------------------ 9 HF mode
if [ "$DEVICE" = cuda ]; then NGPU=$(python -c "import torch; print(torch.cuda.device_count())" 2>/dev/null || echo 0)
else NGPU=${CHECK_NPROC:-1}; fi
if [ "$NGPU" -ge 4 ] && [ $((NGPU % 4)) -eq 0 ]; then NPROC=$NGPU; MESH=(--pp=2 --cp=2)
elif [ "$NGPU" -ge 2 ]; then NPROC=2; MESH=(--pp=2 --cp=1)
else NPROC=1; MESH=(--pp=1 --cp=1); fi
UNCHECKED=""
[ "$NPROC" -lt 2 ] && UNCHECKED="the pipeline and TapChannel over NCCL (pp > 1), "
[ "$NPROC" -lt 4 ] && UNCHECKED="${UNCHECKED}the zigzag ring across devices (cp > 1)"
note "HF mode layout: $NPROC process(es) of $NGPU $DEVICE device(s), ${MESH[*]}${UNCHECKED:+; not checked: $UNCHECKED}"
run 9 "" hf_checkpoint "HF mode: random Qwen3 checkpoint, V = $VOCAB" python bench/gpu_check_hf.py checkpoint \
  "$WORK/hf" --vocab="$VOCAB"
run 9 "hf_checkpoint" hf_train "HF mode: torchrun x$NPROC ${MESH[*]}, --attn_backend=$BACKEND, 2 RL steps" \
  python -m torch.distributed.run --standalone --nproc_per_node="$NPROC" train.py --preset=test \
  --model="$WORK/hf/qwen3" --data="$WORK/hf/prompts.jsonl" --max_new_tokens=32 --eval_fraction=0.2 --steps=2 \
  --device="$DEVICE" --attn_backend="$BACKEND" --drafter=eagle3 "${MESH[@]}" --dtype=bf16 \
  --activation_checkpointing=true --cache_dir="$WORK/cache_hf" --out="$WORK/hf_run" --overwrite
run 9 "hf_train" hf_summary "HF mode: the run's summary" python bench/gpu_check_hf.py summary "$WORK/hf_run"

note "stages: $OK ok, $SKIPPED skipped, $FAILED failed"
echo "report: $OUT"
exit $(( FAILED > 0 ))
