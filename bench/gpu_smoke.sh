#!/usr/bin/env bash
# The first thing to run on a lent GPU (about 10 minutes at most): each step under `timeout`, a failing step does not
# stop the others, and everything lands in bench/results/gpu_smoke.md (command, exit code, seconds, output tail).
#
#   bash bench/gpu_smoke.sh                  # from the repository root, on a machine with one or more NVIDIA GPUs
#
# Steps: versions; the compiled Triton kernels against the torch kernel (tests/test_attention_triton.py, compiled when
# CUDA is present); the bf16 GPU tests (tests/test_attention_gpu.py, cp = 1 and 2 on one GPU); one bf16 forward at
# T = 262144, Hq 64, D 128 (int64 offsets) checked on sampled rows against SDPA; a short bench_attention_gpu.py; the
# single-process CUDA training test, and the loop with --attn_backend triton once that flag exists.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=bench/results/gpu_smoke.md
mkdir -p bench/results
export PYTHONUNBUFFERED=1 TRITON_DEFAULT_FP_FUSION=1
unset TRITON_INTERPRET  # compiled kernels, not the CPU interpreter
FAILED=0
{
  echo "# GPU smoke run"
  echo
  echo "$(date -u +%Y-%m-%dT%H:%M:%SZ) on $(hostname); commit $(git rev-parse --short HEAD 2>/dev/null || echo '?')"
  echo
} > "$OUT"

step() {  # step NAME SECONDS COMMAND...: run under timeout, append the result to the report
  local name=$1 limit=$2
  shift 2
  local log t0 rc
  log=$(mktemp)
  t0=$(date +%s)
  echo ">>> $name (limit ${limit}s): $*"
  timeout --kill-after=10 "$limit" "$@" >"$log" 2>&1
  rc=$?
  local dt=$(( $(date +%s) - t0 ))
  local verdict=ok
  [ $rc -eq 124 ] || [ $rc -eq 137 ] && verdict="TIMEOUT after ${limit}s"
  [ $rc -ne 0 ] && [ "$verdict" = ok ] && verdict="FAILED (exit $rc)"
  [ $rc -ne 0 ] && FAILED=$((FAILED + 1))
  echo "    $verdict in ${dt}s"
  {
    echo "## $name: $verdict (${dt} s)"
    echo
    echo '```'
    echo "\$ $*"
    tail -n 40 "$log"
    echo '```'
    echo
  } >> "$OUT"
  rm -f "$log"
}

step "versions" 30 bash -c 'nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv; python -c "
import torch, platform
print(\"python\", platform.python_version(), \"torch\", torch.__version__, \"cuda\", torch.version.cuda)
print(\"device\", torch.cuda.get_device_name(0) if torch.cuda.is_available() else None, \"count\", torch.cuda.device_count())
for m in (\"triton\", \"flash_attn\", \"transformers\"):
    try:
        print(m, __import__(m).__version__)
    except ImportError as e:
        print(m, \"missing:\", e)
"'
step "compiled Triton kernels vs the torch kernel" 200 python -m pytest -q -x tests/test_attention_triton.py
step "bf16 GPU tests (triton, flash; cp 1 and 2)" 180 python -m pytest -q tests/test_attention_gpu.py
step "bf16 forward T=262144 Hq=64 D=128 (int64 offsets) vs SDPA" 120 python bench/gpu_long_forward.py
step "short bench_attention_gpu.py" 150 python bench/bench_attention_gpu.py --lengths=4096,16384,65536 --repeats=1 \
  --budget_s=100 --out=bench/results/attention_gpu_smoke.json
step "single-process CUDA training test" 150 python -m pytest -q tests/test_train.py -k cuda
if grep -q "attn_backend" harness/config.py 2>/dev/null; then
  step "training loop, --attn_backend triton" 150 python train.py --preset=test --device=cuda --attn_backend=triton \
    --out=/tmp/cospec_smoke_triton
fi

echo "steps failed: $FAILED" >> "$OUT"
echo "report: $OUT (steps failed: $FAILED)"
exit $(( FAILED > 0 ))
