"""Admission: the one-script limiter, request scoping before and after it, off-loop body
parsing, leases and settlement, stream metering, and the usage it all adds up to."""
