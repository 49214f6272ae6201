"""Constrained value types shared by every contract model, and the one home of every shared identifier shape.

Each shape (PCI address, MAC, UUID, sha256, by-id name, ...) is written once
here, as a bare regex with no anchors, and used in two forms:

* ``*_PATTERN`` (``^shape$``) for pydantic ``pattern=``: pydantic-core runs it
  on Rust's regex engine, where ``$`` is the end of the text;
* ``*_RE``, compiled for Python code (discovery, the recorder, host drivers,
  guards): ``\\A(?:shape)\\Z``. Python's ``$`` also matches *before* a trailing
  newline, so ``^...$`` with ``.match`` takes ``"0000:18:00.0\\n"``; these
  match the whole string only, whether called with ``.match`` or ``.fullmatch``.

A second copy of a shape elsewhere is how the recorder once took only 4-digit
PCI domains while discovery took Intel VMD's 5-digit ones (``10000:e1:00.0``)
and a recording silently lost every disk behind VMD.
"""

from __future__ import annotations

import re
from typing import Annotated

from pydantic import StringConstraints

# -- shapes (bare, unanchored) --------------------------------------------------------

# Full PCI address with domain, lower case: 0000:1b:00.0 (Intel VMD domains have 5 digits: 10000:e1:00.0)
PCI_ADDRESS = r"[0-9a-f]{4,8}:[0-9a-f]{2}:[0-9a-f]{2}\.[0-7]"
# Unicast MAC in lower-case colon form.
MAC = r"[0-9a-f]{2}(:[0-9a-f]{2}){5}"
# An InfiniBand GUID (EUI-64) in the lower-case colon form ``ip link`` and pyroute2 print: 8 octets.
GUID = r"[0-9a-f]{2}(:[0-9a-f]{2}){7}"
# Lower-case canonical UUID (allocation ids, OVSDB row uuids).
UUID = r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}"
# A sha256 digest in lower-case hex: image identities and file proofs.
SHA256 = r"[0-9a-f]{64}"
# The link name udev writes under /dev/disk/by-id (docs/safety.md §2).
BY_ID_NAME = r"[A-Za-z0-9._:+@-]+"
BY_ID_PATH = rf"/dev/disk/by-id/{BY_ID_NAME}"
# Kernel block device name such as nvme4n1 (advisory only: it moves on reboot).
KERNEL_NAME = r"[A-Za-z0-9._:-]+"
# PCI ids as the kernel prints them: 0x10de
PCI_ID = r"0x[0-9a-f]{4}"
# An OVS bridge name as the agent's config and slots carry it (IFNAMSIZ: at most 15 characters).
BRIDGE_NAME = r"[A-Za-z0-9_.-]{1,15}"
# An OVS datapath type: "system", "netdev".
DATAPATH_TYPE = r"[a-z][a-z0-9_-]{0,31}"
# A block device number as sysfs "dev" and mountinfo print it: 259:3 (ASCII digits only, unlike \d).
MAJOR_MINOR = r"[0-9]+:[0-9]+"


def wire_pattern(shape: str) -> str:
    """``^shape$`` for pydantic ``pattern=`` (Rust regex: ``$`` is the end of the text)."""
    return f"^{shape}$"


def whole(shape: str, flags: int = 0) -> re.Pattern[str]:
    """``shape`` compiled to match a whole string only (``\\Z``, never before a trailing newline)."""
    return re.compile(rf"\A(?:{shape})\Z", flags)


# -- pydantic patterns ----------------------------------------------------------------

PCI_ADDRESS_PATTERN = wire_pattern(PCI_ADDRESS)
MAC_PATTERN = wire_pattern(MAC)
GUID_PATTERN = wire_pattern(GUID)
UUID_PATTERN = wire_pattern(UUID)
SHA256_PATTERN = wire_pattern(SHA256)
BY_ID_PATH_PATTERN = wire_pattern(BY_ID_PATH)
MAJOR_MINOR_PATTERN = wire_pattern(MAJOR_MINOR)
BRIDGE_NAME_PATTERN = wire_pattern(BRIDGE_NAME)
DATAPATH_TYPE_PATTERN = wire_pattern(DATAPATH_TYPE)

# -- compiled, for Python code --------------------------------------------------------

PCI_ADDRESS_RE = whole(PCI_ADDRESS)
MAC_RE = whole(MAC)
GUID_RE = whole(GUID)
UUID_RE = whole(UUID)
SHA256_RE = whole(SHA256)
BY_ID_NAME_RE = whole(BY_ID_NAME)
BY_ID_PATH_RE = whole(BY_ID_PATH)
MAJOR_MINOR_RE = whole(MAJOR_MINOR)
DATAPATH_TYPE_RE = whole(DATAPATH_TYPE)

# -- annotated types ------------------------------------------------------------------

PciAddress = Annotated[str, StringConstraints(pattern=PCI_ADDRESS_PATTERN)]
MacAddress = Annotated[str, StringConstraints(pattern=MAC_PATTERN)]
Guid = Annotated[str, StringConstraints(pattern=GUID_PATTERN)]
# A stable disk name: the only form a slot may use to name its NVMe (docs/safety.md §2).
ByIdPath = Annotated[str, StringConstraints(pattern=BY_ID_PATH_PATTERN)]
KernelName = Annotated[str, StringConstraints(pattern=wire_pattern(KERNEL_NAME))]
PciId = Annotated[str, StringConstraints(pattern=wire_pattern(PCI_ID))]
Sha256Hex = Annotated[str, StringConstraints(pattern=SHA256_PATTERN)]
Uuid = Annotated[str, StringConstraints(pattern=UUID_PATTERN)]

# What a disk *is*, whatever it is called (docs/safety.md §1): ``<kind>:<value>`` from the namespace's
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
