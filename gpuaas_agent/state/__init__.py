"""Host-local state in one SQLite file (WAL): leases, the task journal, idempotency records."""
