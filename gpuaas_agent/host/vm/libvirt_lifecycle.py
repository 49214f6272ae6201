"""Slot domains over libvirt-python: define, start, stop, undefine, look up, list (seed 002 Phase 5).

libvirt calls block (an RPC to libvirtd, or the in-process test driver), so
each runs on this object's own small thread pool and the asyncio loop never
waits on one; each call has a deadline (``call_timeout_s``). Every operation is
a function of the connection that looks the domain up again, so after a lost
connection it is safe to reconnect (with backoff, each attempt logged) and run
it again: a define that had landed comes back as ``existing``, a start as the
running domain, an undefine as "already absent".

libvirt-python itself (~11 MiB RSS with the libraries it links) is imported by the first connection, not
with this module: a host with no domain never opens one. Until this object has opened its connection, a
domain listing asks a ``virsh -r`` child first (``host/vm/virsh.py``) and answers "none" from it without
the binding; any domain, or a virsh that cannot answer, and the listing is made in-process as always.

Safety, in this driver rather than in callers:
- only domains carrying our ``<metadata>`` are started, stopped or undefined;
- a domain with our name but another owner is never overwritten;
- ``start`` needs the :class:`VmStartEvidence` of the start guard for that domain;
- a running domain is never undefined (it would live on as a transient domain the agent forgets);
- undefine removes the UEFI NVRAM (seed 004: a plain undefine left shut-off UEFI
  domains holding the raw NVMe); a driver that rejects the flag (the test driver)
  gets a plain undefine, and the outcome says so.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

from gpuaas_agent.contract.domain import (
    METADATA_NS,
    DefineOutcome,
    DomainDevices,
    DomainInfo,
    DomainInterface,
    DomainMetadata,
    DomainSpec,
    DomainState,
    ResetOutcome,
    ShutdownOutcome,
    UndefineOutcome,
    VmStartEvidence,
)
from gpuaas_agent.errors import GuardError, HostError
from gpuaas_agent.host.vm.virsh import domain_names
from gpuaas_agent.logs import log_event

if TYPE_CHECKING:  # the binding is imported by the first connection (see the module docstring)
    import libvirt

    from gpuaas_agent.host.vm.domain_config import Domain

log = logging.getLogger(__name__)
T = TypeVar("T")



@dataclass(frozen=True)
class _Codes:
    """libvirt's numbers this driver compares with, read from the binding once it is loaded."""

    states: dict[int, DomainState]
    # The bulk stats groups slice telemetry reads (host/vm/domstats.py parses them), one call for every domain.
    stats_groups: int
    # A driver that does not know a flag says so with one of these (the test driver: VIR_ERR_INVALID_ARG).
    flag_rejected: frozenset[int]
    connection_lost: frozenset[int]
    transport_domains: frozenset[int]


@functools.cache
def _codes() -> _Codes:
    import libvirt

    return _Codes(
        states={
            libvirt.VIR_DOMAIN_NOSTATE: DomainState.nostate,
            libvirt.VIR_DOMAIN_RUNNING: DomainState.running,
            libvirt.VIR_DOMAIN_BLOCKED: DomainState.blocked,
            libvirt.VIR_DOMAIN_PAUSED: DomainState.paused,
            libvirt.VIR_DOMAIN_SHUTDOWN: DomainState.shutdown,
            libvirt.VIR_DOMAIN_SHUTOFF: DomainState.shutoff,
            libvirt.VIR_DOMAIN_CRASHED: DomainState.crashed,
            libvirt.VIR_DOMAIN_PMSUSPENDED: DomainState.pmsuspended,
        },
        stats_groups=(libvirt.VIR_DOMAIN_STATS_STATE | libvirt.VIR_DOMAIN_STATS_CPU_TOTAL
                      | libvirt.VIR_DOMAIN_STATS_BALLOON | libvirt.VIR_DOMAIN_STATS_VCPU
                      | libvirt.VIR_DOMAIN_STATS_INTERFACE | libvirt.VIR_DOMAIN_STATS_BLOCK),
        flag_rejected=frozenset({libvirt.VIR_ERR_INVALID_ARG, libvirt.VIR_ERR_NO_SUPPORT,
                                 libvirt.VIR_ERR_ARGUMENT_UNSUPPORTED}),
        connection_lost=frozenset({libvirt.VIR_ERR_INVALID_CONN, libvirt.VIR_ERR_NO_CONNECT, libvirt.VIR_ERR_RPC}),
        transport_domains=frozenset({libvirt.VIR_FROM_RPC, libvirt.VIR_FROM_REMOTE}),
    )


def _state_of(code: int) -> DomainState:
    return _codes().states.get(code, DomainState.nostate)


class LibvirtError(HostError):
    """A libvirt call failed; evidence carries libvirt's code, domain and message."""

    default_code = "libvirt_error"


class LibvirtConnectionError(LibvirtError):
    """libvirt stayed unreachable through every reconnect attempt."""

    default_code = "libvirt_unreachable"


class DomainNotFoundError(LibvirtError):
    default_code = "domain_not_found"


class DomainRefused(GuardError):
    """The driver refused to act on a domain. Codes: ``domain_name_conflict``, ``not_agent_domain``,
    ``domain_running``, ``start_evidence_mismatch``."""

    default_code = "domain_refused"


class _ConnectionLost(Exception):
    def __init__(self, error: libvirt.libvirtError) -> None:
        super().__init__(str(error))
        self.error = error


def _error_evidence(exc: libvirt.libvirtError) -> dict[str, Any]:
    return {"libvirt_code": exc.get_error_code(), "libvirt_domain": exc.get_error_domain(), "libvirt_message": str(exc)}


def _wrap(exc: libvirt.libvirtError, what: str, **evidence: Any) -> LibvirtError:
    return LibvirtError(f"{what}: {exc}", evidence={**evidence, **_error_evidence(exc)})


def _quiet_libvirt_errors(_ctx: Any, _err: Any) -> None:
    """libvirt prints every error to stderr by default; ours are raised and logged as events instead."""


class LibvirtLifecycle:
    """Async facade over one libvirt connection (``qemu:///system`` in production, ``test:///default`` in tests)."""

    def __init__(
        self,
        uri: str,
        *,
        reconnect_attempts: int = 5,
        backoff_s: float = 0.2,
        backoff_max_s: float = 5.0,
        workers: int = 4,
        call_timeout_s: float = 120.0,
    ) -> None:
        self.uri = uri
        self.call_timeout_s = call_timeout_s
        self.reconnect_attempts = reconnect_attempts
        self.backoff_s = backoff_s
        self.backoff_max_s = backoff_max_s
        self.reconnects = 0  # successful reconnections after a loss, for heartbeats and tests
        self._conn: libvirt.virConnect | None = None
        self._conn_lock = threading.Lock()
        self._executor = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="libvirt")
        self.opened = False  # a connection was opened once: the binding is loaded, every call goes through it

    async def __aenter__(self) -> LibvirtLifecycle:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        conn, self._conn = self._conn, None
        loop = asyncio.get_running_loop()
        if conn is not None:
            await loop.run_in_executor(self._executor, self._close_quietly, conn)
        self._executor.shutdown(wait=True)

    # -- connection ---------------------------------------------------------------

    @staticmethod
    def _close_quietly(conn: libvirt.virConnect) -> None:
        import libvirt

        try:
            conn.close()
        except libvirt.libvirtError:
            pass  # already dead: that is why it is being dropped

    @staticmethod
    def _is_loss(exc: libvirt.libvirtError) -> bool:
        import libvirt

        code = exc.get_error_code()
        codes = _codes()
        return code in codes.connection_lost or (
            code == libvirt.VIR_ERR_SYSTEM_ERROR and exc.get_error_domain() in codes.transport_domains
        )

    def _invoke(self, what: str, op: Callable[[libvirt.virConnect], T]) -> T:
        """Runs on a worker thread: (re)open the connection, run ``op``; a transport failure becomes _ConnectionLost,
        any other libvirt error a :class:`LibvirtError`. The binding is imported here, by the first call."""
        import libvirt

        conn = None
        try:
            with self._conn_lock:  # two workers must not both open a connection
                if self._conn is None:
                    libvirt.registerErrorHandler(_quiet_libvirt_errors, None)
                    self._conn = libvirt.open(self.uri)
                    self.opened = True
                conn = self._conn
            return op(conn)
        except libvirt.libvirtError as exc:
            if not self._is_loss(exc):  # anything the operation did not turn into a typed error itself
                raise _wrap(exc, f"libvirt {what} failed", uri=self.uri, op=what) from None
            with self._conn_lock:
                if self._conn is conn:
                    self._conn = None
            if conn is not None:
                self._close_quietly(conn)
            raise _ConnectionLost(exc) from None

    async def _call(self, what: str, op: Callable[[libvirt.virConnect], T]) -> T:
        loop = asyncio.get_running_loop()
        lost: list[dict[str, Any]] = []
        delay = self.backoff_s
        while True:
            try:
                result = await asyncio.wait_for(
                    loop.run_in_executor(self._executor, self._invoke, what, op), timeout=self.call_timeout_s
                )
            except TimeoutError:
                # The worker stays blocked in libvirt; the connection it holds is wedged: the next call opens another.
                with self._conn_lock:
                    self._conn = None
                log_event(log, "libvirt_call_timeout", logging.ERROR, uri=self.uri, op=what,
                          timeout_s=self.call_timeout_s)
                raise LibvirtError(
                    f"libvirt {what} did not answer within {self.call_timeout_s} s",
                    code="libvirt_timeout",
                    evidence={"uri": self.uri, "op": what, "timeout_s": self.call_timeout_s},
                ) from None
            except _ConnectionLost as loss:
                lost.append(_error_evidence(loss.error))
                if len(lost) > self.reconnect_attempts:
                    log_event(log, "libvirt_unreachable", logging.ERROR, uri=self.uri, op=what, attempts=len(lost))
                    raise LibvirtConnectionError(
                        f"libvirt at {self.uri} unreachable after {len(lost)} attempts ({what})",
                        evidence={"uri": self.uri, "op": what, "attempts": lost},
                    ) from None
                log_event(log, "libvirt_connection_lost", logging.WARNING, uri=self.uri, op=what,
                          attempt=len(lost), retry_in_s=delay, error=str(loss.error))
                await asyncio.sleep(delay)
                delay = min(delay * 2, self.backoff_max_s)
                continue
            if lost:
                self.reconnects += 1
                log_event(log, "libvirt_reconnected", uri=self.uri, op=what, attempts=len(lost))
            return result

    # -- reading ------------------------------------------------------------------

    @staticmethod
    def _lookup(conn: libvirt.virConnect, name: str) -> libvirt.virDomain | None:
        import libvirt

        try:
            return conn.lookupByName(name)
        except libvirt.libvirtError as exc:
            if exc.get_error_code() == libvirt.VIR_ERR_NO_DOMAIN:
                return None
            raise

    @staticmethod
    def _metadata(dom: libvirt.virDomain) -> DomainMetadata | None:
        import libvirt

        from gpuaas_agent.host.vm.domain_xml import read_metadata  # the XML model: only where a domain exists

        try:
            return read_metadata(dom.metadata(libvirt.VIR_DOMAIN_METADATA_ELEMENT, METADATA_NS))
        except libvirt.libvirtError as exc:
            if exc.get_error_code() == libvirt.VIR_ERR_NO_DOMAIN_METADATA:
                return None
            raise

    @classmethod
    def _info(cls, dom: libvirt.virDomain) -> DomainInfo:
        state, _reason = dom.state()
        return DomainInfo(
            name=dom.name(),
            uuid=dom.UUIDString(),
            state=_state_of(state),
            persistent=bool(dom.isPersistent()),
            metadata=cls._metadata(dom),
        )

    @classmethod
    def _owned(cls, conn: libvirt.virConnect, name: str, action: str) -> libvirt.virDomain:
        """The domain ``name`` if it exists and is ours; this agent never acts on a domain it did not define."""
        dom = cls._lookup(conn, name)
        if dom is None:
            raise DomainNotFoundError(f"no domain {name}", evidence={"name": name, "action": action})
        if cls._metadata(dom) is None:
            raise DomainRefused(
                f"domain {name} carries no gpuaas agent metadata; refusing to {action} it",
                code="not_agent_domain",
                evidence={"name": name, "uuid": dom.UUIDString(), "action": action},
            )
        return dom

    async def lookup(self, name: str | None = None, *, uuid: str | None = None) -> DomainInfo | None:
        """One domain by name or UUID (exactly one of them), or None when libvirt has no such domain."""
        if (name is None) == (uuid is None):
            raise ValueError("give exactly one of name and uuid")

        def op(conn: libvirt.virConnect) -> DomainInfo | None:
            import libvirt

            try:
                dom = conn.lookupByName(name) if name is not None else conn.lookupByUUIDString(uuid)
            except libvirt.libvirtError as exc:
                if exc.get_error_code() == libvirt.VIR_ERR_NO_DOMAIN:
                    return None
                raise
            return self._info(dom)

        return await self._call("lookup", op)

    async def state(self, name: str) -> DomainState:
        def op(conn: libvirt.virConnect) -> DomainState:
            dom = self._lookup(conn, name)
            if dom is None:
                raise DomainNotFoundError(f"no domain {name}", evidence={"name": name})
            return _state_of(dom.state()[0])

        return await self._call("state", op)

    async def list_agent_domains(self) -> list[DomainInfo]:
        """Every domain (running or not) carrying our metadata, sorted by name; others are ignored.

        Before this object's first connection, a ``virsh -r`` child is asked first: libvirt holding no domain at
        all is the answer without the binding (an idle host's timer reconcile). Any domain, or a virsh that cannot
        answer, and the list is read in-process (which then stays the way)."""
        if not self.opened and await self._holds_no_domain():
            return []

        def op(conn: libvirt.virConnect) -> list[DomainInfo]:
            import libvirt

            found = []
            for dom in conn.listAllDomains(0):
                try:
                    info = self._info(dom)
                except libvirt.libvirtError as exc:
                    if exc.get_error_code() == libvirt.VIR_ERR_NO_DOMAIN:
                        continue  # undefined between the listing and the read
                    raise
                if info.metadata is not None:
                    found.append(info)
            return sorted(found, key=lambda i: i.name)

        return await self._call("list_agent_domains", op)

    async def _holds_no_domain(self) -> bool:
        """True only when virsh says libvirt at ``uri`` holds no domain; a virsh past the call deadline is libvirt's
        timeout, as an in-process call's would be."""
        try:
            names = await domain_names(self.uri, timeout=self.call_timeout_s)
        except HostError as exc:
            if exc.code != "command_timeout":
                raise
            log_event(log, "libvirt_call_timeout", logging.ERROR, uri=self.uri, op="list_agent_domains",
                      timeout_s=self.call_timeout_s, via="virsh")
            raise LibvirtError(f"libvirt list_agent_domains did not answer within {self.call_timeout_s} s",
                               code="libvirt_timeout", evidence={"uri": self.uri, "op": "list_agent_domains",
                                                                 "timeout_s": self.call_timeout_s, "via": "virsh"},
                               ) from None
        return names == []

    async def all_domain_stats(self) -> list[tuple[str, dict[str, Any]]]:
        """libvirt's bulk stats of every domain, ``(name, record)``, in one call (``virConnectGetAllDomainStats``):
        slice telemetry's one read per interval, whatever the number of slices. A group the driver does not
        keep is left out of the records (no ENFORCE flag), not an error."""

        def op(conn: libvirt.virConnect) -> list[tuple[str, dict[str, Any]]]:
            return [(dom.name(), dict(record)) for dom, record in conn.getAllDomainStats(_codes().stats_groups, 0)]

        return await self._call("all_domain_stats", op)

    async def devices(self, name: str) -> DomainDevices:
        """What an agent domain will use when it starts, read from its persistent XML (the next boot's config)."""

        def op(conn: libvirt.virConnect) -> DomainDevices:
            import libvirt

            dom = self._owned(conn, name, "read the devices of")
            return parse_domain_devices(name, dom.XMLDesc(libvirt.VIR_DOMAIN_XML_INACTIVE))

        return await self._call("devices", op)

    async def defined_domain_disks(self, *, exclude_allocation: str | None = None,
                                   exclude_slot: int | None = None) -> list[str]:
        """Block-device sources of every *defined* domain, running or shut off (docs/safety.md §1).

        A shut-off domain still owns its disk: start it again and it writes there,
        so its disk must not be cloned or wiped for another slot. Only the
        domain whose metadata names exactly ``exclude_allocation`` *and*
        ``exclude_slot`` (the slot's own) is left out; a domain without our
        metadata, or of the same allocation on another slot, counts.
        """

        def slots_own(dom: libvirt.virDomain) -> bool:
            meta = self._metadata(dom)
            return (meta is not None and exclude_allocation is not None
                    and (meta.allocation_id, meta.slot_index) == (exclude_allocation, exclude_slot))

        def op(conn: libvirt.virConnect) -> list[str]:
            return sorted({disk for devices in _defined_devices(conn, skip=slots_own) for disk in devices.block_disks})

        return await self._call("defined_domain_disks", op)

    async def defined_domain_hostdevs(self) -> list[str]:
        """PCI addresses every *defined* domain (running or shut off, ours or not) names as a hostdev.

        A GPU handover refuses to reset any of them: a running guest would lose its
        device mid-use, a shut-off one would get it back on its next start.
        """

        def op(conn: libvirt.virConnect) -> list[str]:
            return sorted({address for devices in _defined_devices(conn) for address in devices.hostdevs})

        return await self._call("defined_domain_hostdevs", op)

    # -- define / start -----------------------------------------------------------

    async def define(self, spec: DomainSpec) -> DefineOutcome:
        """Define the slot's domain; the same owner's existing domain is returned, another owner's refused."""
        from gpuaas_agent.host.vm.domain_xml import build_domain_xml  # the XML model: a define's, not an idle host's

        xml = build_domain_xml(spec)  # pure, raises DomainSpecError before libvirt is touched
        wanted = spec.metadata()
        name = spec.domain_name

        def conflict(dom: libvirt.virDomain, existing: DomainMetadata | None) -> DomainRefused:
            return DomainRefused(
                f"domain {name} exists with other metadata; it is not overwritten",
                code="domain_name_conflict",
                evidence={
                    "name": name,
                    "uuid": dom.UUIDString(),
                    "existing_metadata": None if existing is None else existing.model_dump(),
                    "wanted_metadata": wanted.model_dump(),
                },
            )

        def op(conn: libvirt.virConnect) -> DefineOutcome:
            import libvirt

            dom = self._lookup(conn, name)
            if dom is not None:
                existing = self._metadata(dom)
                if existing is None or not existing.same_owner(wanted):
                    raise conflict(dom, existing)
                return DefineOutcome(domain=self._info(dom), action="existing")
            try:
                # VALIDATE: libvirt checks the XML against its RNG schema (the one virt-xml-validate uses).
                dom = conn.defineXMLFlags(xml, libvirt.VIR_DOMAIN_DEFINE_VALIDATE)
            except libvirt.libvirtError as exc:
                if self._is_loss(exc):
                    raise
                raced = self._lookup(conn, name)  # defined by someone else between lookup and define?
                if raced is not None:
                    existing = self._metadata(raced)
                    if existing is None or not existing.same_owner(wanted):
                        raise conflict(raced, existing) from None
                    return DefineOutcome(domain=self._info(raced), action="existing")
                raise _wrap(exc, f"defining {name} failed", name=name) from None
            return DefineOutcome(domain=self._info(dom), action="created")

        outcome = await self._call("define", op)
        log_event(log, "domain_defined", name=name, action=outcome.action, uuid=outcome.domain.uuid,
                  allocation_id=spec.allocation_id, slot_index=spec.slot_index, task_id=spec.task_id)
        return outcome

    async def start(self, name: str, *, preconditions: VmStartEvidence) -> DomainInfo:
        """Start an agent domain whose start guard passed; a running domain is returned as it is."""
        if preconditions.domain_name != name:
            raise DomainRefused(
                f"start evidence is for {preconditions.domain_name}, not {name}",
                code="start_evidence_mismatch",
                evidence={"name": name, "evidence_for": preconditions.domain_name},
            )

        def op(conn: libvirt.virConnect) -> DomainInfo:
            import libvirt

            dom = self._owned(conn, name, "start")
            if not dom.isActive():
                try:
                    dom.create()
                except libvirt.libvirtError as exc:
                    if self._is_loss(exc):
                        raise
                    if not dom.isActive():  # active: started concurrently, which is what was asked
                        raise _wrap(exc, f"starting {name} failed", name=name) from None
            return self._info(dom)

        info = await self._call("start", op)
        log_event(log, "domain_started", name=name, uuid=info.uuid, state=info.state.value)
        return info

    # -- stop ---------------------------------------------------------------------

    async def wait_for_shutoff(self, name: str, deadline_s: float, *, poll_s: float = 0.25) -> bool:
        """Poll until the domain is shut off or ``deadline_s`` passes; True when it is off."""
        loop = asyncio.get_running_loop()
        end = loop.time() + deadline_s
        while True:
            if await self.state(name) == DomainState.shutoff:
                return True
            remaining = end - loop.time()
            if remaining <= 0:
                return False
            await asyncio.sleep(min(poll_s, remaining))

    async def shutdown(self, name: str, *, deadline_s: float, poll_s: float = 0.25) -> ShutdownOutcome:
        """ACPI power button, wait up to ``deadline_s``, then ``destroy``. ``deadline_s=0``: destroy at once."""
        loop = asyncio.get_running_loop()
        started = loop.time()

        def request(conn: libvirt.virConnect) -> tuple[bool, str | None]:
            import libvirt

            dom = self._owned(conn, name, "shut down")
            if not dom.isActive():
                return True, None
            if deadline_s <= 0:
                return False, "deadline 0: no graceful request, destroyed at once"
            note = None
            try:
                dom.shutdownFlags(libvirt.VIR_DOMAIN_SHUTDOWN_ACPI_POWER_BTN)
            except libvirt.libvirtError as exc:
                if exc.get_error_code() not in _codes().flag_rejected:
                    if self._is_loss(exc):
                        raise
                    if dom.isActive():
                        raise _wrap(exc, f"asking {name} to shut down failed", name=name) from None
                    return True, None  # went off by itself meanwhile
                note = f"driver rejected VIR_DOMAIN_SHUTDOWN_ACPI_POWER_BTN ({exc}); used plain shutdown()"
                log_event(log, "libvirt_shutdown_flag_unsupported", logging.WARNING, name=name, uri=self.uri,
                          error=str(exc))
                dom.shutdown()
            return False, note

        already_off, note = await self._call("shutdown", request)
        if already_off:
            return ShutdownOutcome(name=name, graceful=True, destroyed=False, already_off=True, waited_s=0.0)
        if deadline_s > 0 and await self.wait_for_shutoff(name, deadline_s - (loop.time() - started), poll_s=poll_s):
            waited = round(loop.time() - started, 3)
            log_event(log, "domain_shutdown", name=name, graceful=True, waited_s=waited)
            return ShutdownOutcome(name=name, graceful=True, destroyed=False, already_off=False, waited_s=waited,
                                   note=note)
        destroyed = await self._destroy(name)
        waited = round(loop.time() - started, 3)
        log_event(log, "domain_shutdown", logging.WARNING, name=name, graceful=False, destroyed=destroyed,
                  waited_s=waited, deadline_s=deadline_s)
        return ShutdownOutcome(name=name, graceful=not destroyed, destroyed=destroyed, already_off=False,
                               waited_s=waited, note=note)

    async def _destroy(self, name: str) -> bool:
        def op(conn: libvirt.virConnect) -> bool:
            import libvirt

            dom = self._owned(conn, name, "destroy")
            if not dom.isActive():
                return False
            try:
                dom.destroy()
            except libvirt.libvirtError as exc:
                if self._is_loss(exc):
                    raise
                if dom.isActive():
                    raise _wrap(exc, f"destroying {name} failed", name=name) from None
                return False  # went off by itself meanwhile
            return True

        return await self._call("destroy", op)

    async def destroy(self, name: str) -> DomainInfo:
        """Hard stop (the guest gets no say); a domain already off is returned as it is."""
        await self._destroy(name)
        info = await self.lookup(name)
        if info is None:
            raise DomainNotFoundError(f"no domain {name}", evidence={"name": name})
        return info

    async def reset(self, name: str) -> ResetOutcome:
        """Hard reset of a running agent domain (``virDomainReset``); it stays running. A shut-off one is refused."""

        def op(conn: libvirt.virConnect) -> ResetOutcome:
            import libvirt

            dom = self._owned(conn, name, "reset")
            if not dom.isActive():
                raise DomainRefused(
                    f"domain {name} is not running; a reset needs a running domain (start it instead)",
                    code="domain_not_running",
                    evidence={"name": name, "uuid": dom.UUIDString(), "state": _state_of(dom.state()[0]).value},
                )
            try:
                dom.reset(0)
            except libvirt.libvirtError as exc:
                if self._is_loss(exc):
                    raise
                raise _wrap(exc, f"resetting {name} failed", name=name) from None
            return ResetOutcome(name=name, state=_state_of(dom.state()[0]))

        outcome = await self._call("reset", op)
        log_event(log, "domain_reset", name=name, state=outcome.state.value)
        return outcome

    # -- undefine -----------------------------------------------------------------

    async def undefine(self, name: str) -> UndefineOutcome:
        """Remove a shut-off agent domain and its NVRAM; an absent domain is reported, not an error."""

        def op(conn: libvirt.virConnect) -> UndefineOutcome:
            import libvirt

            if self._lookup(conn, name) is None:
                return UndefineOutcome(name=name, undefined=False, nvram_removed=False, attempts=[],
                                       note="domain was already absent")
            dom = self._owned(conn, name, "undefine")
            if dom.isActive():
                raise DomainRefused(
                    f"domain {name} is running; stop it before undefining",
                    code="domain_running",
                    evidence={"name": name, "uuid": dom.UUIDString(), "state": _state_of(dom.state()[0]).value},
                )
            attempts: list[str] = []
            note = None
            nvram_removed = False
            for attempt in range(2):  # seed 004: the release path retries when the first undefine fails
                try:
                    dom.undefineFlags(libvirt.VIR_DOMAIN_UNDEFINE_NVRAM)
                    attempts.append("undefine_nvram:ok")
                    nvram_removed = True
                    break
                except libvirt.libvirtError as exc:
                    if self._is_loss(exc):
                        raise
                    attempts.append(f"undefine_nvram:error:{exc.get_error_code()}")
                    if exc.get_error_code() in _codes().flag_rejected:
                        note = f"driver rejected VIR_DOMAIN_UNDEFINE_NVRAM ({exc}); used plain undefine()"
                        log_event(log, "libvirt_undefine_nvram_unsupported", logging.WARNING, name=name,
                                  uri=self.uri, error=str(exc))
                        try:
                            dom.undefine()
                        except libvirt.libvirtError as plain:
                            if self._is_loss(plain):
                                raise
                            attempts.append(f"undefine:error:{plain.get_error_code()}")
                            raise _wrap(plain, f"undefining {name} failed", name=name, attempts=attempts) from None
                        attempts.append("undefine:ok")
                        break
                    if self._lookup(conn, name) is None:
                        break  # gone despite the error (another actor, or libvirt finished it)
                    if attempt == 1:
                        raise _wrap(exc, f"undefining {name} failed", name=name, attempts=attempts) from None
            if self._lookup(conn, name) is not None:
                raise LibvirtError(
                    f"domain {name} is still defined after undefine",
                    code="undefine_left_domain",
                    evidence={"name": name, "attempts": attempts},
                )
            return UndefineOutcome(name=name, undefined=True, nvram_removed=nvram_removed, attempts=attempts,
                                   note=note)

        outcome = await self._call("undefine", op)
        log_event(log, "domain_undefined", name=name, undefined=outcome.undefined,
                  nvram_removed=outcome.nvram_removed, attempts=outcome.attempts, note=outcome.note)
        return outcome


def _defined_devices(conn: libvirt.virConnect, *,
                     skip: Callable[[libvirt.virDomain], bool] | None = None) -> Iterator[DomainDevices]:
    """The devices of every *defined* domain (its inactive XML), but those ``skip`` says to leave out; a domain
    undefined between the listing and the read is passed over (libvirt's ``VIR_ERR_NO_DOMAIN``)."""
    import libvirt

    for dom in conn.listAllDomains(0):
        try:
            if skip is not None and skip(dom):
                continue
            xml = dom.XMLDesc(libvirt.VIR_DOMAIN_XML_INACTIVE)
        except libvirt.libvirtError as exc:
            if exc.get_error_code() == libvirt.VIR_ERR_NO_DOMAIN:
                continue  # undefined between the listing and the read
            raise
        yield parse_domain_devices(dom.name(), xml)


def parse_domain_devices(name: str, xml: str) -> DomainDevices:
    """The devices a domain XML names: block disks, PCI hostdevs, interfaces, the numatune node (pure).

    Read through the same element classes ``domain_xml`` writes with (``domain_config.py``).
    """
    from gpuaas_agent.host.vm.domain_config import Domain

    return domain_devices(name, Domain.parse_str(xml))


def domain_devices(name: str, domain: Domain) -> DomainDevices:
    """What a parsed domain will use: its block disks, PCI hostdevs, interfaces and numatune nodeset."""
    from gpuaas_agent.host.vm.domain_config import Disk, Hostdev, Interface
    disks = [d.source.dev for d in domain.device_list(Disk)
             if d.type_ == "block" and d.source is not None and d.source.dev]
    hostdevs = [a for a in (h.host_address() for h in domain.device_list(Hostdev) if h.type_ == "pci")
                if a is not None]
    interfaces = [DomainInterface(mac=(iface.mac.address or "") if iface.mac is not None else "",
                                  bridge=iface.source.bridge if iface.source is not None else None,
                                  target_dev=iface.target.dev if iface.target is not None else None)
                  for iface in domain.device_list(Interface)]
    memory = None if domain.numatune is None else domain.numatune.memory
    nodeset = None if memory is None or memory.nodeset is None else memory.nodeset.text
    return DomainDevices(name=name, domain_type=domain.type_ or "", block_disks=disks, hostdevs=hostdevs,
                         interfaces=interfaces, numa_nodeset=nodeset)
