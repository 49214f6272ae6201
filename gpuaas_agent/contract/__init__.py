"""Pydantic models of everything on the wire (docs/contract.md). Imports nothing of ours."""
