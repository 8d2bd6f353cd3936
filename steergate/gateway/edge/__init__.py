"""The HTTP edge: ASGI middleware (body limit, metrics), the server's head timeout,
Prometheus metrics, the OpenAPI document and tracing."""
