"""Multi-GPU domain goldens accepted by libvirt's real QEMU driver (not only its schema and the test driver).

The QEMU driver checks what the schema cannot: controller/bus placement of the expanders and root
ports, reserved fw_cfg names (why the OVMF window is a ``qemu:commandline`` argument), memory
backing combinations. ``domainXMLToNative`` then shows the QEMU arguments the guest topology becomes.
A domain whose cells need host NUMA node 1 cannot be turned into arguments on a one-node CI
machine, so the native check uses the one-node (two-GPU) golden.
"""

from __future__ import annotations

from pathlib import Path

import libvirt

from gpuaas_agent.host.vm.domain_config import Domain, owned_diff
from tests.support.libvirtd_fixture import running_libvirtd

GOLDEN = Path(__file__).resolve().parent.parent.parent / "golden" / "domain"
MULTI_GPU = ("h200-slot0-numa0", "h200-2gpu-numa0", "h200-4gpu-2numa", "h200-8gpu")


def test_multi_gpu_goldens_define_on_the_qemu_driver_and_become_pxb_numa_arguments(tmp_path):
    with running_libvirtd(tmp_path / "libvirtd"):
        conn = libvirt.open("qemu:///system")
        try:
            for name in MULTI_GPU:
                dom = conn.defineXMLFlags((GOLDEN / f"{name}.xml").read_text(), libvirt.VIR_DOMAIN_DEFINE_VALIDATE)
                try:
                    assert dom.XMLDesc().count("pcie-expander-bus") >= 1, name
                    # Every element we wrote, <qemu:commandline> included, is what the QEMU driver holds.
                    live = Domain.parse_str(dom.XMLDesc(libvirt.VIR_DOMAIN_XML_INACTIVE))
                    assert owned_diff(Domain.parse_str((GOLDEN / f"{name}.xml").read_text()), live) == [], name
                    if name == "h200-2gpu-numa0":
                        argv = conn.domainXMLToNative("qemu-argv", dom.XMLDesc())
                finally:
                    dom.undefineFlags(libvirt.VIR_DOMAIN_UNDEFINE_NVRAM)
        finally:
            conn.close()
    assert '"driver":"pxb-pcie","bus_nr":128,"id":"pci.1","numa_node":0' in argv
    assert "-fw_cfg name=opt/ovmf/X-PciMmio64Mb,string=2097152" in argv
    assert '"qom-type":"memory-backend-memfd"' in argv and '"prealloc-threads":16' in argv
    assert '"hugetlbsize":1073741824' in argv and '"host-nodes":[0],"policy":"bind"' in argv
    assert "-overcommit mem-lock=on" in argv
    assert argv.count('"driver":"vfio-pci"') == 4  # two GPUs, two VFs
