"""NATS side of the agent: enrollment, JetStream task claim and results, heartbeats (DESIGN.md §2, §3)."""
