#!/usr/bin/env bash
# Installs what the explorer (jetflow_sglang/viz/) and its browser test need, idempotently:
#   Debian's chromium (apt) and pinned gradio/plotly/networkx/playwright into a venv.
# Playwright drives that system chromium through executable_path; we never run `playwright install`,
# which would download its own browser build (and fails offline).
# Usage: scripts/install_browser.sh [VENV_DIR]   (default: .venv next to this repo)
set -euo pipefail
here="$(cd "$(dirname "$0")/.." && pwd)"
venv="${1:-$here/.venv}"
py="$venv/bin/python"
[ -x "$py" ] || { echo "no python at $py (pass the venv dir)" >&2; exit 1; }

if ! command -v chromium >/dev/null 2>&1; then
  sudo_=""; [ "$(id -u)" = 0 ] || sudo_="sudo"
  $sudo_ apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo_ apt-get install -y -qq --no-install-recommends chromium fonts-dejavu-core
fi
chromium --version 2>/dev/null || true

# Pin what already sits in the venv so these installs never move torch/numpy/transformers.
cons="$(mktemp)"; trap 'rm -f "$cons"' EXIT
"$py" -m pip freeze 2>/dev/null | grep -iE '^(torch|numpy|transformers|tokenizers)==' > "$cons" || true
"$py" -m pip install -q -c "$cons" "gradio==6.31.0" "plotly==6.9.0" "networkx==3.6.1" "playwright==1.65.2"
"$py" -c "import gradio, plotly, networkx, playwright; print('viz deps ok: gradio', gradio.__version__, 'plotly', plotly.__version__)"
