"""What an operator sees of a host: health checks, metrics, the daemon's status file and `gpuaas-agent status`."""
