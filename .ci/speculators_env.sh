#!/usr/bin/env bash
# The speculators library (vllm-project/speculators 0.9.0) in its own virtual environment, .venv-speculators: an
# outside oracle for the draft formats and the training semantics (tests/speculators_util.py finds its python there,
# or at $COSPEC_SPECULATORS_PYTHON, and runs tests/speculators_oracle.py in it). Its own environment because
# speculators pins transformers <= 5.19 (the test extra takes the newest). --system-site-packages reuses the CPU
# torch already installed; speculators is installed without its dependencies, since it requires torchvision and
# torchaudio, which pull a CUDA torch; the rest are installed with torch held at the CPU build by a constraint.
# ~8 s on a 2-core machine with a warm pip cache (measured: `time bash .ci/speculators_env.sh`, 7.6 s wall on a built
# venv, 25 s from none). pip then reports torchvision / torchaudio as missing: speculators imports neither for its
# models, losses or converters.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${COSPEC_SPECULATORS_VENV:-.venv-speculators}
[ -x "$VENV/bin/python" ] || python -m venv --system-site-packages "$VENV"
"$VENV/bin/pip" install -q --no-deps "speculators==0.9.0"
CONSTRAINTS=$(mktemp)
trap 'rm -f "$CONSTRAINTS"' EXIT
echo "torch==2.13.0" > "$CONSTRAINTS"
"$VENV/bin/pip" install -q -c "$CONSTRAINTS" aiohttp click "datasets>=4.0.0,<=5.1.0" httpx huggingface-hub \
  "loguru>=0.7.2,<=0.7.3" "numpy>=2.0.0,<=2.5.4" "openai>=2.0.0" protobuf psutil "pydantic>=2" "pydantic-settings>=2" \
  rich safetensors "hs-connectors==0.9.0" "tqdm>=4.66.3,<=4.70.1" "transformers>=5.0.0,<=5.19.0" "typer>=0.12.0"
"$VENV/bin/python" -c "
import importlib.metadata as md, torch, transformers
from speculators.models import DFlashDraftModel, DSparkDraftModel, Eagle3DraftModel
assert '+cpu' in torch.__version__ or not torch.version.cuda, f'a CUDA torch in $VENV: {torch.__version__}'
print('speculators', md.version('speculators'), 'transformers', transformers.__version__, 'torch', torch.__version__,
      'in', '$VENV')"
