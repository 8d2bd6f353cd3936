"""The store floor: the Redis connection and its failure mapping, every Redis key name, and
the Lua scripts (``lua/``) with their loader."""
