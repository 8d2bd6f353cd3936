"""steergate's multi-tenant gateway: auth, tenant scoping, rate limits and quotas in
Redis, and a streaming proxy in front of the steering engines.

Floors, bottom up: ``store`` (Redis, key names, Lua), ``tenancy`` (tenants, keys, auth),
``admission`` (limits, scoping, settlement, usage), ``engines`` (client, pool, proxy),
``edge`` (middleware, metrics, OpenAPI, tracing), ``vectors`` (vectors from examples),
then ``routes``; ``app`` only assembles them.

Request path (read top to bottom): ``tenancy.auth`` -> ``admission.request_scoping`` ->
``admission.limits`` -> ``engines.upstream`` -> ``admission.settlement``.
"""
