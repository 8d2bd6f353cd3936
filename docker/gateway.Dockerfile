# syntax=docker/dockerfile:1
# The gateway image: FastAPI + Redis client, no torch, no vLLM (~200 MB, not ~5 GB).
# Only steergate/shared/, steergate/cli/ and steergate/gateway/ go in; the build fails if
# torch or vllm sneaks in.
FROM python:3.12-slim-bookworm

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

RUN useradd --create-home --uid 10001 steergate
WORKDIR /app

COPY pyproject.toml README.md ./
COPY steergate/__init__.py ./steergate/
COPY steergate/shared ./steergate/shared
COPY steergate/cli ./steergate/cli
COPY steergate/gateway ./steergate/gateway
RUN pip install ".[gateway,otel]" \
 && python -c "import importlib.util as u, sys; bad = [m for m in ('torch', 'vllm') if u.find_spec(m)]; sys.exit(f'gateway image must not contain {bad}' if bad else 0)"

USER steergate
EXPOSE 8080
ENV STEERGATE_HOST=0.0.0.0
CMD ["steergate", "gateway", "--port", "8080"]
