"""Steering vectors from contrastive examples: the request body and the math (pure: no
FastAPI, no Redis)."""
