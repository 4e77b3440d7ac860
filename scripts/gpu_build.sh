#!/usr/bin/env bash
# The GPU build of the embedded pair's drafter (issue 43) in one device call, then the GPU check's benchmarks on
# the pair it built. What comes back under OUT (a lent machine returns at most 8 files of 16 MiB): the shipped
# drafter's weights in 15 MiB parts (cat them), ship.tar (its manifest, draft vocabulary, learning curve), build.log
# and check.tar (the benchmarks' logs and JSON).
#
#   scripts/gpu_build.sh OUT GGUF [TOKENIZER_DIR]
#
# BUILD_SECONDS: distillation seconds (default 150); BUILD_ARGS: more `python -m trainers.builds.device_build` flags;
# CALL_SECONDS: the call's own limit (default 570): the benchmarks get what the build left of it.
set -uo pipefail
OUT=$1
GGUF=$2
TOK=${3:-}
mkdir -p "$OUT" && OUT=$(cd "$OUT" && pwd)
GGUF=$(cd "$(dirname "$GGUF")" && pwd)/$(basename "$GGUF")
[ -n "$TOK" ] && TOK=$(cd "$TOK" && pwd)
t0=$(date +%s)
source "$(dirname "$0")/_device_env.sh"
WORK=${WORK:-/tmp/dvi_gpu}
rm -rf "$WORK" && mkdir -p "$WORK/logs"
PAIR=$WORK/models/smollm2
nvidia-smi -L
# shellcheck disable=SC2086
timeout "${BUILD_TIMEOUT:-420}" $PY -m trainers.builds.device_build --out "$PAIR" --gguf "$GGUF" ${TOK:+--tokenizer "$TOK"} \
  --seconds "${BUILD_SECONDS:-150}" --ship "$WORK/ship" ${BUILD_ARGS:-} 2>&1 | tee "$OUT/build.log" \
  | grep -v 'it/s\]\|s/it\]\|step/s\]' | tail -40
echo "== build: $(( $(date +%s) - t0 )) s"
S=$WORK/ship/smollm2
[ -f "$S/drafter.safetensors" ] && split -b 15M -d "$S/drafter.safetensors" "$OUT/drafter.safetensors.part"
(cd "$WORK" && tar -cf "$OUT/ship.tar" --exclude=drafter.safetensors ship \
  $(ls models/smollm2/manifest.json models/smollm2/learning_curve.png 2>/dev/null))
LEFT=$(( ${CALL_SECONDS:-570} - ($(date +%s) - t0) ))
if [ -f "$PAIR/manifest.json" ] && [ "$LEFT" -gt 60 ]; then
  GPU_CHECK_STAGES="decode serve" GPU_CHECK_QUICK=1 timeout "$LEFT" scripts/gpu_check.sh "$WORK/logs/check" "$PAIR"
fi
(cd "$WORK" && tar -cf "$OUT/check.tar" logs)
echo "== done in $(( $(date +%s) - t0 )) s"
