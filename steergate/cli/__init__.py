"""The ``steergate`` command: its dispatcher (``main``), ``steergate up`` (``up``: the
process supervisor, demo tenant and progress display), and the admin commands
(``admin``: tenants, keys, admin keys, audit, usage) with their tables (``tables``).
Nothing in the gateway or the engine imports this package."""
