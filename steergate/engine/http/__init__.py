"""The engine's HTTP side inside vLLM's API server: routes, auth and the request
rewrite, as one ``vllm.endpoint_plugins`` plugin (:mod:`engine.http.plugin`)."""
