"""``python -m gpuaas_agent`` runs the CLI."""

from gpuaas_agent.cli import main

raise SystemExit(main())
