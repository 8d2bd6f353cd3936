"""One router per resource. ``admin``, ``usage`` and ``dashboard`` are owned by the
admin/CLI work and included by ``gateway.app`` when present."""
