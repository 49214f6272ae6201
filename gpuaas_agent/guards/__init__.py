"""Safety checks of DESIGN.md §4: each returns evidence or raises a typed GuardError."""
