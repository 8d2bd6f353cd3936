"""Tenancy: tenants, their API keys and admin keys (records, store, hashing),
authentication and its cache, cross-replica invalidation, key last use, and the audit
log."""
