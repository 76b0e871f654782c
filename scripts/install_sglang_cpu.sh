#!/usr/bin/env bash
# Lite, CPU-only install of SGLang 0.5.23 into an existing venv, for the JETFLOW plugin.
#
#   bash scripts/install_sglang_cpu.sh [VENV]        # default: .venv of this repo
#
# Why not `pip install sglang==0.5.23`: it pins torch==2.14.1 (a CUDA build) plus ~20 CUDA/kernel wheels (11 GB).
# Instead: keep the venv's torch, install sglang --no-deps, then the pure-Python deps it imports, under a
# constraint that freezes torch/transformers/numpy. The CUDA-only `sgl_kernel` and a torchvision that cannot
# load beside CPU torch are served by jetflow_sglang.sglang.cpu.ops when JETFLOW_SGLANG_CPU=1.
# Idempotent: a second run with everything present only checks and returns.
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
VENV="${1:-$ROOT/.venv}"
PY="$VENV/bin/python"
[ -x "$PY" ] || { echo "no python at $PY (create the venv first: python3 -m venv $VENV)" >&2; exit 2; }
SGLANG_VERSION=0.5.23

# Freeze what the venv already has for the heavy packages, so nothing here can swap torch for a CUDA build.
CONS="$(mktemp)"; trap 'rm -f "$CONS"' EXIT
"$PY" - "$CONS" <<'PY'
import sys, importlib.metadata as md
# transformers: the exact release sglang 0.5.23 was built against (it pins it); others: keep what is there.
pins = ["transformers==5.19.0"]
for name, default in [("torch", "2.13.0"), ("numpy", None), ("tokenizers", None), ("triton", None)]:
    try:
        pins.append(f"{name}=={md.version(name)}")
    except md.PackageNotFoundError:
        if default:
            pins.append(f"{name}=={default}")
open(sys.argv[1], "w").write("\n".join(pins) + "\n")
PY

# The pure deps SGLang imports on the CPU serving path (from its Requires-Dist, minus CUDA/kernel/vision/audio),
# and the one its test utilities add.
DEPS=(
  "sglang==$SGLANG_VERSION" aiohttp anthropic "apache-tvm-ffi==0.1.11" "blobfile==3.0.0" "compressed-tensors==0.18.0"
  distro easydict "openai>=1.0" einops fastapi gguf interegular msgspec "openai-harmony==0.0.4" orjson packaging
  partial_json_parser pillow "prometheus-client>=0.20.0" psutil pybase64 pydantic "python-dateutil<3"
  python-multipart "pyzmq>=25.1.2" regex requests scipy "sentencepiece==0.2.1" setproctitle tiktoken tqdm
  "transformers==5.19.0" "uvicorn>=0.51" uvloop watchfiles "xgrammar==0.2.7" xxhash zstandard ninja
  "llguidance>=1.7.6,<2" "triton>=3.6" IPython dill jsonschema "soundfile==0.13.1"
  datasets  # not for serving: sglang.test.test_utils (SGLang's conformance kits, tests/sglang/test_spec_kits.py)
)

if "$PY" - "${DEPS[@]}" <<'PY'
import sys, importlib.metadata as md, re
missing = []
for req in sys.argv[1:]:
    name = re.split(r"[<>=!\[]", req)[0]
    try:
        v = md.version(name)
        if "==" in req and v != req.split("==")[1]:
            missing.append(req)
    except md.PackageNotFoundError:
        missing.append(req)
sys.exit(1 if missing else 0)
PY
then
  echo "[install_sglang_cpu] sglang==$SGLANG_VERSION and its CPU deps already present in $VENV"
else
  echo "[install_sglang_cpu] installing sglang==$SGLANG_VERSION (no deps) + CPU deps into $VENV"
  "$PY" -m pip install -q -c "$CONS" --no-deps "sglang==$SGLANG_VERSION"
  # Everything but sglang itself, resolved normally but with torch & co frozen.
  "$PY" -m pip install -q -c "$CONS" "${DEPS[@]:1}"
fi

# The CPU shim must be active before SGLang's first import in every process (the scheduler is spawned, and it
# imports sgl_kernel at module level), so a .pth hook loads it; it does nothing unless JETFLOW_SGLANG_CPU=1.
SITE="$("$PY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
echo 'import os; os.environ.get("JETFLOW_SGLANG_CPU", "").strip().lower() in ("1", "true", "yes", "on") and __import__("jetflow_sglang.sglang.cpu.boot")' > "$SITE/jetflow_sglang_cpu.pth"
JETFLOW_SGLANG_CPU=1 "$PY" -c "import jetflow_sglang.sglang.compat as c; c.check()" && echo "[install_sglang_cpu] ok: $SITE/jetflow_sglang_cpu.pth"
