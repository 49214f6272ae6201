"""gpuaas-agent: the node agent of GPU-slice hosts."""

__version__ = "0.1.0"
