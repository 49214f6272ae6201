"""Names the agent gives to what it creates on a host, derived only from the allocation and slot.

Every room (libvirt domain XML, OVS port, dnsmasq reservation, reconcile) derives
names here, so a name seen on a host can be traced back to its allocation after an
agent restart without any local state. Limits that shape them: Linux interface
names are at most 15 bytes, and libvirt reserves tap names starting with ``vnet``.
"""

from __future__ import annotations

import re

from gpuaas_agent.contract.types import UUID_RE

DOMAIN_PREFIX = "gpuaas-slice-"
VNIC_PREFIX = "gs"  # never "vnet": libvirt reserves that prefix for its own taps
_UUID = UUID_RE


def _hex(allocation_id: str) -> str:
    if not _UUID.fullmatch(allocation_id):
        raise ValueError(f"allocation id {allocation_id!r} is not a lower-case UUID")
    return allocation_id.replace("-", "")


def domain_name(allocation_id: str) -> str:
    """``gpuaas-slice-<allocation id without dashes>`` (seed 002 Phase 5)."""
    return DOMAIN_PREFIX + _hex(allocation_id)


def vnic_name(allocation_id: str, slot_index: int) -> str:
    """The slot's tap/OVS port name: ``gs<slot hex>-<first 10 hex of the allocation>``, 14-15 bytes."""
    if not 0 <= slot_index <= 0xFF:
        raise ValueError(f"slot index {slot_index} out of range 0..255")
    return f"{VNIC_PREFIX}{slot_index:x}-{_hex(allocation_id)[:10]}"


def allocation_from_domain_name(name: str) -> str | None:
    """The allocation id a domain name was derived from, or None for a domain that is not ours."""
    if not name.startswith(DOMAIN_PREFIX):
        return None
    h = name[len(DOMAIN_PREFIX):]
    if not re.fullmatch(r"[0-9a-f]{32}", h):
        return None
    return f"{h[0:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:32]}"
