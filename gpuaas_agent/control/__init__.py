"""NATS side of the agent: enrollment, JetStream task claim and results, heartbeats (docs/architecture.md, docs/contract.md)."""
