"""steergate's engine side: plugins for stock vLLM (no fork).

``engine.plugin`` (vllm.general_plugins) installs the steering op in every process;
``engine.http`` (vllm.endpoint_plugins) adds the routes and the request rewrite in
the API server. Pure modules (``latch``, ``registry``, ``payload``) import no vLLM.
"""
