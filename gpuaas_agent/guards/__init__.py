"""Safety checks of docs/safety.md: each returns evidence or raises a typed GuardError."""
