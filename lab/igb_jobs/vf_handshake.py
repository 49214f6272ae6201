"""Runs INSIDE the igb guest: does ``igbvf`` complete its mailbox reset with the PF (exploration, not a test)?

The shortest path to the point where every VF-to-VF frame run failed: the PF up (carrier first), ``numvfs``
VFs, the VF driver's probe. Prints one JSON document: the kernel's igb/igbvf lines, the PF's MSI-X vectors
in ``/proc/interrupts`` before and after the VFs, each VF netdev's carrier and MAC. Run it with QEMU's
trace on (``lab/igb_guest.py lab/igb_jobs/vf_handshake.py --smp 2 --trace 'igb_*' --trace
'e1000e_core_*' --keep DIR``) and read ``DIR/qemu-trace.log`` for the register traffic of the handshake.
``IGB_HANDSHAKE_NUMVFS`` (default 1) sets how many VFs.

Two probes of each VF: the one ``sriov_numvfs`` triggers (autoprobe: it runs inside ``pci_enable_sriov``, before
the PF driver's SR-IOV re-init has reopened the PF), then an ``igbvf`` unbind + bind once the PF is reopened.
Between phases the job reads the PF's PCI config space at ``MARKER_BASE + 4 * phase``, so each phase starts with
a recognisable ``pci_cfg_read`` line in QEMU's trace (enable that event too).
"""

import json
import os
import subprocess
import time

from igb_jobs.guestsys import driver_of, igb_pfs

DEADLINE_S = 20.0
NUMVFS = int(os.environ.get("IGB_HANDSHAKE_NUMVFS", "1"))
MARKER_BASE = 0x400  # in the PF's extended PCI config space, past its capabilities: nothing reads it


def marker(pf_pci, phase):
    """One 4-byte config-space read of the PF at ``MARKER_BASE + 4 * phase``: a phase mark in QEMU's trace
    (``pci_cfg_read igb ... @0x404``). BAR 0 cannot be mapped for this: igb holds it (strict devmem, EINVAL)."""
    fd = os.open(f"/sys/bus/pci/devices/{pf_pci}/config", os.O_RDONLY)
    try:
        return int.from_bytes(os.pread(fd, 4, MARKER_BASE + 4 * phase), "little")
    finally:
        os.close(fd)


def sysfs(path):
    try:
        with open(path) as fh:
            return fh.read().strip()
    except OSError as exc:  # carrier of a link that is down: EINVAL
        return f"error: {exc.strerror}"


def wait_until(check, deadline_s=DEADLINE_S):
    deadline = time.monotonic() + deadline_s
    while time.monotonic() < deadline:
        if check():
            return True
        time.sleep(0.1)
    return check()


def pf_interrupts():
    with open("/proc/interrupts") as fh:
        return [" ".join(ln.split()) for ln in fh if "igb" in ln or "eth" in ln or "enp" in ln]


def kernel_lines():
    log = subprocess.run(["dmesg"], capture_output=True, text=True, timeout=30).stdout
    return [ln for ln in log.splitlines() if "igb" in ln or "VF" in ln or "sriov" in ln.lower()]


def vf_netdevs():
    return sorted(n for n in os.listdir("/sys/class/net") if driver_of(n) == "igbvf")


def vf_state():
    for name in vf_netdevs():
        subprocess.run(["ip", "link", "set", name, "up"], check=False, timeout=30)
    wait_until(lambda: all(sysfs(f"/sys/class/net/{n}/carrier") == "1" for n in vf_netdevs()), 10.0)
    return {n: {"carrier": sysfs(f"/sys/class/net/{n}/carrier"), "mac": sysfs(f"/sys/class/net/{n}/address"),
                "pci": os.path.basename(os.path.realpath(f"/sys/class/net/{n}/device"))}
            for n in vf_netdevs()}  # fmt: skip


def main():
    pf = igb_pfs()[0]
    dev = f"/sys/class/net/{pf}/device"
    pf_pci = os.path.basename(os.path.realpath(dev))
    report = {"pf": pf, "pf_pci": pf_pci, "numvfs": NUMVFS, "marker_base": hex(MARKER_BASE)}
    marker(pf_pci, 1)  # phase 1: the PF up
    subprocess.run(["ip", "link", "set", pf, "up"], check=True, timeout=30)
    report["pf_carrier"] = wait_until(lambda: sysfs(f"/sys/class/net/{pf}/carrier") == "1")
    report["interrupts_before"] = pf_interrupts()
    marker(pf_pci, 2)  # phase 2: sriov_numvfs (igbvf autoprobes inside pci_enable_sriov)
    with open(f"{dev}/sriov_numvfs", "w") as fh:
        fh.write(str(NUMVFS))
    wait_until(lambda: len(vf_netdevs()) >= NUMVFS)
    report["vfs_autoprobe"] = vf_state()
    report["interrupts_autoprobe"] = pf_interrupts()
    vf_pci = [os.path.basename(os.path.realpath(f"{dev}/virtfn{i}")) for i in range(NUMVFS)]
    marker(pf_pci, 3)  # phase 3: igbvf rebound with the PF reopened
    for pci in vf_pci:
        with open("/sys/bus/pci/drivers/igbvf/unbind", "w") as fh:
            fh.write(pci)
        with open("/sys/bus/pci/drivers/igbvf/bind", "w") as fh:
            fh.write(pci)
    wait_until(lambda: len(vf_netdevs()) >= NUMVFS)
    report["vfs_rebound"] = vf_state()
    report["interrupts_rebound"] = pf_interrupts()
    marker(pf_pci, 4)  # phase 4: done
    report["kernel"] = kernel_lines()[-80:]
    print(json.dumps(report, sort_keys=True))


main()
