"""Wipe policies and the NVMe evidence a wipe proof carries (seed 002: tenant-isolation wipe policy).

A slot profile names *how* its disk is cleared between tenants (:class:`WipeMethod`):
``discard`` (blkdiscard, then every byte read back), ``zeroout`` (the device writes
zeroes), ``nvme_format`` (Format NVM with a secure erase setting) or ``nvme_sanitize``
(Sanitize: block erase, crypto erase or overwrite); ``auto`` picks one at validate. An NVMe method runs only when the controller says it can: the
capability it reported (``nvme id-ctrl`` / ``id-ns``) is part of the proof, so a
reviewer sees *why* the agent believed the erase was possible and whether the
device promised zeroes afterwards.
"""

from __future__ import annotations

from typing import Annotated, Final

from pydantic import AfterValidator, Field

from gpuaas_agent.contract.base import WireEnum, WireModel
from gpuaas_agent.contract.types import Uuid

NonNegative = Annotated[int, Field(ge=0)]
U32 = Annotated[int, Field(ge=0, le=0xFFFFFFFF)]


class WipeMethod(WireEnum):
    """How a slot disk is cleared between tenants: the one name a profile's policy, a lease and a proof use.

    A policy (``WipePolicy.method``) names what the profile asks for; a proof
    (``WipeProof.method``) records how the blocks were in fact cleared. ``auto`` (the
    default) is a policy's word only: it is resolved at validate, from what ``nvme
    id-ctrl``/``id-ns`` report, to a method whose post-condition the device must honour: a
    crypto erase (Sanitize, else Format) where the namespace reads erased blocks as zero and
    the erase stays inside the lease, else Write Zeroes; the lease stores the resolved method,
    never ``auto``. ``zero_fill`` is a proof's word only: how ``zeroout`` ran where the device
    refused Write Zeroes. ``discard`` is advisory: a profile may opt in, and then the proof
    reads the whole device back. Every method a policy can run (:data:`RUNNABLE`) is one
    module of ``gpuaas_agent/host/storage/wipemethods/``, registered in its ``WIPE_METHODS``.
    """

    auto = "auto"  # resolved at validate to one of the methods below (a policy's only)
    discard = "discard"  # blkdiscard: the device drops the blocks (Write Zeroes where it does not discard)
    zeroout = "zeroout"  # blkdiscard --zeroout: the device writes zeroes (WRITE ZEROES / offload)
    zero_fill = "zero_fill"  # the agent wrote zero buffers itself: zeroout on a device that refused it (a proof's only)
    nvme_format = "nvme_format"  # Format NVM with a secure erase setting (the proof's ``nvme`` says which)
    nvme_sanitize = "nvme_sanitize"  # Sanitize (block erase / crypto erase / overwrite; see ``nvme``)


# A policy names what it asks for; ``zero_fill`` is only ever how a ``zeroout`` ran.
PROOF_ONLY: Final = frozenset({WipeMethod.zero_fill})
# A proof names what ran; ``auto`` is only ever what a profile asked for before validate resolved it.
POLICY_ONLY: Final = frozenset({WipeMethod.auto})
# The methods a policy can run: each has exactly one module in host/storage/wipemethods (WIPE_METHODS).
RUNNABLE: Final = frozenset(WipeMethod) - PROOF_ONLY - POLICY_ONLY


def _policy_names(method: WipeMethod) -> WipeMethod:
    if method in PROOF_ONLY:
        raise ValueError(f"{method.value} is how a zeroout ran on a device that refused Write Zeroes, "
                         f"not a method a policy names")
    return method


def _proof_names(method: WipeMethod) -> WipeMethod:
    if method in POLICY_ONLY:
        raise ValueError(f"{method.value} is resolved before a wipe runs: a proof names the method that ran")
    return method


# The method a policy (and the ``policy`` a proof records) may name: any but a proof's own words.
PolicyMethod = Annotated[WipeMethod, AfterValidator(_policy_names),
                         Field(json_schema_extra={"not": {"enum": sorted(m.value for m in PROOF_ONLY)}})]
# The method a proof records as run: any but a policy's own words.
ProofMethod = Annotated[WipeMethod, AfterValidator(_proof_names),
                        Field(json_schema_extra={"not": {"enum": sorted(m.value for m in POLICY_ONLY)}})]


class FormatErase(WireEnum):
    """Format NVM's Secure Erase Setting: ``auto`` is crypto erase when FNA says so, else user-data erase."""

    auto = "auto"
    user_data = "user_data"
    crypto = "crypto"


class SanitizeAction(WireEnum):
    """Sanitize's action: ``auto`` is the first the controller supports of crypto erase, block erase, overwrite."""

    auto = "auto"
    crypto_erase = "crypto_erase"
    block_erase = "block_erase"
    overwrite = "overwrite"


class WipePolicy(WireModel):
    """How a slot profile's disk is cleared; the default is resolved from the device's capability at validate."""

    method: PolicyMethod = WipeMethod.auto
    format_erase: FormatErase = FormatErase.auto
    sanitize_action: SanitizeAction = SanitizeAction.auto
    # The erase command itself (sanitize: until the status log says it ended); verification comes on top.
    timeout_s: float = Field(default=3600.0, gt=0, le=7 * 86400)


class NvmeEraseAction(WireEnum):
    """The NVMe command the agent sent, with its erase setting."""

    format_user_data = "format_user_data"  # Format NVM, SES=1
    format_crypto = "format_crypto"  # Format NVM, SES=2
    sanitize_block_erase = "sanitize_block_erase"  # Sanitize, SANACT=2
    sanitize_overwrite = "sanitize_overwrite"  # Sanitize, SANACT=3
    sanitize_crypto_erase = "sanitize_crypto_erase"  # Sanitize, SANACT=4


class NvmeControllerCaps(WireModel):
    """What ``nvme id-ctrl`` reported that a wipe decision rests on (raw fields kept: they are the evidence)."""

    vid: Annotated[int, Field(ge=0, le=0xFFFF)]
    serial: str = Field(max_length=20)
    model: str = Field(max_length=40)
    firmware: str = Field(max_length=8)
    cntlid: Annotated[int, Field(ge=0, le=0xFFFF)]
    version: U32
    cmic: Annotated[int, Field(ge=0, le=0xFF)]
    oacs: Annotated[int, Field(ge=0, le=0xFFFF)]
    fna: Annotated[int, Field(ge=0, le=0xFF)]
    sanicap: U32
    nn: U32
    subnqn: str = Field(default="", max_length=256)

    @property
    def format_supported(self) -> bool:
        return bool(self.oacs & 0x2)  # OACS bit 1: Format NVM

    @property
    def format_all_namespaces(self) -> bool:
        return bool(self.fna & 0x1)  # FNA bit 0: a format applies to every namespace

    @property
    def secure_erase_all_namespaces(self) -> bool:
        return bool(self.fna & 0x2)  # FNA bit 1: a secure erase applies to every namespace

    @property
    def format_crypto_erase(self) -> bool:
        return bool(self.fna & 0x4)  # FNA bit 2: cryptographic erase as part of Format NVM

    @property
    def sanitize_crypto_erase(self) -> bool:
        return bool(self.sanicap & 0x1)  # SANICAP bit 0 (CES)

    @property
    def sanitize_block_erase(self) -> bool:
        return bool(self.sanicap & 0x2)  # SANICAP bit 1 (BES)

    @property
    def sanitize_overwrite(self) -> bool:
        return bool(self.sanicap & 0x4)  # SANICAP bit 2 (OWS)

    @property
    def no_deallocate_inhibited(self) -> bool:
        return bool(self.sanicap & (1 << 29))  # SANICAP bit 29 (NDI)

    @property
    def multi_controller(self) -> bool:
        return bool(self.cmic & 0x2)  # CMIC bit 1: the subsystem may have more than one controller


class NvmeNamespaceCaps(WireModel):
    """What ``nvme id-ns`` (and ``ns-descs``) reported for the leased namespace."""

    nsid: Annotated[int, Field(ge=1, le=0xFFFFFFFE)]
    nsze: NonNegative
    lba_bytes: Annotated[int, Field(ge=512, le=1 << 16)]
    flbas: Annotated[int, Field(ge=0, le=0xFF)]
    dlfeat: Annotated[int, Field(ge=0, le=0xFF)]
    nguid: str | None = Field(default=None, pattern=r"^[0-9a-f]{32}$")
    eui64: str | None = Field(default=None, pattern=r"^[0-9a-f]{16}$")
    uuid: Uuid | None = None

    @property
    def deallocated_reads_zero(self) -> bool:
        return self.dlfeat & 0x7 == 0x1  # DLFEAT bits 2:0 = 001b: deallocated blocks read back as zeroes


class NvmeCapabilities(WireModel):
    """Controller + namespace + the namespaces active on the controller: everything a method is chosen from."""

    controller: NvmeControllerCaps
    namespace: NvmeNamespaceCaps
    active_nsids: list[Annotated[int, Field(ge=1)]]
    # ``list-ns --all``: every namespace allocated in the subsystem, attached or not (None: not answered).
    # An erase that acts on all namespaces reaches the detached ones too.
    allocated_nsids: list[Annotated[int, Field(ge=1)]] | None = None
    source: str = Field(default="nvme-cli", max_length=200)  # tool (and version) that answered


class SanitizeStatus(WireModel):
    """One read of the sanitize status log (log page 0x81)."""

    sprog: Annotated[int, Field(ge=0, le=0xFFFF)]  # progress, in 1/65536ths
    status: Annotated[int, Field(ge=0, le=7)]  # SSTAT bits 2:0: 0 never, 1 done, 2 running, 3 failed, 4 done no-dealloc
    estimated_s: U32 | None = None  # the controller's estimate for the action run (None: not reported)
    cdw10: U32 | None = None  # SCDW10: the Sanitize command's dword 10 the log describes (its action in bits 2:0)


class NvmeEraseEvidence(WireModel):
    """The NVMe erase a proof rests on: what was sent, to what, and the capability that allowed it."""

    action: NvmeEraseAction
    argv: list[str]
    capabilities: NvmeCapabilities
    # The identity the lease holds and the one the controller reported just before the command.
    lease_identity: str
    device_identity: str
    zeros_guaranteed: bool  # DLFEAT says erased (deallocated) blocks read back as zeroes
    estimated_s: U32 | None = None
    status_polls: NonNegative = 0
    final_status: SanitizeStatus | None = None
    duration_s: Annotated[float, Field(ge=0)]


class WholeDeviceCheck(WireModel):
    """Every byte of the device read back: made when the method does not promise zeroes."""

    bytes_read: NonNegative
    all_zero: bool
    first_nonzero_offset: NonNegative | None = None
    duration_s: Annotated[float, Field(ge=0)]
