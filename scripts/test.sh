#!/usr/bin/env bash
# Sets everything up (scripts/setup.sh) and runs the whole test suite on the CPU, in one process. JETFLOW_TEST_WORKERS=2
# runs it on two pytest-xdist workers taking whole modules; on 2 cores that took as long (78 min on 2026-12-07, with
# load-sensitive tests failing), so one process stays the default.
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
bash "$ROOT/scripts/setup.sh"
cd "$ROOT"
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}" HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
exec "$ROOT/.venv/bin/python" -m pytest -q -p no:cacheprovider --durations=25 \
  -n "${JETFLOW_TEST_WORKERS:-0}" --dist loadfile "$@"
