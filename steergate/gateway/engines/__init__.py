"""The engines as the gateway sees them: the typed client, the upstream pool and its
HTTP/1.1 transport, the proxy that sends an admitted turn, engine cache sync, and engine
status."""
