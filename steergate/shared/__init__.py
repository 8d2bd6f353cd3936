"""What the gateway and the engine both need: the steering schema, vector codecs,
id scoping, errors and settings. Nothing here imports torch or vLLM, so the
gateway image stays slim."""
