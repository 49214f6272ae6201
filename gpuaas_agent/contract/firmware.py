"""Firmware inventory of a host: what a slice uses and what a tenant could reflash through passthrough.

One :class:`FirmwareComponent` per device (keyed ``kind:id``, the id a PCI address, or ``dmi``
for the system BIOS); ``version`` None when it could not be read, with ``source`` saying where
it was looked for. A :class:`FirmwareBaselineRule` says which versions a site allows for a kind
(optionally one model); a component outside its rule is a ``firmware_drift`` finding and a
parity FAIL. :class:`FirmwareChange` is one difference between two inventories (before and
after a tenancy).
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from gpuaas_agent.contract.base import WireModel

FirmwareKind = Literal["gpu_vbios", "nvswitch_fw", "nic_fw", "nvme_fw", "bios"]


class FirmwareComponent(WireModel):
    kind: FirmwareKind
    id: str = Field(description="PCI address of the function, or 'dmi' for the system BIOS")
    version: str | None = Field(default=None, description="None: not readable here (see source)")
    model: str | None = Field(default=None, description="what the baseline matches: NVMe model, NIC board id (PSID)...")
    source: str = Field(description="the file or command the version came from, or why there is none")
    physfn: str | None = Field(default=None, description="an SR-IOV VF's PF: the firmware a VF runs is its PF's")

    @property
    def key(self) -> str:
        return f"{self.kind}:{self.id}"


class FirmwareInventory(WireModel):
    source: Literal["live", "fixture"]
    components: list[FirmwareComponent] = Field(default_factory=list)

    def by_key(self) -> dict[str, FirmwareComponent]:
        return {c.key: c for c in self.components}


class FirmwareBaselineRule(WireModel):
    """The versions a site allows for ``kind`` (and ``model``, when given: only components of that model)."""

    kind: FirmwareKind
    model: str | None = Field(default=None, min_length=1, max_length=200)
    versions: list[str] = Field(min_length=1, max_length=32)


class FirmwareChange(WireModel):
    """One component whose firmware differs between two readings (``None``: absent or unreadable there)."""

    kind: FirmwareKind
    id: str
    before: str | None
    after: str | None
    change: Literal["changed", "appeared", "disappeared", "unreadable"]
