"""Who this host is: machine-id, hostname and DMI, the seed of deterministic slot suggestions."""

from __future__ import annotations

from gpuaas_agent.contract.topology import HostIdentity
from gpuaas_agent.discovery.sysread import SysReader

DMI = "/sys/class/dmi/id"


def read_identity(reader: SysReader) -> HostIdentity:
    machine_id = reader.attr("/etc/machine-id")
    hostname = reader.attr("/etc/hostname") or reader.attr("/proc/sys/kernel/hostname")
    product_uuid = reader.attr(f"{DMI}/product_uuid")
    fields = dict(
        hostname=hostname or None,
        machine_id=machine_id or None,
        dmi_product_uuid=product_uuid or None,
        dmi_serial=reader.attr(f"{DMI}/product_serial") or None,
        dmi_vendor=reader.attr(f"{DMI}/sys_vendor") or None,
        dmi_product=reader.attr(f"{DMI}/product_name") or None,
    )
    source = next((k for k in ("machine_id", "dmi_product_uuid", "hostname") if fields[k]), "none")
    if source == "none":
        reader.findings.warn(
            "host_identity_missing",
            "no machine-id, DMI product_uuid or hostname: MAC suggestions are not host-unique",
            "/etc/machine-id",
        )
    return HostIdentity(**fields, identity_source=source)


def identity_key(identity: HostIdentity) -> str:
    """The string MAC suggestions are derived from (stable across reboots and renames)."""
    if identity.identity_source == "none":
        return "unidentified-host"
    return str(getattr(identity, identity.identity_source))
