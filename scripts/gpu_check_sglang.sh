#!/usr/bin/env bash
# The SGLang GPU check (scripts/gpu_check_sglang.py), for a GPU machine that can host SGLang 0.5.23 (torch 2.9 with
# CUDA: `pip install "sglang[all]==0.5.23"` and then this package, `pip install -e .`). Not the lent device machines
# (torch 2.11): there scripts/gpu_session.sh checks the engine, kernels and captured round instead. 10 minutes at most;
# writes bench/results/gpu_check_sglang.{json,md}.
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python}"
"$PY" -c "import sglang, torch; assert sglang.__version__ == '0.5.23', sglang.__version__; assert torch.cuda.is_available()" \
  || { echo "error: needs sglang 0.5.23 with a CUDA torch on this machine" >&2; exit 2; }
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
timeout 600 "$PY" scripts/gpu_check_sglang.py --device cuda "$@"
