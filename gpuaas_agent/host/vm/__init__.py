"""The slot's domain and what is attached to it or read from it.

``domain_xml.py`` builds the domain XML (with the guest's NUMA/PCIe layout from
``guest_topology.py``) out of ``domain_config.py``'s element classes, which format and parse
each element; ``libvirt_lifecycle.py`` defines, starts, stops and undefines it and reads it back
through the same classes; ``virsh.py`` answers a host with no domain (does libvirtd answer, does it hold any
domain) through a ``virsh -r`` child, so an idle daemon never loads libvirt-python;
``cloudinit.py`` builds the seed ISO it boots with; ``consolelog.py`` reads and bounds its serial
console log; ``sshrelay.py`` is the SSH PTY into the guest under the terminal relay.
"""
