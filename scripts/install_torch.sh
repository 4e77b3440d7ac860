#!/usr/bin/env bash
# Install torch into the given interpreter's environment without pulling a multi-GB CUDA build
# onto a machine that has no GPU. A CUDA machine (nvidia-smi works) gets PyPI's default build.
set -euo pipefail
PY="${1:-python3}"
if "$PY" -c "import torch" 2>/dev/null; then
    echo "torch already installed: $("$PY" -c 'import torch; print(torch.__version__)')"
    exit 0
fi
if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    echo "CUDA GPU found: installing PyPI's default (CUDA) torch build"
    "$PY" -m pip install "torch>=2.4"
    exit 0
fi
echo "no CUDA GPU: installing a CPU-only torch build"
# torch==2.13.0+cpu is provided locally on this project's machines (pip's find-links);
# elsewhere fall back to PyTorch's CPU wheel index.
"$PY" -m pip install "torch==2.13.0" \
  || "$PY" -m pip install torch --index-url https://download.pytorch.org/whl/cpu
