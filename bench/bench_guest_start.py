"""Time from ``start`` to guest-visible devices as guest memory grows, per memory backing (issue 20, item 4).

A VFIO guest has all its RAM pinned before its vCPUs run: QEMU maps every page for DMA at
device realize, touching each one from one thread. Large (multi-GPU, 512 GiB+) guests
spend that time on every start. This measures the same work on TCG guests in the lab:

* ``touch-1``: memfd backing, ``<allocation mode='immediate' threads='1'/>`` — every page touched
  by one thread before the guest runs (what VFIO pinning costs);
* ``touch-N``: the same with N threads (what ``domain_xml`` uses for passthrough guests);
* ``lazy``: anonymous memory, no preallocation (the TCG lab's default; not possible with VFIO);
* ``huge-…-N``: hugepage-backed memfd with N threads — 1 GiB pages when the kernel can give them
  now, else 2 MiB pages (reported as such).

"Guest-visible devices" is QEMU's PCI view (QMP ``query-pci`` lists the expander bus, its root
ports and the virtio device behind them), polled from ``virDomainCreate`` on: the devices a
guest firmware would enumerate. There is no guest OS: its boot time is not what changes here.

Needs root (its own libvirtd via ``tests/support/libvirtd_fixture.py``; hugepages are reserved for the
run and the previous counts restored). Prints medians; never asserts a time.
``python bench/bench_guest_start.py [--sizes-mib 1024,2048,4096] [--runs 3] [--threads 2]``
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import libvirt
import libvirt_qemu

from tests.support.libvirtd_fixture import running_libvirtd

HUGEPAGES = Path("/sys/kernel/mm/hugepages")
QUERY_DEADLINE_S = 120.0


def _domain_xml(name: str, memory_mib: int, variant: str, threads: int, page_kib: int | None) -> str:
    backing = ""
    if variant != "lazy":
        pages = f"<hugepages><page size='{page_kib}' unit='KiB'/></hugepages>" if page_kib else ""
        backing = (f"<memoryBacking>{pages}<source type='memfd'/>"
                   f"<allocation mode='immediate' threads='{threads}'/></memoryBacking>")
    return f"""<domain type='qemu'>
  <name>{name}</name>
  <memory unit='MiB'>{memory_mib}</memory>
  {backing}
  <vcpu>1</vcpu>
  <os><type arch='x86_64' machine='q35'>hvm</type></os>
  <devices>
    <controller type='pci' index='0' model='pcie-root'/>
    <controller type='pci' index='1' model='pcie-expander-bus'>
      <model name='pxb-pcie'/><target busNr='128'/>
      <address type='pci' domain='0x0000' bus='0x00' slot='0x01' function='0x0'/>
    </controller>
    <controller type='pci' index='2' model='pcie-root-port'>
      <model name='pcie-root-port'/><target chassis='2' port='0x0'/>
      <address type='pci' domain='0x0000' bus='0x01' slot='0x00' function='0x0'/>
    </controller>
    <rng model='virtio'>
      <backend model='random'>/dev/urandom</backend>
      <address type='pci' domain='0x0000' bus='0x02' slot='0x00' function='0x0'/>
    </rng>
    <memballoon model='none'/>
  </devices>
</domain>"""


VIRTIO_VENDOR = 0x1AF4


def _has_vendor(node, vendor: int) -> bool:
    if isinstance(node, dict):
        if isinstance(node.get("id"), dict) and node["id"].get("vendor") == vendor:
            return True
        return any(_has_vendor(v, vendor) for v in node.values())
    if isinstance(node, list):
        return any(_has_vendor(v, vendor) for v in node)
    return False


def _devices_visible(dom) -> bool:
    """QEMU's PCI view (every bus, the expander's included) lists the virtio device behind its root port."""
    reply = json.loads(libvirt_qemu.qemuMonitorCommand(dom, '{"execute":"query-pci"}', 0))
    return _has_vendor(reply.get("return", []), VIRTIO_VENDOR)


def _start_to_devices(conn, xml: str) -> float:
    dom = conn.defineXML(xml)
    try:
        started = time.perf_counter()
        dom.create()
        deadline = time.monotonic() + QUERY_DEADLINE_S
        while not _devices_visible(dom):
            if time.monotonic() > deadline:
                raise RuntimeError("devices never became visible")
            time.sleep(0.01)  # poll step of the deadline wait above
        return time.perf_counter() - started
    finally:
        if dom.isActive():
            dom.destroy()
        dom.undefine()


def _reserve(page_kib: int, pages: int) -> tuple[int, int]:
    """Ask the kernel for ``pages`` more pages of ``page_kib``; returns (previous count, pages now free)."""
    path = HUGEPAGES / f"hugepages-{page_kib}kB" / "nr_hugepages"
    if not path.exists():
        return -1, 0
    before = int(path.read_text())
    path.write_text(str(before + pages))
    free = int((path.parent / "free_hugepages").read_text())
    return before, free


def _restore(page_kib: int, count: int) -> None:
    if count >= 0:
        (HUGEPAGES / f"hugepages-{page_kib}kB" / "nr_hugepages").write_text(str(count))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes-mib", default="1024,2048,4096")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 2)
    args = parser.parse_args(argv)
    if os.geteuid() != 0:
        print("bench_guest_start needs root (libvirtd, hugepages)", file=sys.stderr)
        return 2
    sizes = [int(s) for s in args.sizes_mib.split(",")]
    largest_gib = -(-max(sizes) // 1024)
    # 1 GiB pages when the kernel can hand them out now; else 2 MiB pages; every reservation is undone.
    reserved: list[tuple[int, int]] = []
    page_kib: int | None = None
    for kib, count in ((1048576, largest_gib), (2048, largest_gib * 512)):
        previous, free = _reserve(kib, count)
        reserved.append((kib, previous))
        if free >= count:
            page_kib = kib
            break
        _restore(kib, previous)
    hugepage_note = {1048576: "1 GiB pages", 2048: "2 MiB pages (1 GiB pages could not be reserved now)",
                     None: "none: the kernel gave no hugepages"}[page_kib]
    variants = ["lazy", "touch-1", f"touch-{args.threads}"] + ([f"huge-{args.threads}"] if page_kib else [])
    results: dict[str, dict[int, float]] = {v: {} for v in variants}
    try:
        with tempfile.TemporaryDirectory(prefix="bench-guest-start-") as work, running_libvirtd(Path(work)):
            conn = libvirt.open("qemu:///system")
            try:
                for size in sizes:
                    samples: dict[str, list[float]] = {v: [] for v in variants}
                    for _ in range(args.runs):
                        for variant in variants:  # interleaved: drift hits every variant alike
                            kind, _, n = variant.partition("-")
                            xml = _domain_xml(f"bench-start-{uuid.uuid4().hex[:8]}", size,
                                              "lazy" if kind == "lazy" else "touch", int(n or 1),
                                              page_kib if kind == "huge" else None)
                            samples[variant].append(_start_to_devices(conn, xml))
                    for variant in variants:
                        results[variant][size] = statistics.median(samples[variant])
            finally:
                conn.close()
    finally:
        for kib, previous in reserved:
            _restore(kib, previous)
    print(f"start -> devices visible in QMP query-pci, median of {args.runs}; hugepages: {hugepage_note}; "
          f"{os.cpu_count()} CPUs")
    print("| memory | " + " | ".join(variants) + " |")
    print("|---|" + "---|" * len(variants))
    for size in sizes:
        print(f"| {size} MiB | " + " | ".join(f"{results[v][size]:.2f} s" for v in variants) + " |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
