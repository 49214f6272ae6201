"""Task messages on ``gpuaas.node.<node>.task.<type>`` and their results (docs/contract.md).

The envelope is validated first; its ``type`` stays a string so that an
unknown type becomes a ``failed`` result with ``unsupported_task`` instead of a
message the consumer cannot even parse. The payload is validated against the
model of its type before any handler runs.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any, Literal

from pydantic import Field, ValidationError

from gpuaas_agent.contract.base import (
    SCHEMA_VERSION,
    SchemaVersion,
    SchemaVersionOrMultiSlot,
    WireEnum,
    WireModel,
    first_error,
)
from gpuaas_agent.contract.cloudinit import MAX_SSH_KEYS, GuestDriverProfile, Hostname, LinuxUserName, SshPublicKey
from gpuaas_agent.contract.fabricvf import FabricAttachment
from gpuaas_agent.contract.fleet import (
    DrainReport,
    MaintenancePayload,
    QuarantinedComponent,
    QuarantinePayload,
    UnquarantinePayload,
)
from gpuaas_agent.contract.slots import ApprovedSlot, SlotOutcome
from gpuaas_agent.contract.terminal import (
    TerminalClosePayload,
    TerminalDataPayload,
    TerminalOpenPayload,
    TerminalResizePayload,
)
from gpuaas_agent.contract.types import SHA256_PATTERN, UUID_PATTERN
from gpuaas_agent.errors import ContractError

NODE_ID_PATTERN = r"^[A-Za-z0-9-]{1,64}$"


class TaskType(WireEnum):
    topology_discover = "slice.topology_discover"
    preflight = "slice.preflight"
    plan = "slice.plan"
    vm_provision = "slice.vm_provision"
    vm_release = "slice.vm_release"
    reconcile = "slice.reconcile"
    vm_power = "slice.vm_power"
    terminal_open = "slice.terminal_open"
    terminal_data = "slice.terminal_data"
    terminal_resize = "slice.terminal_resize"
    terminal_close = "slice.terminal_close"
    console_log = "slice.console_log"
    maintenance = "slice.maintenance"
    quarantine = "slice.quarantine"
    unquarantine = "slice.unquarantine"


class TaskClass(WireEnum):
    """Which capacity a task takes on a node: a tenant's interactive work never takes the lifecycle's."""

    lifecycle = "lifecycle"  # provisions, releases, plans, reconciles, discovery, preflight, fleet operations
    interactive = "interactive"  # a tenant's power operations, terminal traffic and console reads


INTERACTIVE_TASKS = frozenset({TaskType.vm_power, TaskType.terminal_open, TaskType.terminal_data,
                               TaskType.terminal_resize, TaskType.terminal_close, TaskType.console_log})


def task_class(task_type: TaskType | None) -> TaskClass:
    """The class of ``task_type``; a type this agent does not know takes lifecycle capacity (it is answered fast)."""
    return TaskClass.interactive if task_type in INTERACTIVE_TASKS else TaskClass.lifecycle


class TaskEnvelope(WireModel):
    schema_version: SchemaVersionOrMultiSlot = SCHEMA_VERSION
    task_id: str = Field(min_length=1, max_length=200, pattern=r"^[A-Za-z0-9._:-]+$")
    type: str = Field(min_length=1, max_length=100)
    node_id: str = Field(pattern=NODE_ID_PATTERN)
    attempt: int = Field(ge=1)
    deadline: datetime
    payload: dict[str, Any]


class TopologyDiscoverPayload(WireModel):
    subnet: str = "10.100.0.0/24"
    ovs_bridge: str = "ovsbr0"


class PreflightPayload(WireModel):
    network_mode: Literal["private-nat"] = "private-nat"


class PlanPayload(WireModel):
    """The node-scheduler boundary: approved slot ids plus the control plane's records of them."""

    allocation_id: str = Field(pattern=UUID_PATTERN)
    approved_slot_ids: list[str] = Field(min_length=1)
    slots: list[ApprovedSlot] = Field(min_length=1)
    # v1.1: the profile the slots are for; its placement constraint is enforced on a multi-slot set.
    runtime_profile: str | None = None
    # The allocation's fabric attachment (docs/contract.md "Fabric VF"), echoed in the plan with each slot's
    # VF identity. The plan does not refuse without it; a provision under fabric_isolation=required does.
    fabric_attachment: FabricAttachment | None = None


class ImageRef(WireModel):
    """The image a provision clones; the agent fetches it only from sources its config allows."""

    url: str = Field(pattern=r"^(https|file)://")
    sha256: str = Field(pattern=SHA256_PATTERN)
    # Exact size in bytes, when the control plane knows it: it lowers the agent's size bound and a
    # source delivering another size fails (too_large / truncated) before the digest is compared.
    size_bytes: int | None = Field(default=None, gt=0)


MAX_SLOTS_PER_ALLOCATION = 16  # an 8-GPU node today; the bound keeps a hostile list small


class VmProvisionPayload(WireModel):
    allocation_id: str = Field(pattern=UUID_PATTERN)
    # The boot slot: its NVMe gets the image, its MAC/IP are the guest's vNIC.
    slot: ApprovedSlot
    # v1.1: every slot of a multi-GPU allocation, the boot slot included (empty: just ``slot``). One domain
    # gets every GPU, VF and NVMe; the other slots' disks are raw data disks (tasks/slotset.py).
    slots: list[ApprovedSlot] = Field(default_factory=list, max_length=MAX_SLOTS_PER_ALLOCATION)
    image: ImageRef
    runtime_profile: str = "h200_1g_24c_64g"
    # The tenant's input is checked here, at the edge (``invalid_payload`` naming the field), with the
    # very validators the guest seed uses: a key or name the seed would refuse never reaches a lease.
    hostname: Hostname
    user: LinuxUserName
    ssh_authorized_keys: list[SshPublicKey] = Field(min_length=1, max_length=MAX_SSH_KEYS)
    guest_driver_profile: GuestDriverProfile | None = None  # unknown names are refused at the edge
    # How long the control plane gives the guest to take its lease and answer SSH; None: the agent's config.
    readiness_timeout_s: int | None = Field(default=None, ge=5, le=7200)
    # The allocation's fabric attachment (Ethernet VLAN, or the InfiniBand partition the control plane bound the
    # slots' GUIDs into before sending this): applied to every slot's VF and read back before the domain
    # starts. Required where the profile passes a fabric VF through and [slice] fabric_isolation = "required".
    fabric_attachment: FabricAttachment | None = None
    # Opt-in guest telemetry: the agent pulls the exporter in the guest over the narrow
    # management path and adds its series to the allocation's SliceTelemetry. Only the yes/no travels: the port
    # and path are the agent's configuration, the address the slot's reservation (docs/security.md).
    guest_telemetry: bool = False


class VmReleasePayload(WireModel):
    allocation_id: str = Field(pattern=UUID_PATTERN)
    slot: ApprovedSlot
    # v1.1: every slot of the allocation to release (boot slot included); empty: just ``slot``.
    slots: list[ApprovedSlot] = Field(default_factory=list, max_length=MAX_SLOTS_PER_ALLOCATION)
    graceful_timeout_s: int = Field(default=120, ge=1, le=3600)


class VmPowerPayload(WireModel):
    """Stop, start, reboot or reset a tenant's slice; the host's own lease and slot record are the truth.

    The payload only names the slot (``slot_index``): its devices, MAC and bridge are read from
    the host's lease and the live domain, never taken from the wire. ``reboot`` is a graceful
    shutdown (deadline ``graceful_timeout_s``, then destroy) followed by a guarded start;
    ``reset`` is a hard reset of the running domain (the guest gets no say).
    """

    allocation_id: str = Field(pattern=UUID_PATTERN)
    slot_index: int = Field(ge=0, le=255)
    operation: Literal["start", "stop", "reboot", "reset"]
    graceful_timeout_s: int = Field(default=120, ge=0, le=3600)


class ConsoleLogPayload(WireModel):
    """The last ``tail_kib`` KiB of the serial console of an allocation's slot, also after its VM died.

    Only the allocation's own log is ever read: the file is named by ``allocation_id`` and
    ``slot_index`` on this host (host/vm/consolelog.py), and a slot another allocation holds, with no
    log of this allocation, is refused ``not_this_allocation``.
    """

    allocation_id: str = Field(pattern=UUID_PATTERN)
    slot_index: int = Field(ge=0, le=255)
    tail_kib: int = Field(default=64, ge=1, le=1024)


class ConsoleLogResult(WireModel):
    """``slice.console_log``'s output: the tail of the log that was asked for and fits the wire.

    ``text`` is the bytes decoded as UTF-8 with replacement characters. ``truncated``: the log holds
    more than ``returned_bytes``. ``cut_to_fit``: the tail asked for (``tail_kib``) did not fit the
    server's ``max_payload`` once JSON-escaped (a control byte takes six bytes as ``\\u00XX``), so a
    shorter tail was returned (``truncated`` is then true too): ask again with a smaller ``tail_kib``
    for less, there is no more to get in one result.
    """

    allocation_id: str = Field(pattern=UUID_PATTERN)
    slot_index: int = Field(ge=0, le=255)
    path: str
    size_bytes: int = Field(ge=0)
    returned_bytes: int = Field(ge=0)
    truncated: bool
    cut_to_fit: bool = False
    modified: datetime
    text: str


class ReconcilePayload(WireModel):
    repair: bool = True


PAYLOADS: dict[TaskType, type[WireModel]] = {
    TaskType.topology_discover: TopologyDiscoverPayload,
    TaskType.preflight: PreflightPayload,
    TaskType.plan: PlanPayload,
    TaskType.vm_provision: VmProvisionPayload,
    TaskType.vm_release: VmReleasePayload,
    TaskType.reconcile: ReconcilePayload,
    TaskType.vm_power: VmPowerPayload,
    TaskType.terminal_open: TerminalOpenPayload,
    TaskType.terminal_data: TerminalDataPayload,
    TaskType.terminal_resize: TerminalResizePayload,
    TaskType.terminal_close: TerminalClosePayload,
    TaskType.console_log: ConsoleLogPayload,
    TaskType.maintenance: MaintenancePayload,
    TaskType.quarantine: QuarantinePayload,
    TaskType.unquarantine: UnquarantinePayload,
}


class ResultStatus(WireEnum):
    succeeded = "succeeded"
    failed = "failed"
    cancelled = "cancelled"


class TaskErrorBody(WireModel):
    """``code`` is stable (``not_approved``, ``expired``, ``unsupported_task``, a guard's code...)."""

    code: str = Field(pattern=r"^[a-z][a-z0-9_]*$")
    message: str
    retryable: bool
    evidence: dict[str, Any] = Field(default_factory=dict)


# What a result's encoding and headers take beside its handler's ``output`` (schema version, task id (at most
# 200 characters), node, type, status, finish time, the ``Nats-Msg-Id`` header), with room to spare: a handler
# that sizes its output to the server's ``max_payload`` keeps this much free (control/resultfit.py).
RESULT_HEADROOM_BYTES = 2048


class TaskResult(WireModel):
    """Published to ``gpuaas.node.<node>.result``; the task is acked only after this is stored."""

    schema_version: SchemaVersion = SCHEMA_VERSION
    task_id: str
    node_id: str = Field(pattern=NODE_ID_PATTERN)
    type: str
    attempt: int = Field(ge=1)
    status: ResultStatus
    output: dict[str, Any] = Field(default_factory=dict)
    error: TaskErrorBody | None = None
    slot_outcomes: list[SlotOutcome] = Field(default_factory=list)
    finished_at: datetime


class ProgressEvent(WireModel):
    """``gpuaas.node.<node>.progress``: one pipeline step starting, advancing or ending."""

    schema_version: SchemaVersion = SCHEMA_VERSION
    task_id: str
    node_id: str = Field(pattern=NODE_ID_PATTERN)
    step: str
    status: Literal["started", "progress", "succeeded", "failed", "compensated"]
    percent: float | None = Field(default=None, ge=0, le=100)
    detail: dict[str, Any] = Field(default_factory=dict)
    at: datetime


# A health check's verdict, and the host's health state (the worst verdict, or unknown before the first round).
CheckStatus = Literal["ok", "degraded", "failed", "unavailable"]
HostHealth = Literal["unknown", "healthy", "degraded", "failed"]


class HealthCheck(WireModel):
    """One host health check as last run: ``ok``, ``degraded``/``failed`` (it moves ``health_state``),
    or ``unavailable`` (this host cannot answer it: no nvme-cli, no NVML, a recording; never a pass)."""

    name: str = Field(pattern=r"^[a-z][a-z0-9_]*$", max_length=64)
    status: CheckStatus
    detail: str = Field(max_length=4000)
    checked_at: datetime


class Heartbeat(WireModel):
    """``gpuaas.node.<node>.heartbeat`` every N seconds.

    ``health_state`` is the worst of the host's health checks (``health``) and the agent's own
    state (NATS reconnecting is ``degraded``); ``health_reason`` names the checks that set it.
    ``health`` and ``health_reason`` are optional: a control plane that predates them ignores nothing.
    """

    schema_version: SchemaVersion = SCHEMA_VERSION
    node_id: str = Field(pattern=NODE_ID_PATTERN)
    agent_version: str
    health_state: HostHealth
    health_reason: str | None = Field(default=None, max_length=4000)
    health: list[HealthCheck] = Field(default_factory=list)
    running_tasks: list[str] = Field(default_factory=list)
    leased_slots: list[int] = Field(default_factory=list)
    # Maintenance and its drain (``drained`` once no slice is left), and every quarantined component by name.
    maintenance: DrainReport | None = None
    quarantined: list[QuarantinedComponent] = Field(default_factory=list)
    at: datetime


def parse_task(raw: bytes) -> TaskEnvelope:
    """Validate a message from the wire; junk is a ``ContractError`` (``invalid_message``), never a crash."""
    try:
        return TaskEnvelope.model_validate_json(raw)
    except ValidationError as exc:
        raise ContractError(
            "task message does not match the contract",
            code="invalid_message",
            evidence={"errors": exc.errors(include_url=False, include_input=False)},
        ) from None


def task_payload(envelope: TaskEnvelope) -> tuple[TaskType, WireModel]:
    """The typed payload of a task; ``unsupported_task`` or ``invalid_payload`` otherwise."""
    try:
        task_type = TaskType(envelope.type)
    except ValueError:
        raise ContractError(
            f"task type {envelope.type!r} is not supported by this agent",
            code="unsupported_task",
            evidence={"type": envelope.type, "supported": [t.value for t in TaskType]},
        ) from None
    try:
        return task_type, PAYLOADS[task_type].from_wire(envelope.payload)
    except ValidationError as exc:
        raise invalid_payload(f"payload of {task_type.value}", exc) from None


def invalid_payload(what: str, exc: ValidationError) -> ContractError:
    """``invalid_payload`` naming the first bad field in one line (``evidence.field``), never a raw dump."""
    field, reason = first_error(exc)
    return ContractError(
        f"{what}: {field}: {reason}",
        code="invalid_payload",
        evidence={"field": field, "reason": reason,
                  "errors": [{k: e[k] for k in ("type", "loc", "msg") if k in e}
                             for e in exc.errors(include_url=False, include_input=False)][:10]},
    )
