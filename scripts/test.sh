#!/usr/bin/env bash
# Sets everything up (scripts/setup.sh) and runs the whole test suite on the CPU: two pytest-xdist workers, each
# taking whole modules (their servers are module- and session-scoped); JETFLOW_TEST_WORKERS=0 runs it in one process.
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
bash "$ROOT/scripts/setup.sh"
cd "$ROOT"
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}" HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
exec "$ROOT/.venv/bin/python" -m pytest -q -p no:cacheprovider --durations=25 \
  -n "${JETFLOW_TEST_WORKERS:-2}" --dist loadfile "$@"
