# Sourced by the device scripts: Python, this checkout on the path, and the wheels a lent machine lacks (fastapi,
# pydantic, gguf, ... in .whl/ beside the checkout, installed once into /tmp/site).
PY=${PYTHON:-python3}
cd "$(dirname "${BASH_SOURCE[0]}")/.."
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
if [ -d .whl ] && ls .whl/*.whl >/dev/null 2>&1 && [ ! -f /tmp/site/.dvi_installed ]; then
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && touch /tmp/site/.dvi_installed
fi
[ -d /tmp/site ] && export PYTHONPATH="/tmp/site:$PYTHONPATH"
