"""PCI functions and what drives them: vfio binding, the GPU handover, ROM, Fabric Manager, device events.

``vfio.py`` binds a slot's functions to vfio-pci; ``gpuhandover.py`` hands a GPU to the next
tenant (reset, clear, restore, prove) with NVIDIA's tool as ``gpuadmin.py`` runs it, binding the
function back through ``vfio.py``; ``pcirom.py`` reads a GPU's VBIOS; ``fabricmanager.py``
drives NVIDIA Fabric Manager's partitions; ``uevents.py`` turns device events into bursts.
"""
