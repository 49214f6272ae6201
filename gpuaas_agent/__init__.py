"""gpuaas-agent: the node agent of GPU-slice hosts."""

# First, before any module (or nats-py) is imported: on Python 3.10 it makes asyncio's TimeoutError
# the builtin one, as 3.11 does (gpuaas_agent/compat.py says why).
from gpuaas_agent import compat as _compat  # noqa: F401

__version__ = "0.1.0"
