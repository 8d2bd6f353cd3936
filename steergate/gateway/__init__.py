"""steergate's multi-tenant gateway: auth, tenant scoping, rate limits and quotas in
Redis, and a streaming proxy in front of the steering engines.

Request path (read top to bottom): ``auth`` -> ``scoping`` -> ``limits`` ->
``upstream`` -> ``accounting``; ``app`` only assembles them.
"""
