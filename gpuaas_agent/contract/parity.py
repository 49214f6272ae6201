"""Slice-host parity checks (seed 004, "Automated Parity Check") and the network evidence they read.

One machine-readable line per target condition, exactly the seed's shape::

    GPUAAS_SLICE_PARITY status=PASS check=node_agent detail=active/running
    GPUAAS_SLICE_PARITY status=FAIL check=ipoib_netplan detail=command\\ exited\\ with\\ 1 remediation=render\\ ...

Every check of the agent's own also ends with ``evidence=<escaped>``: what was
read to reach the verdict (paths, pids, values), so a line can be judged
without re-running the check. A line built without evidence (the seed's own
examples) keeps the seed's exact shape.

Values are escaped the way bash ``printf %q`` escapes a plain word (a
backslash before every character a shell would split or expand on), so a
parser splits on unescaped spaces and drops one backslash per escape. A final
``GPUAAS_SLICE_PARITY_SUMMARY ... failures=N`` line closes the report.

Only a *hard* check may FAIL; anything the agent could not prove is a WARN,
never a PASS (docs/safety.md §7).
"""

from __future__ import annotations

import re
from typing import Any, Literal

from pydantic import Field, model_validator

from gpuaas_agent.contract.base import SCHEMA_VERSION, WireEnum, WireModel
from gpuaas_agent.contract.topology import Finding

LINE_PREFIX = "GPUAAS_SLICE_PARITY"
SUMMARY_PREFIX = "GPUAAS_SLICE_PARITY_SUMMARY"

# Characters printf %q leaves alone in a plain word; every other one gets a backslash.
_SAFE = re.compile(r"[A-Za-z0-9_./:,=@%+^-]")
_CONTROL = re.compile(r"[\x00-\x1f\x7f]+")
CHECK_NAME = r"^[a-z][a-z0-9_]*$"


def escape(value: str) -> str:
    """One shell word: ``command exited with 1`` -> ``command\\ exited\\ with\\ 1``.

    Control characters (newlines from a command's stderr) become one space
    first: a parity line is one line. The empty string is ``''`` as in bash.
    """
    value = _CONTROL.sub(" ", value)
    if not value:
        return "''"
    return "".join(c if _SAFE.fullmatch(c) else "\\" + c for c in value)


def unescape(word: str) -> str:
    """Inverse of :func:`escape` for one word (``''`` is the empty string)."""
    if word == "''":
        return ""
    return re.sub(r"\\(.)", r"\1", word)


def split_words(line: str) -> list[str]:
    """Split a parity line on spaces that are not escaped."""
    return re.findall(r"(?:\\.|[^ \\])+", line)


def parse_line(line: str) -> dict[str, str]:
    """``GPUAAS_SLICE_PARITY k=v ...`` -> {k: unescaped v}; for consumers and tests."""
    words = split_words(line)
    if not words or words[0] not in (LINE_PREFIX, SUMMARY_PREFIX):
        raise ValueError(f"not a parity line: {line[:80]!r}")
    out = {"_prefix": words[0]}
    for word in words[1:]:
        key, sep, value = word.partition("=")
        if not sep:
            raise ValueError(f"word without '=' in parity line: {word!r}")
        out[key] = unescape(value)
    return out


class ParityStatus(WireEnum):
    PASS = "PASS"
    WARN = "WARN"
    FAIL = "FAIL"


class ParityCheck(WireModel):
    """One target condition: what was seen (``detail``) and, when not PASS, what to do about it."""

    status: ParityStatus
    check: str = Field(pattern=CHECK_NAME)
    detail: str
    remediation: str | None = None
    hard: bool = Field(description="a hard check FAILs; a soft one is at most WARN")
    evidence: str | None = Field(default=None, description="what was read to reach the verdict (paths, pids, values)")

    @model_validator(mode="after")
    def _soft_checks_never_fail(self) -> ParityCheck:
        if self.status is ParityStatus.FAIL and not self.hard:
            raise ValueError(f"check {self.check} is not hard and cannot FAIL (report WARN)")
        return self

    def as_line(self) -> str:
        line = f"{LINE_PREFIX} status={self.status.value} check={self.check} detail={escape(self.detail)}"
        if self.remediation:
            line += f" remediation={escape(self.remediation)}"
        if self.evidence:
            line += f" evidence={escape(self.evidence)}"
        return line


class ParityReport(WireModel):
    """Every check of one run, in a stable order, with the summary counts and the printed lines.

    Build it with :meth:`from_checks`; the counts, status and lines are
    checked against ``checks`` so a stored report cannot disagree with itself.
    """

    schema_version: str = SCHEMA_VERSION
    mode: Literal["private-nat"] = "private-nat"
    source: Literal["live", "fixture"]
    root: str
    netns: str | None = None
    status: ParityStatus = Field(description="FAIL when a hard check failed, WARN when any warned, else PASS")
    passed: int = Field(ge=0)
    warnings: int = Field(ge=0)
    failures: int = Field(ge=0, description="hard checks that FAILed; non-zero exit code when > 0")
    checks: list[ParityCheck]
    lines: list[str] = Field(description="the GPUAAS_SLICE_PARITY lines, summary last")

    @classmethod
    def from_checks(cls, checks: list[ParityCheck], **fields: Any) -> ParityReport:
        counts = _counts(checks)
        return cls(checks=checks, **counts, lines=_lines(checks, counts), **fields)

    @model_validator(mode="after")
    def _consistent(self) -> ParityReport:
        counts = _counts(self.checks)
        if {k: getattr(self, k) for k in counts} != counts or self.lines != _lines(self.checks, counts):
            raise ValueError("status, counts or lines do not match the checks")
        return self

    def summary_line(self) -> str:
        return self.lines[-1]


def _counts(checks: list[ParityCheck]) -> dict[str, Any]:
    n = {s: sum(c.status is s for c in checks) for s in ParityStatus}
    status = ParityStatus.FAIL if n[ParityStatus.FAIL] else ParityStatus.WARN if n[ParityStatus.WARN] else ParityStatus.PASS
    return {"status": status, "passed": n[ParityStatus.PASS], "warnings": n[ParityStatus.WARN],
            "failures": n[ParityStatus.FAIL]}


def _lines(checks: list[ParityCheck], counts: dict[str, Any]) -> list[str]:
    summary = (f"{SUMMARY_PREFIX} status={counts['status'].value} checks={len(checks)} passed={counts['passed']} "
               f"warnings={counts['warnings']} failures={counts['failures']}")
    return [c.as_line() for c in checks] + [summary]


# -- slice network evidence ---------------------------------------------------------------


class NetAddress(WireModel):
    ifname: str
    family: Literal["inet", "inet6"]
    cidr: str = Field(description="address/prefix as ip shows it: 10.100.0.1/24")


class NetRoute(WireModel):
    """An IPv4 route of the main table: ``dst`` is ``default`` or a CIDR."""

    dst: str
    dev: str | None = None
    gateway: str | None = None


class NatEvidence(WireModel):
    """Whether ``POSTROUTING -s SUBNET -j MASQUERADE`` is in force; ``None``: could not tell."""

    present: bool | None
    method: str = Field(description="iptables -C | iptables-save | nft | none")
    rule: str
    detail: str


class SliceNetworkEvidence(WireModel):
    """What the host's slice network looks like now (seed 004: topology reports ``slice_network``)."""

    schema_version: str = SCHEMA_VERSION
    source: Literal["live", "fixture"]
    netns: str | None = None
    mode: Literal["private-nat"] = "private-nat"
    subnet: str
    gateway: str = Field(description="address the bridge must own, with prefix: 10.100.0.1/24")
    ovs_bridge: str
    links: list[str] = Field(default_factory=list, description="interface names; None read -> empty + unreadable")
    addresses: list[NetAddress] = Field(default_factory=list)
    routes: list[NetRoute] = Field(default_factory=list)
    ip_forward: bool | None = None
    nat: NatEvidence
    dnsmasq_files: list[str] = Field(default_factory=list)
    dnsmasq_subnet_files: list[str] = Field(default_factory=list, description="files with a dhcp-range in the subnet")
    ipoib_netplan: str | None = None
    unreadable: list[Finding] = Field(default_factory=list, description="evidence that could not be read, and why")
    blockers: list[Finding] = Field(default_factory=list)
    warnings: list[Finding] = Field(default_factory=list)

    def addresses_of(self, ifname: str, family: str = "inet") -> list[str]:
        return [a.cidr for a in self.addresses if a.ifname == ifname and a.family == family]


# -- dnsmasq: which running process reads the agent's reservations ---------------------------


class DnsmasqProcess(WireModel):
    """One running dnsmasq: its argv and every file or directory it was told to read hosts from."""

    pid: int
    argv: list[str]
    conf_files: list[str] = Field(default_factory=list, description="config files it loads, in load order")
    hosts_files: list[str] = Field(default_factory=list, description="dhcp-hostsfile values (file or directory)")
    hosts_dirs: list[str] = Field(default_factory=list, description="dhcp-hostsdir values")
    sources: dict[str, str] = Field(default_factory=dict, description="each hosts path -> where it was named")
    unreadable: list[Finding] = Field(default_factory=list)


class DnsmasqEvidence(WireModel):
    """Whether a running dnsmasq reads the hosts file the agent writes reservations to.

    ``process_table``: False when the root holds no process table at all (a
    recording): nothing about a running dnsmasq is provable there.
    """

    source: Literal["live", "fixture"]
    hosts_file: str
    pid_file: str | None = None
    pid_file_pid: int | None = Field(default=None, description="the pid the pid file names (the one reload signals)")
    process_table: bool
    processes: list[DnsmasqProcess] = Field(default_factory=list)
    readers: list[int] = Field(default_factory=list, description="pids of the dnsmasq processes that read hosts_file")
    via: str | None = Field(default=None, description="how the first reader reads it: option=value (where)")
    # A recording has no processes, but it has the config: what a dnsmasq started from it by the distribution's
    # service would read (discovery/netevidence.py RECORDED_DNSMASQ_ARGV), so parity can say which file that is.
    recorded_config: DnsmasqProcess | None = Field(
        default=None, description="without a process table: what the recorded config makes dnsmasq read")
    recorded_via: str | None = Field(default=None, description="how the recorded config reads hosts_file, if it does")
    commented: list[str] = Field(default_factory=list,
                                 description="commented-out dhcp-hostsfile/dhcp-hostsdir lines: path:line: text")

    @property
    def running(self) -> bool:
        return bool(self.processes)
