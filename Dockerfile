# omni_serve image: every Ray container of the Helm chart (helm/omni-serve) and the `omni-serve` CLI.
#   CPU: docker build -t omni-serve:0.1.0 .
#   GPU: docker build --build-arg VARIANT=gpu -t omni-serve:0.1.0-gpu .
# python:3.11-slim plus wheels: torch's CUDA wheels on PyPI bundle the CUDA runtime libraries, so the GPU
# image needs no CUDA base image; the NVIDIA driver comes from the node (device plugin / container toolkit).
FROM python:3.11-slim-bookworm

# cpu: CPU torch wheel and the non-CUDA Mooncake wheel. gpu: CUDA torch wheel and the CUDA Mooncake build.
ARG VARIANT=cpu
ARG TORCH_VERSION=2.13.0
# Index of the torch wheel. Default: the CPU-only index for cpu, PyPI (CUDA build) for gpu; set it to e.g.
# https://download.pytorch.org/whl/cu129 to pick another CUDA version.
ARG TORCH_INDEX_URL=""
ARG MOONCAKE_VERSION=0.3.13.post1

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

# bash: KubeRay starts Ray with bash. wget: KubeRay's health probes. libibverbs1: the Mooncake Transfer
# Engine links it, even for TCP.
RUN apt-get update \
 && apt-get install -y --no-install-recommends bash wget ca-certificates libibverbs1 \
 && rm -rf /var/lib/apt/lists/*

# torch first (as `make setup` does): `pip install .` then keeps it instead of resolving another build.
RUN set -eux; \
    case "$VARIANT" in \
      cpu) index="${TORCH_INDEX_URL:-https://download.pytorch.org/whl/cpu}" ;; \
      gpu) index="${TORCH_INDEX_URL:-https://pypi.org/simple}" ;; \
      *) echo "VARIANT must be cpu or gpu, not '$VARIANT'" >&2; exit 1 ;; \
    esac; \
    pip install --index-url "$index" "torch==${TORCH_VERSION}"

# The package and its dependencies (ray[serve], transformers, diffusers, cache-dit, Mooncake, ...).
WORKDIR /tmp/omni_serve
COPY pyproject.toml README.md ./
COPY omni_serve ./omni_serve
COPY kernels ./kernels
RUN set -eux; \
    pip install . ; \
    python -m omni_serve.torchvision_compat; \
    if [ "$VARIANT" = gpu ]; then \
      pip uninstall -y mooncake-transfer-engine-non-cuda; \
      pip install "mooncake-transfer-engine==${MOONCAKE_VERSION}"; \
    fi; \
    python -c "import torch, ray, omni_serve; assert torch.__version__.startswith('${TORCH_VERSION}'), torch.__version__"; \
    cd / && rm -rf /tmp/omni_serve

# Ray's images run as uid 1000; the chart's emptyDir volumes (/dev/shm, generated checkpoints) are writable.
RUN useradd --create-home --uid 1000 --shell /bin/bash ray
USER ray
WORKDIR /home/ray
CMD ["omni-serve", "--help"]
