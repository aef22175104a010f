# The peagle images: `api` (API, CLI, migrations) and `worker` (the same plus vLLM, for the publish gate:
# every checkpoint is loaded in vLLM before it is published). The compose file builds each target.
#
# PyPI's Linux torch wheel already ships CUDA 12 kernels, so the default build runs on NVIDIA GPUs
# (the host needs the NVIDIA driver + container toolkit). For a smaller CPU-only image:
#   docker build --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu -t peagle .
# For another CUDA version use e.g. https://download.pytorch.org/whl/cu128.
FROM python:3.11-slim AS api

ARG TORCH_INDEX_URL=""
# Keep in step with pyproject.toml's torch pin.
ARG TORCH_VERSION=2.13.0
ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PEAGLE_DATA_DIR=/data

WORKDIR /app

# torch in its own cached layer, from the chosen index when one is given.
COPY pyproject.toml README.md ./
RUN if [ -n "$TORCH_INDEX_URL" ]; then \
      pip install "torch==${TORCH_VERSION}" --index-url "$TORCH_INDEX_URL"; \
    fi

COPY peagle_core ./peagle_core
COPY service ./service
COPY worker ./worker
COPY client ./client
COPY cli ./cli
COPY migrations ./migrations
RUN pip install ".[trackers]"

RUN useradd --create-home --uid 1000 peagle && mkdir -p /data /models && chown -R peagle /data /models
USER peagle

EXPOSE 8000
CMD ["peagle", "--help"]

# The GPU worker: vLLM's CUDA build, pinned to the version the serving tests run (its torch pin is ours).
FROM api AS worker
ARG VLLM_PACKAGE=vllm==0.32.0
USER root
RUN pip install "${VLLM_PACKAGE}"
USER peagle
# P-EAGLE's parallel drafting needs vLLM's V1 model runner.
ENV VLLM_USE_V2_MODEL_RUNNER=0
CMD ["peagle", "worker", "--queue", "default"]
