"""Side-effect drivers, in sub-rooms by concern; they act only after the guards in ``guards/`` passed.

``network/`` (OVS port, port flows, nft guard, DHCP, readiness probes), ``storage/`` (wipe, its
policy and proof, NVMe capabilities, SMART), ``images/`` (sources, cache, clone onto the disk),
``vm/`` (domain XML, libvirt lifecycle, seed ISO, console log, SSH relay), ``devices/`` (vfio, GPU
handover, PCI ROM, Fabric Manager, device events). ``run.py`` stays here: every room runs its
programs through it. A sub-room imports another only along an edge tests/test_import_graph.py lists.
"""
