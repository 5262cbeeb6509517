# omni_serve: `make run` serves the default graph locally, `make test` runs the whole suite.
# Both work from a fresh clone: they create .venv, install torch 2.13.0 (CPU) first, then the package.
SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
CHECKPOINT ?= checkpoints/qwen2_5_omni-tiny
PORT ?= 8000
export RAY_AUTH_MODE ?= disabled

.PHONY: setup checkpoint run test unit integration bench clean

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet -e ".[test,bench]"
	touch $@

setup: $(VENV)/.installed

$(CHECKPOINT)/spk_dict.pt: | $(VENV)/.installed
	$(VENV)/bin/omni-serve make-checkpoint qwen2_5_omni --size tiny $(CHECKPOINT)

checkpoint: $(CHECKPOINT)/spk_dict.pt

run: setup checkpoint
	$(VENV)/bin/omni-serve serve --port $(PORT) checkpoint=$(CHECKPOINT)

test: setup checkpoint
	OMNI_SERVE_TEST_CHECKPOINT=$(CHECKPOINT) $(VENV)/bin/pytest tests

unit: setup checkpoint
	OMNI_SERVE_TEST_CHECKPOINT=$(CHECKPOINT) $(VENV)/bin/pytest tests/unit

integration: setup checkpoint
	OMNI_SERVE_TEST_CHECKPOINT=$(CHECKPOINT) $(VENV)/bin/pytest tests/integration

# The issue-3 benchmark on the small checkpoint (~20 min on 2 cores): see docs/benchmarks.md.
bench: setup
	loadtests/run_bench.sh bench_out

clean:
	rm -rf $(VENV) checkpoints *.egg-info
