"""steergate's multi-tenant gateway: auth, tenant scoping, rate limits and quotas in
Redis, and a streaming proxy in front of the steering engines.

Floors, bottom up: ``store`` (Redis, key names, Lua), ``tenancy`` (tenants, keys, auth),
``admission`` (limits, scoping, settlement, usage), ``engines`` (client, pool, proxy),
``edge`` (middleware, metrics, OpenAPI), ``vectors`` (vectors from examples),
then ``routes``; ``app`` only assembles them. ``tracing`` stands beside the floors: every
floor opens spans, so it imports none of them.

Request path (read top to bottom): ``tenancy.auth`` -> ``admission.request_scoping`` ->
``admission.limits`` -> ``engines.upstream`` -> ``admission.settlement``.
"""
