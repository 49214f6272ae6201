"""One handler per task type; they join discovery, guards, drivers and state (DESIGN.md §2)."""
