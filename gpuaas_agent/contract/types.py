"""Constrained value types shared by every contract model."""

from __future__ import annotations

from typing import Annotated

from pydantic import StringConstraints

# Full PCI address with domain, lower case: 0000:1b:00.0 (Intel VMD domains have 5 digits: 10000:e1:00.0)
PciAddress = Annotated[str, StringConstraints(pattern=r"^[0-9a-f]{4,8}:[0-9a-f]{2}:[0-9a-f]{2}\.[0-7]$")]

# Unicast MAC in lower-case colon form.
MacAddress = Annotated[str, StringConstraints(pattern=r"^[0-9a-f]{2}(:[0-9a-f]{2}){5}$")]

# A stable disk name: the only form a slot may use to name its NVMe (DESIGN.md §4.2).
BY_ID_NAME = r"[A-Za-z0-9._:+@-]+"  # the link name udev writes; also used by discovery and the disk guard
ByIdPath = Annotated[str, StringConstraints(pattern=rf"^/dev/disk/by-id/{BY_ID_NAME}$")]

# Kernel block device name such as nvme4n1 (advisory only: it moves on reboot).
KernelName = Annotated[str, StringConstraints(pattern=r"^[A-Za-z0-9._:-]+$")]

# PCI ids as the kernel prints them: 0x10de
PciId = Annotated[str, StringConstraints(pattern=r"^0x[0-9a-f]{4}$")]

# A sha256 digest in lower-case hex: image identities and file proofs.
Sha256Hex = Annotated[str, StringConstraints(pattern=r"^[0-9a-f]{64}$")]

# What a disk *is*, whatever it is called (DESIGN.md §4.1): ``<kind>:<value>`` from the namespace's
# sysfs identity, strongest first: uuid, nguid, eui (NVMe namespace ids), wwid, then dev (major:minor,
# for a block device with no stable id). ``path:<by-id>`` only on leases migrated from a store that
# predates identities (state migration 4). Every alias of one namespace has the same identity.
DISK_IDENTITY_KINDS = ("uuid", "nguid", "eui", "wwid", "dev", "path")
DiskIdentity = Annotated[
    str, StringConstraints(pattern=rf"^({'|'.join(DISK_IDENTITY_KINDS)}):[\x21-\x7e]{{1,256}}$")]

# A dotted-quad IPv4 address as the control plane spells a slot's private IP (no leading zeros,
# no prefix, no whitespace or newline: it is written into dnsmasq's hosts file and the guest's seed).
_OCTET = r"(25[0-5]|2[0-4][0-9]|1[0-9][0-9]|[1-9]?[0-9])"
IPv4String = Annotated[str, StringConstraints(pattern=rf"^{_OCTET}(\.{_OCTET}){{3}}$")]
