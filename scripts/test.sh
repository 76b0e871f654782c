#!/usr/bin/env bash
# Sets everything up (scripts/setup.sh) and runs the whole test suite on the CPU: two pytest-xdist workers taking
# whole modules (86.5 min of module time on a 2-core EPYC on 2026-12-07, 44 min of wall time; a third worker saved 2
# minutes with both cores already busy and made a batch-forming test flaky), then, in one process, the modules that
# measure or wait on the machine's load (SERIAL: a browser driving Plotly pages, and the benchmark's CPU accounting),
# which a second worker's load made fail. With arguments: those tests only, on JETFLOW_TEST_WORKERS workers (0: one
# process, the default then).
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
bash "$ROOT/scripts/setup.sh"
cd "$ROOT"
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}" HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
PYTEST=("$ROOT/.venv/bin/python" -m pytest -q -p no:cacheprovider --durations=25)
if [ "$#" -gt 0 ]; then
  exec "${PYTEST[@]}" -n "${JETFLOW_TEST_WORKERS:-0}" --dist loadfile "$@"
fi
SERIAL=(tests/test_viz_browser.py tests/sglang/test_bench_accounting.py)
rc=0
"${PYTEST[@]}" -n "${JETFLOW_TEST_WORKERS:-2}" --dist loadfile "${SERIAL[@]/#/--ignore=}" tests || rc=$?
"${PYTEST[@]}" "${SERIAL[@]}" || rc=$?
exit "$rc"
