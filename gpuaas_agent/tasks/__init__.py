"""One handler per task type; they join discovery, guards, drivers and state (docs/architecture.md)."""
