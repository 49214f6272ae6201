"""Pydantic models of everything on the wire (DESIGN.md §3). Imports nothing of ours."""
