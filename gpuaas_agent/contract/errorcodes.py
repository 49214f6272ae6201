"""Every error code the agent can emit, with its meaning: the one home of the wire's codes.

An operator running hundreds of hosts acts on ``code`` (errors.AgentError, findings,
task results); this enum says, per code, what happened and what to do. The values
are the snake_case strings already on the wire and never change: a code that moves
breaks every dashboard and runbook keyed on it. Call sites may keep string literals
(equal to a member's value) or use the member (a StrEnum compares equal to its value).

``docs/error-codes.md`` is generated from this module:

    python -m gpuaas_agent.contract.errorcodes            # (re)write docs/error-codes.md
    python -m gpuaas_agent.contract.errorcodes --check    # exit 1 when the doc is stale
    python -m gpuaas_agent.contract.errorcodes --missing  # enum lines for codes the package emits but lacks

A test scans the package's source (contract/codescan.py) and fails on a code that is
not a member here (or an f-string template not in TEMPLATES), and on a member nothing emits unless it is marked CONTROL_PLANE
(relayed from the control plane, never raised by agent code).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from gpuaas_agent.compat import Self, StrEnum
from gpuaas_agent.contract.codescan import PACKAGE_ROOT, TEMPLATE_HOLE, scan

CONTROL_PLANE = True  # marks a member only the control plane emits (the agent relays it)

ROOT = Path(__file__).resolve().parent.parent.parent
DOC = ROOT / "docs" / "error-codes.md"

ROOMS: dict[str, str] = {
    "base": "Error hierarchy defaults (errors.py): the code a refusal carries when its raiser names none",
    "contract": "Wire contract: tasks, payloads, profiles, domain specs",
    "config": "Command line, configuration and exit classes",
    "control": "Control plane: NATS, enrollment, task worker",
    "control_plane": "Relayed from the control plane (never raised by agent code; sent in an enrollment reply)",
    "state": "State store (SQLite) and leases",
    "discovery": "Discovery findings (blockers and warnings in the host report)",
    "guards": "Safety guards (each refusal changed nothing)",
    "host_ovs": "Host: Open vSwitch (host/network/ovs.py, host/network/portflows.py, host/network/nftguard.py)",
    "host_net": "Host: network baseline (prepare-host)",
    "host_dnsmasq": "Host: dnsmasq reservations",
    "host_libvirt": "Host: libvirt domains, XML, readiness",
    "host_images": "Host: image cache and disk clone",
    "host_vfio": "Host: VFIO binding and uevents",
    "host_wipe": "Host: disk wipe",
    "host_gpu": "Host: GPU handover between tenants (guards/gpureset.py, host/devices/gpuhandover.py)",
    "host_fabric_vf": "Host: the slots' fabric VFs on their PFs: attachment applied, read back, parked (host/network/fabricvf.py, tasks/fabricvf.py, docs/fabric.md)",
    "host_fabric": "Host: NVIDIA Fabric Manager partitions of NVSwitch hosts (host/devices/fabricmanager.py, tasks/fabric_partitions.py)",
    "tasks": "Tasks: plan, admission, provision, release, power",
    "deploy": "Deploy: prepare-host and the terminal relay key",
    "fixtures": "Fixtures: recorder and archives",
    "operator": "Operator: status and health",
    "terminal": "Terminal relay: slice.terminal_* sessions into a slice (SSH PTY relayed over NATS)",
    "fleet": "Fleet operations: maintenance and drain, quarantined components (docs/maintenance.md)",
    "unsorted": "Not yet sorted into a room (pasted from --missing; move it)",
}


# Codes built as f-strings (codescan reports "nvme_{}"): the template -> every code it can produce.
# "nvme_{}" prefixes a disk's ineligibility reason (discovery/nvme.py ineligible_reasons) in a slot blocker.
NVME_REASONS = ("os_disk", "no_stable_by_id", "mounted", "mounted_child", "holders", "swap", "not_raw",
                "read_only", "empty", "not_local_pcie")
TEMPLATES: dict[str, tuple[str, ...]] = {
    "nvme_{}": tuple(f"nvme_{reason}" for reason in NVME_REASONS),
    "{}_remote_numa": ("nvme_remote_numa", "fabric_remote_numa"),
}

class ErrorCode(StrEnum):
    """A stable error code; ``.room`` groups it, ``.meaning`` says what happened and what to do."""

    room: str
    meaning: str
    control_plane: bool

    def __new__(cls, value: str, room: str, meaning: str, control_plane: bool = False) -> Self:
        member = str.__new__(cls, value)
        member._value_ = value
        member.room = room
        member.meaning = meaning
        member.control_plane = control_plane
        return member

    # --- Error hierarchy defaults (errors.py): the code a refusal carries when its raiser names none
    AGENT_ERROR = "agent_error", "base", "An agent error with no more specific code; read message and evidence, then file a bug so it gets a code."
    HOST_ROOT_ERROR = "host_root_error", "base", "The host root given to the agent cannot be used; check the --root path and its permissions."
    CONTRACT_ERROR = "contract_error", "base", "Input from the wire or disk does not match the contract; fix the sender (evidence names the field)."
    FIXTURE_ERROR = "fixture_error", "base", "Recording or unpacking a fixture failed; read the evidence, fix the source or output path."
    HOST_ERROR = "host_error", "base", "A host command or file operation failed; evidence names the command and its stderr."
    GUARD_REFUSED = "guard_refused", "base", "A safety guard refused an action and nothing changed; read the evidence for the guard's reason."

    # --- Wire contract: tasks, payloads, profiles, domain specs
    INVALID_MESSAGE = "invalid_message", "contract", "A message is not a valid envelope of the contract; fix the sender, the message was not acted on."
    INVALID_PAYLOAD = "invalid_payload", "contract", "A task payload does not match its type's model; fix the control plane's payload (evidence names the field)."
    UNSUPPORTED_TASK = "unsupported_task", "contract", "A task type this agent does not know; upgrade the agent or stop sending that type."
    UNKNOWN_PROFILE = "unknown_profile", "contract", "The named runtime profile does not exist; use one of the profiles listed in the evidence."
    INVALID_DOMAIN_SPEC = "invalid_domain_spec", "contract", "A domain spec violates the contract (names, sizes, devices); fix the planner that produced it."
    INVALID_DIGEST = "invalid_digest", "contract", "An image digest is not 64 hex digits of SHA-256; fix the task's image digest."
    USERDATA_CONFIG_INVALID = "userdata_config_invalid", "contract", "The user-data configuration is invalid; fix the config named in the evidence."
    USERDATA_INPUTS_INVALID = "userdata_inputs_invalid", "contract", "The user-data inputs file is not valid JSON or does not match its model; fix the file."
    USERDATA_INPUTS_UNREADABLE = "userdata_inputs_unreadable", "contract", "The user-data inputs file cannot be read; check the path and permissions."

    # --- Command line, configuration and exit classes
    CONFIG_INVALID = "config_invalid", "config", "The agent configuration does not validate; fix the field named in the evidence."
    CONFIG_UNREADABLE = "config_unreadable", "config", "The agent configuration file cannot be read; check the path and permissions."
    ROOT_MISSING = "root_missing", "config", "The host root directory does not exist; pass an existing --root."
    OUTPUT_EXISTS = "output_exists", "config", "The output path already exists; choose another path or remove it (nothing is overwritten)."
    USAGE = "usage", "config", "The command line is wrong (exit class 2); run the command with --help."
    OS_ERROR = "os_error", "config", "An operating-system call failed outside any typed path; read the message (errno) and fix the host."
    INTERNAL_ERROR = "internal_error", "config", "An unexpected exception (a bug); run with --debug for the traceback and file it."
    COMMAND_NOT_FOUND = "command_not_found", "config", "A required executable is not installed; install the package named in the evidence."
    COMMAND_TIMEOUT = "command_timeout", "config", "A host command did not finish within its timeout and was killed; check what hangs (evidence has the argv)."

    # --- Control plane: NATS, enrollment, task worker
    NATS_UNREACHABLE = "nats_unreachable", "control", "NATS cannot be reached; check the URL, network and that the server runs."
    NATS_AUTH_REFUSED = "nats_auth_refused", "control", "NATS refused the agent's credentials; re-enroll the host or fix its credentials."
    ENROLL_FAILED = "enroll_failed", "control", "Enrollment failed; read the evidence and retry enrollment."
    ENROLL_REFUSED = "enroll_refused", "control", "The control plane refused enrollment without a specific reason; check the control plane's log."
    ENROLL_UNREACHABLE = "enroll_unreachable", "control", "The enrollment request did not reach the control plane; check the NATS URL and network."
    ENROLL_REPLY_UNSEALED = "enroll_reply_unsealed", "control", "The control plane answered enrollment with the credentials in clear (readable on the inbox); nothing was stored: upgrade it to seal replies and revoke what it sent."
    ENROLL_REPLY_TAMPERED = "enroll_reply_tampered", "control", "The enrollment reply's sealed credentials do not open for this request (another key or request, or altered); nothing was stored, the token was kept: retry, and check who answers enrollment requests."
    ENROLL_REPLY_CARRIES_SECRET = "enroll_reply_carries_secret", "control", "The enrollment reply carries a password instead of a user JWT for the key this node made; nothing was stored, the token was kept: the control plane must sign a JWT for node_public_key (contract v2)."
    ENROLL_REPLY_WRONG_KEY = "enroll_reply_wrong_key", "control", "The enrollment reply's user JWT is for another public key than the one this node sent; nothing was stored, the token was kept: check the control plane's JWT signing."
    ENROLL_REPLY_BAD_JS_PREFIX = "enroll_reply_bad_js_prefix", "control", "The enrollment reply names a JetStream API prefix that is not a plain subject prefix or lies in node, enrollment or inbox subjects; nothing was stored, the token was kept: check the control plane's account layout."
    CREDS_MISSING = "creds_missing", "control", "<state_dir>/nats.creds is missing: it held this node's only key (enrollment.json holds none); restore it from a backup, or move enrollment.json away and enroll with a new token."
    CREDS_RENEW_UNANSWERED = "creds_renew_unanswered", "control", "A rotation's request for a JWT for the new key got no answer; nothing changed, the node keeps its current credentials: check the control plane's renewal service."
    CREDS_RENEW_REFUSED = "creds_renew_refused", "control", "The control plane refused to sign a JWT for the rotation's new key; nothing changed, the node keeps its current credentials."
    ENROLLMENT_RECORD_INVALID = "enrollment_record_invalid", "control", "The stored enrollment record is corrupt or does not match the contract; re-enroll the host."
    INVALID_IDENTITY = "invalid_identity", "control", "Host identity or bootstrap token does not match the contract; fix /etc/machine-id, hostname or token."
    TOKEN_MISSING = "token_missing", "control", "The bootstrap token file is missing or empty; place a token from the control plane."
    TOKEN_UNREADABLE = "token_unreadable", "control", "The bootstrap token file cannot be read; check its path and permissions."
    NOT_ENROLLED = "not_enrolled", "control", "The daemon started on a host that is not enrolled; run enroll first."
    HOST_IDENTITY_MISSING = "host_identity_missing", "control", "/etc/machine-id or the hostname is missing; provision the host identity before enrolling."
    NOT_IMPLEMENTED = "not_implemented", "control", "The agent knows this task type but does not implement it yet; do not send it to this version."
    POISON_TASK = "poison_task", "control", "A task failed to decode or crashed repeatedly and was parked; inspect it, fix the sender."
    TENANT_BUSY = "tenant_busy", "control", "The allocation already has its bound of interactive tasks in flight on this node; the task did not run, send it again later."
    EXPIRED = "expired", "control", "The task's deadline passed before it ran; resend with a later deadline if still wanted."
    INVALID_DEADLINE = "invalid_deadline", "control", "The task's deadline is not a valid timestamp; fix the control plane."
    DEADLINE_EXCEEDED = "deadline_exceeded", "control", "The task ran past its deadline and was cancelled; check what made it slow, then retry."
    WRONG_NODE = "wrong_node", "control", "A task addressed to another node arrived here; fix the control plane's routing."
    WRONG_SUBJECT = "wrong_subject", "control", "A task arrived on a subject that does not match its type; fix the control plane's publisher."
    RESULT_TOO_LARGE = "result_too_large", "control", "A task's result did not fit the NATS server's max_payload: this answer (status failed, evidence names the sizes) replaced it and the task was acked, not redelivered; ask for less, or raise max_payload."
    DISCOVERY_TIMEOUT = "discovery_timeout", "control", "Re-discovery after a hardware event did not finish in time; check sysfs/host load, the next event retries."
    RECONCILE_TIMEOUT = "reconcile_timeout", "control", "Startup reconcile did not finish in time; check libvirt and the state DB, the daemon keeps running."

    CREDS_EXPIRED = "creds_expired", "control", "The NATS .creds JWT has expired; enroll again or have the control plane rotate the credentials."
    CREDS_INSECURE = "creds_insecure", "control", "A credentials/key file is group/world readable or not owned by the agent; chmod 0600 it (nothing was dialled)."
    CREDS_INVALID = "creds_invalid", "control", "The file is not a NATS user .creds (JWT + user seed); reinstall the file the control plane issued."
    CREDS_UNREADABLE = "creds_unreadable", "control", "The credentials or TLS key file cannot be read; check the path in agent.toml and its permissions."
    NATS_TLS_FAILED = "nats_tls_failed", "control", "The TLS handshake with NATS failed (unknown CA, name mismatch, or the server offered no TLS); check nats_tls_ca_file and nats_tls_server_name."
    PLAINTEXT_REFUSED = "plaintext_refused", "control", "A NATS URL without TLS (loopback included); use tls:// with a CA bundle, or set insecure = true in a lab."
    TLS_CONFIG_INVALID = "tls_config_invalid", "control", "The TLS settings cannot be used (a cert without its key, an unreadable or invalid PEM); fix agent.toml's nats_tls_* keys."
    TRANSPORT_REFUSED = "transport_refused", "control", "The NATS transport settings were refused before connecting; the message names the setting."
    RECOVERY_POISON = "recovery_poison", "control", "Recovering an interrupted task crashed the agent repeatedly; the slot is left for reconcile and an operator (see the journal)."

    # --- Relayed from the control plane (never raised by agent code; sent in an enrollment reply)
    TOKEN_INVALID = "token_invalid", "control_plane", "The control plane did not recognise the bootstrap token; issue a new token.", CONTROL_PLANE
    TOKEN_EXPIRED = "token_expired", "control_plane", "The bootstrap token expired; issue a new token.", CONTROL_PLANE
    TOKEN_REUSED = "token_reused", "control_plane", "The bootstrap token was already used; issue a new token (one per host).", CONTROL_PLANE
    HOST_MISMATCH = "host_mismatch", "control_plane", "The token was issued for a different host; issue a token for this host.", CONTROL_PLANE
    NONCE_INVALID = "nonce_invalid", "control_plane", "The enrollment request's server nonce is unknown, spent or expired (a replayed or slow request); enroll again: the agent asks for a fresh nonce.", CONTROL_PLANE

    # --- State store (SQLite) and leases
    STATE_ERROR = "state_error", "state", "The state store refused an operation; read the evidence."
    STATE_UNREADABLE = "state_unreadable", "state", "The state DB cannot be opened or read; check the state dir, disk and permissions."
    STATE_SCHEMA_NEWER = "state_schema_newer", "state", "The state DB was written by a newer agent; upgrade the agent (never downgrade over it)."
    RESULT_CONFLICT = "result_conflict", "state", "A different result was already recorded for this task id; investigate a duplicate task id."
    LEASE_CONFLICT = "lease_conflict", "state", "The slot is leased by another allocation; release that allocation first."
    LEASE_REQUEST_INVALID = "lease_request_invalid", "state", "One lease call covered slots of several allocations (a bug in the caller); file it."

    JOURNAL_UNREADABLE = "journal_unreadable", "state", "A journal row of this task was written by another agent version and cannot be read; the task is answered failed without running. Reconcile the slot."
    STATE_LOCKED = "state_locked", "state", "Another process holds the state DB's write lock past the busy timeout; nothing was written. Find the other process (sqlite3 shell, a second agent)."

    # --- Discovery findings (blockers and warnings in the host report)
    NUMA_UNREADABLE = "numa_unreadable", "discovery", "NUMA topology cannot be read from sysfs; check the kernel and the host root."
    NUMA_NODE_UNKNOWN = "numa_node_unknown", "discovery", "A device reports no NUMA node; firmware gives no affinity, pinning is planned without it."
    NO_GPUS = "no_gpus", "discovery", "No NVIDIA GPU function was found; check the hardware and that the PCI bus is visible."
    IOMMU_DISABLED = "iommu_disabled", "discovery", "No IOMMU groups exist; enable VT-d/AMD-Vi in firmware and intel_iommu=on / amd_iommu=on."
    NO_FABRIC_VFS = "no_fabric_vfs", "discovery", "No fabric VFs exist; create the VFs on the fabric NIC."
    OVMF_MISSING = "ovmf_missing", "discovery", "OVMF firmware is not installed; install the ovmf package."
    GPU_NO_IOMMU_GROUP = "gpu_no_iommu_group", "discovery", "A GPU has no IOMMU group; enable the IOMMU."
    GPU_IOMMU_GROUP_SHARED = "gpu_iommu_group_shared", "discovery", "A GPU shares its IOMMU group with other devices; fix ACS/slot placement, the slot cannot be passed through."
    GPU_NUMA_UNKNOWN = "gpu_numa_unknown", "discovery", "A GPU reports no NUMA node; vCPU pinning cannot be planned for its slot."
    FABRIC_VF_NO_IOMMU_GROUP = "fabric_vf_no_iommu_group", "discovery", "A fabric VF has no IOMMU group; enable the IOMMU."
    NO_FREE_FABRIC_VF = "no_free_fabric_vf", "discovery", "No fabric VF is left for a GPU's slot; create more VFs."
    NO_NVME_DEVICE = "no_nvme_device", "discovery", "No raw, unmounted by-id NVMe disk is left for a GPU's slot; free or add a disk."
    NO_PRIVATE_IP = "no_private_ip", "discovery", "The subnet has no free address for a slot; widen the subnet."
    SYSFS_MISSING = "sysfs_missing", "discovery", "An expected sysfs directory is missing; check the kernel or the recorded fixture."
    SYSFS_NOT_DIRECTORY = "sysfs_not_directory", "discovery", "A sysfs path is not a directory; check the kernel or fixture."
    SYSFS_NOT_NUMERIC = "sysfs_not_numeric", "discovery", "A sysfs value that should be a number is not; check the kernel or fixture."
    SYSFS_OUT_OF_RANGE = "sysfs_out_of_range", "discovery", "A sysfs value does not fit its field; check the kernel or fixture."
    SYSFS_UNEXPECTED_VALUE = "sysfs_unexpected_value", "discovery", "A sysfs value has an unexpected shape; check the kernel or fixture."
    SYSFS_UNREADABLE = "sysfs_unreadable", "discovery", "A sysfs path cannot be read; check permissions (run as root)."
    SYMLINK_LOOP = "symlink_loop", "discovery", "A sysfs link cannot be resolved; check the kernel or fixture."
    PCI_ENTRY_DANGLING = "pci_entry_dangling", "discovery", "A PCI device entry does not lead to a device directory; check the kernel or fixture."
    PCI_ENTRY_UNEXPECTED = "pci_entry_unexpected", "discovery", "A /sys/bus/pci/devices entry is not a PCI address; check the fixture."
    PCI_LINK_UNEXPECTED = "pci_link_unexpected", "discovery", "A PCI link leads to something that is not a PCI function; check the kernel or fixture."
    BLOCK_ENTRY_DANGLING = "block_entry_dangling", "discovery", "A block device entry does not lead to a directory; check the kernel or fixture."
    BY_ID_DANGLING = "by_id_dangling", "discovery", "A /dev/disk/by-id link points at something that is not a block device here; check udev."
    BY_ID_NAME_UNUSABLE = "by_id_name_unusable", "discovery", "A by-id link name has characters a slot path may not carry; the disk is not offered."
    NO_STABLE_BY_ID = "no_stable_by_id", "discovery", "A disk has no /dev/disk/by-id link; fix udev, the disk is not offered."
    NOT_LOCAL_PCIE = "not_local_pcie", "discovery", "A disk is not a local PCIe NVMe namespace; it is not offered."
    NOT_RAW = "not_raw", "discovery", "A disk is not a raw disk (partitions or signatures); wipe it deliberately to offer it."
    READ_ONLY = "read_only", "discovery", "A disk is read-only; it is not offered."
    EMPTY = "empty", "discovery", "A disk reports size 0; check the device."
    HOLDERS = "holders", "discovery", "A disk is held by dm/md/LVM; remove the holder to offer it."
    MOUNTED = "mounted", "discovery", "A disk is mounted; unmount it to offer it."
    MOUNTED_CHILD = "mounted_child", "discovery", "A partition or holder of the disk is mounted; unmount it to offer it."
    OS_DISK = "os_disk", "discovery", "A disk holds the host OS; it is never offered."
    SWAP = "swap", "discovery", "A disk (or part of it) is active swap; swapoff it to offer it."
    MOUNTINFO_LINE_UNPARSED = "mountinfo_line_unparsed", "discovery", "A /proc/self/mountinfo line does not parse; disk use cannot be proven, file a bug with the line."
    NET_EVIDENCE_ERROR = "net_evidence_error", "discovery", "Network evidence could not be gathered; read the evidence."
    NETNS_MISSING = "netns_missing", "discovery", "The named network namespace does not exist; create it or fix the name."
    NETNS_ON_FIXTURE = "netns_on_fixture", "discovery", "A network namespace was asked for on a recorded fixture; use the live host."
    NETLINK_UNREADABLE = "netlink_unreadable", "discovery", "A netlink dump failed; check privileges and the namespace."
    COMMAND_FAILED = "command_failed", "discovery", "A recorded or run command did not succeed; evidence has its stderr."
    COMMAND_NOT_RECORDED = "command_not_recorded", "discovery", "A fixture has no recorded output for a command; re-record the fixture."
    COMMAND_OUTPUT_INVALID = "command_output_invalid", "discovery", "A command printed output that does not parse; check the tool version."
    IP_FORWARD_UNREADABLE = "ip_forward_unreadable", "discovery", "net.ipv4.ip_forward cannot be read; check /proc."
    IP_FORWARD_DISABLED = "ip_forward_disabled", "discovery", "net.ipv4.ip_forward is 0; run prepare-host's network baseline or enable it."
    IP_FORWARD_UNPROVEN = "ip_forward_unproven", "discovery", "net.ipv4.ip_forward could not be read, so forwarding is not proven."
    NAT_UNREADABLE = "nat_unreadable", "discovery", "The NAT rule check could not run; check iptables and privileges."
    NAT_MISSING = "nat_missing", "discovery", "The NAT masquerade rule is not in force; apply the network baseline."
    NAT_UNPROVEN = "nat_unproven", "discovery", "The NAT rule could not be checked, so it is not proven."
    OVS_BRIDGE_MISSING = "ovs_bridge_missing", "discovery", "The OVS bridge does not exist; create it (prepare-host network baseline)."
    OVS_BRIDGE_UNPROVEN = "ovs_bridge_unproven", "discovery", "Links could not be read, so the OVS bridge is not proven."
    GATEWAY_ADDRESS_MISSING = "gateway_address_missing", "discovery", "The bridge has no gateway address; apply the network baseline."
    GATEWAY_ADDRESS_UNPROVEN = "gateway_address_unproven", "discovery", "Addresses could not be read, so the gateway address is not proven."
    DNSMASQ_SUBNET_MISSING = "dnsmasq_subnet_missing", "discovery", "dnsmasq serves no range for the slot subnet; fix its configuration."
    DNSMASQ_NOT_RUNNING = "dnsmasq_not_running", "discovery", "No dnsmasq process runs; systemctl enable --now dnsmasq."
    DNSMASQ_UNPROVEN = "dnsmasq_unproven", "discovery", "There is no process table under the root, so a running dnsmasq cannot be proven."
    DNSMASQ_NOT_READING_HOSTS = "dnsmasq_not_reading_hosts", "discovery", "No running dnsmasq reads the agent's hosts file; add dhcp-hostsfile to its config."
    PCI_ROM_UNREADABLE = "pci_rom_unreadable", "discovery", "A GPU's PCI expansion ROM could not be enabled or read (no ROM BAR, device busy, not root); its VBIOS is unproven."
    FIRMWARE_DRIFT = "firmware_drift", "discovery", "A device runs firmware outside the site's baseline ([slice] firmware_baseline); update or roll it back, or widen the baseline."
    FIRMWARE_UNREADABLE = "firmware_unreadable", "discovery", "The baseline judges a device whose firmware version cannot be read here; read it on the live host (driver bound) before trusting it."
    DNSMASQ_CONFIG_READS_OTHER_HOSTS = "dnsmasq_config_reads_other_hosts", "discovery", "The recorded dnsmasq config reads another hosts file than the agent's; point dhcp-hostsfile at the agent's."
    DNSMASQ_CONFIG_READS_NO_HOSTS = "dnsmasq_config_reads_no_hosts", "discovery", "The recorded dnsmasq config names no dhcp-hostsfile/dhcp-hostsdir; add the agent's hosts file."
    DNSMASQ_PID_FILE_MISMATCH = "dnsmasq_pid_file_mismatch", "discovery", "dnsmasq's pid file names a different process; fix the pid file setting."
    DNSMASQ_CONFIG_UNREADABLE = "dnsmasq_config_unreadable", "discovery", "A dnsmasq config file cannot be read; check permissions."
    DNSMASQ_CONF_UNREADABLE = "dnsmasq_conf_unreadable", "discovery", "A dnsmasq conf file of a running dnsmasq cannot be read; check permissions."
    DNSMASQ_CONF_DIR_UNREADABLE = "dnsmasq_conf_dir_unreadable", "discovery", "A dnsmasq conf-dir cannot be listed; check permissions."
    TMFIFO_WITHOUT_IPV4 = "tmfifo_without_ipv4", "discovery", "The BlueField tmfifo interface has no /30 IPv4 address; configure it."
    # slot blockers/warnings built as f-strings in discovery/slots.py (see TEMPLATES)
    NVME_OS_DISK = "nvme_os_disk", "discovery", "The slot's only candidate disk holds the host OS; the slot is blocked, add a disk."
    NVME_NO_STABLE_BY_ID = "nvme_no_stable_by_id", "discovery", "The slot's disk has no /dev/disk/by-id link; fix udev, the slot is blocked."
    NVME_MOUNTED = "nvme_mounted", "discovery", "The slot's disk is mounted; unmount it to unblock the slot."
    NVME_MOUNTED_CHILD = "nvme_mounted_child", "discovery", "A partition or holder of the slot's disk is mounted; unmount it to unblock the slot."
    NVME_HOLDERS = "nvme_holders", "discovery", "The slot's disk is held by dm/md/LVM; remove the holder to unblock the slot."
    NVME_SWAP = "nvme_swap", "discovery", "The slot's disk is active swap; swapoff it to unblock the slot."
    NVME_NOT_RAW = "nvme_not_raw", "discovery", "The slot's disk has partitions or signatures; wipe it deliberately to unblock the slot."
    NVME_READ_ONLY = "nvme_read_only", "discovery", "The slot's disk is read-only; the slot is blocked."
    NVME_EMPTY = "nvme_empty", "discovery", "The slot's disk reports size 0; check the device."
    NVME_NOT_LOCAL_PCIE = "nvme_not_local_pcie", "discovery", "The slot's disk is not a local PCIe NVMe namespace; the slot is blocked."
    NVME_REMOTE_NUMA = "nvme_remote_numa", "discovery", "The slot's disk is on another NUMA node than its GPU; it works, slower: rebalance if it matters."
    FABRIC_REMOTE_NUMA = "fabric_remote_numa", "discovery", "The slot's fabric VF is on another NUMA node than its GPU; it works, slower: rebalance if it matters."

    PCI_RESOURCE_MALFORMED = "pci_resource_malformed", "discovery", "A device's sysfs resource file could not be parsed into BARs; the device's BAR sizes are unknown."

    # --- Safety guards (each refusal changed nothing)
    DISK_GUARD_REFUSED = "disk_guard_refused", "guards", "The disk guard refused a disk; read the evidence."
    NOT_BY_ID = "not_by_id", "guards", "A disk path is not under /dev/disk/by-id; use the stable by-id path."
    NOT_WHOLE_DISK = "not_whole_disk", "guards", "A by-id path resolves to a partition; use the whole-disk path."
    MISSING = "missing", "guards", "A disk has no readable identity in sysfs; check the device."
    BUSY = "busy", "guards", "The disk is busy (EBUSY on exclusive open); find and stop its user."
    IN_USE_BY_DOMAIN = "in_use_by_domain", "guards", "The disk is attached to a libvirt domain; release that domain first."
    NOT_IN_LEASE = "not_in_lease", "guards", "The disk is not part of this allocation's lease; fix the task."
    UNPROVEN = "unproven", "guards", "Mount/swap/block tables could not be read completely, so the disk is refused; fix /proc access."
    VFIO_GUARD_REFUSED = "vfio_guard_refused", "guards", "The VFIO guard refused a device; read the evidence."
    DEVICE_MISSING = "device_missing", "guards", "A PCI function is not present on this host; fix the task or hardware."
    NO_IOMMU_GROUP = "no_iommu_group", "guards", "A PCI function has no IOMMU group; enable the IOMMU."
    IOMMU_GROUP_NOT_ISOLATED = "iommu_group_not_isolated", "guards", "The IOMMU group holds devices outside the slot; fix ACS/placement."
    NOT_APPROVED = "not_approved", "guards", "A slot/device has no approved record in this task; approve it in the control plane first."
    SLOT_MISMATCH = "slot_mismatch", "guards", "The task's slot binding does not match discovery; refresh the topology and replan."
    VM_START_REFUSED = "vm_start_refused", "guards", "A VM start was refused by its guard; read the evidence."
    DISK_GUARD_MISMATCH = "disk_guard_mismatch", "guards", "The domain's disk is not the one the guard approved; do not start it, investigate."
    NOT_BOUND_TO_VFIO = "not_bound_to_vfio", "guards", "A device to pass through is not bound to vfio-pci; rebind it (provision does this)."
    PROVISION_PRECONDITION_FAILED = "provision_precondition_failed", "guards", "A host precondition for provisioning is not met; read the evidence."
    BRIDGE_GATEWAY_MISSING = "bridge_gateway_missing", "guards", "The OVS bridge has no gateway address; apply the network baseline."

    # --- Host: Open vSwitch (host/network/ovs.py, host/network/portflows.py, host/network/nftguard.py)
    OVS_ERROR = "ovs_error", "host_ovs", "An OVS operation failed; read the evidence."
    OVS_REFUSED = "ovs_refused", "host_ovs", "An OVS change was refused because the database does not look as expected; read the evidence."
    OVS_INVALID_INPUT = "ovs_invalid_input", "host_ovs", "A bridge/port/MAC/allocation given to the OVS driver is malformed; fix the caller."
    OVSDB_UNREACHABLE = "ovsdb_unreachable", "host_ovs", "ovsdb-server cannot be reached at the configured remote; start openvswitch-switch or fix the remote."
    OVSDB_NOT_INITIALIZED = "ovsdb_not_initialized", "host_ovs", "The Open_vSwitch table has no row; run ovs-vsctl init (or restart openvswitch-switch)."
    OVS_COMMIT_FAILED = "ovs_commit_failed", "host_ovs", "An OVSDB transaction failed; evidence has the database's error."
    OVS_COMMIT_RETRIES_EXHAUSTED = "ovs_commit_retries_exhausted", "host_ovs", "OVSDB kept changing under the transaction (try-again) past the retry limit; retry later."
    OVS_COMMIT_TIMEOUT = "ovs_commit_timeout", "host_ovs", "An OVSDB transaction did not complete in time; check ovsdb-server load."
    OVS_VSWITCHD_TIMEOUT = "ovs_vswitchd_timeout", "host_ovs", "ovs-vswitchd did not apply a change in time; check that ovs-vswitchd runs."
    OVS_BRIDGE_DATAPATH_MISMATCH = "ovs_bridge_datapath_mismatch", "host_ovs", "The bridge exists with another datapath type; fix or recreate the bridge."
    OVS_INTERFACE_CONFLICT = "ovs_interface_conflict", "host_ovs", "An interface of that name exists with conflicting settings; remove the stale interface."
    OVS_PORT_MAC_CONFLICT = "ovs_port_mac_conflict", "host_ovs", "The port exists with another MAC; remove the stale port."
    OVS_PORT_TYPE_CONFLICT = "ovs_port_type_conflict", "host_ovs", "The interface exists with another type; remove the stale port."
    OVS_PORT_NOT_SIMPLE = "ovs_port_not_simple", "host_ovs", "The port has several interfaces (a bond), not an agent port; leave it, fix the name."
    OVS_PORT_ON_OTHER_BRIDGE = "ovs_port_on_other_bridge", "host_ovs", "The port exists on another bridge; remove it there first."
    OVS_PORT_NOT_OWNED = "ovs_port_not_owned", "host_ovs", "The port is not marked as the agent's; it is never touched, fix the name."
    OVS_PORT_OWNED_BY_OTHER_ALLOCATION = "ovs_port_owned_by_other_allocation", "host_ovs", "The port belongs to another allocation; release that allocation instead."
    OVS_RUNDIR_UNKNOWN = "ovs_rundir_unknown", "host_ovs", "The OVS run directory cannot be derived from the remote; configure a unix socket remote."
    FLOW_DUMP_UNPARSABLE = "flow_dump_unparsable", "host_ovs", "ovs-ofctl printed a flow that does not parse; check the OVS version."
    PORT_ISOLATION_CONFLICT = "port_isolation_conflict", "host_ovs", "The port's isolation flows conflict with existing flows; read the evidence."
    PORT_ISOLATION_INVALID_INPUT = "port_isolation_invalid_input", "host_ovs", "Inputs for port isolation flows are malformed; fix the caller."
    NFT_GUARD_INVALID_INPUT = "nft_guard_invalid_input", "host_ovs", "Inputs for the nftables guard are malformed; fix the caller."
    NFT_OUTPUT_UNPARSABLE = "nft_output_unparsable", "host_ovs", "nft -j printed something that is not JSON; check the nftables version."

    # --- Host: network baseline (prepare-host)
    NETWORK_BASELINE_FAILED = "network_baseline_failed", "host_net", "Applying the host network baseline failed; read the evidence."
    BASELINE_TOOLS_MISSING = "baseline_tools_missing", "host_net", "Tools the network baseline needs are missing; install them (evidence lists them)."
    BASELINE_LINK_MISSING = "baseline_link_missing", "host_net", "An interface the baseline needs does not exist; fix the configured name."
    BASELINE_BRIDGE_LINK_MISSING = "baseline_bridge_link_missing", "host_net", "The baseline bridge has no link; check OVS and the bridge name."
    BASELINE_IP_FORWARD_FAILED = "baseline_ip_forward_failed", "host_net", "Enabling net.ipv4.ip_forward failed; check /proc/sys and privileges."
    BASELINE_NAT_CHECK_FAILED = "baseline_nat_check_failed", "host_net", "The NAT rule check failed; check iptables."

    # --- Host: dnsmasq reservations
    DNSMASQ_ERROR = "dnsmasq_error", "host_dnsmasq", "A dnsmasq operation failed; read the evidence."
    RESERVATION_REFUSED = "reservation_refused", "host_dnsmasq", "A DHCP reservation was refused; read the evidence."
    BAD_ALLOCATION_ID = "bad_allocation_id", "host_dnsmasq", "The allocation id is not a lower-case UUID; fix the task."
    BAD_SLOT_INDEX = "bad_slot_index", "host_dnsmasq", "The slot index is not an integer 0..255; fix the task."
    BAD_MAC = "bad_mac", "host_dnsmasq", "The MAC is malformed, multicast or all-zero; fix the task."
    BAD_IP = "bad_ip", "host_dnsmasq", "The IP is not an IPv4 address; fix the task."
    BAD_HOSTNAME = "bad_hostname", "host_dnsmasq", "The hostname is not a DNS label; fix the task."
    IP_OUTSIDE_SUBNET = "ip_outside_subnet", "host_dnsmasq", "The private IP is outside the slot subnet; fix the task."
    IP_RESERVED = "ip_reserved", "host_dnsmasq", "The private IP is the network, gateway or broadcast address; fix the task."
    IP_IN_USE = "ip_in_use", "host_dnsmasq", "The IP is already reserved by another line; release that reservation first."
    MAC_IN_USE = "mac_in_use", "host_dnsmasq", "The MAC is already reserved by another line; release that reservation first."
    HOSTNAME_IN_USE = "hostname_in_use", "host_dnsmasq", "The hostname is already reserved by another line; pick another hostname."
    SLOT_RESERVED = "slot_reserved", "host_dnsmasq", "The slot already has a reservation of another allocation; release it first."
    HOSTS_FILE_LOCKED = "hosts_file_locked", "host_dnsmasq", "Another writer holds the hosts-file lock; retry, then look for a stuck process."
    DNSMASQ_PID_UNKNOWN = "dnsmasq_pid_unknown", "host_dnsmasq", "No dnsmasq pid file is configured or readable; configure dnsmasq_pid_file."
    PID_NOT_DNSMASQ = "pid_not_dnsmasq", "host_dnsmasq", "The pid file names a process that is not dnsmasq; fix the pid file."

    # --- Host: libvirt domains, XML, readiness
    LIBVIRT_ERROR = "libvirt_error", "host_libvirt", "A libvirt call failed; evidence has libvirt's error."
    LIBVIRT_UNREACHABLE = "libvirt_unreachable", "host_libvirt", "libvirtd cannot be reached; start libvirtd."
    LIBVIRT_TIMEOUT = "libvirt_timeout", "host_libvirt", "A libvirt call did not finish in time; check libvirtd's health."
    DOMAIN_REFUSED = "domain_refused", "host_libvirt", "A domain operation was refused; read the evidence."
    DOMAIN_NOT_FOUND = "domain_not_found", "host_libvirt", "The libvirt domain does not exist; reconcile the slot."
    DOMAIN_NAME_CONFLICT = "domain_name_conflict", "host_libvirt", "A domain of that name exists with another identity; remove the stale domain."
    DOMAIN_NOT_RUNNING = "domain_not_running", "host_libvirt", "The domain is not running; start it or reconcile."
    DOMAIN_RUNNING = "domain_running", "host_libvirt", "The domain is running when it must be stopped; stop it first."
    NOT_AGENT_DOMAIN = "not_agent_domain", "host_libvirt", "The domain was not created by the agent; it is never touched."
    START_EVIDENCE_MISMATCH = "start_evidence_mismatch", "host_libvirt", "The started domain does not match what was approved; it was stopped, investigate."
    UNDEFINE_LEFT_DOMAIN = "undefine_left_domain", "host_libvirt", "Undefine returned but the domain still exists; remove it by hand."
    HOSTDEV_MISSING = "hostdev_missing", "host_libvirt", "The domain XML lacks an expected hostdev; fix the plan."
    DISK_NUMA_MISMATCH = "disk_numa_mismatch", "host_libvirt", "The disk is on another NUMA node than the GPU; fix the slot plan."
    NUMA_UNKNOWN = "numa_unknown", "host_libvirt", "The NUMA node needed for pinning is unknown; check discovery."
    VCPUS_EXCEED_NUMA_NODE = "vcpus_exceed_numa_node", "host_libvirt", "The vCPUs asked for exceed the NUMA node's CPUs; use a smaller profile."
    MEMORY_NOT_HUGEPAGE_MULTIPLE = "memory_not_hugepage_multiple", "host_libvirt", "The memory size is not a multiple of the huge page size; fix the profile."
    READINESS_TIMEOUT = "readiness_timeout", "host_libvirt", "The guest did not become ready in time; check the console log."
    LEASE_TIMEOUT = "lease_timeout", "host_libvirt", "The guest did not take its DHCP lease in time; check dnsmasq and the guest network."
    SSH_TIMEOUT = "ssh_timeout", "host_libvirt", "The guest's SSH did not answer in time; check the image and the guest console."
    SEED_ISO_BUILD_FAILED = "seed_iso_build_failed", "host_libvirt", "Building the cloud-init seed ISO failed; check the ISO tool named in the evidence."
    SEED_ISO_WRITE_FAILED = "seed_iso_write_failed", "host_libvirt", "Writing the seed ISO failed; check the path and free space."

    DUPLICATE_SLOT_DEVICE = "duplicate_slot_device", "host_libvirt", "Two slots of one domain name the same PCI function or disk; the domain XML was not built."
    GPU_BARS_UNKNOWN = "gpu_bars_unknown", "host_libvirt", "Discovery read no 64-bit BAR sizes for a GPU, so the guest's MMIO window cannot be sized; re-run discovery (sysfs resource)."
    TOO_MANY_DEVICES_ON_NODE = "too_many_devices_on_node", "host_libvirt", "More devices on one NUMA node than the guest topology has root ports for; split the slot set."
    TOO_MANY_NUMA_NODES = "too_many_numa_nodes", "host_libvirt", "The slot set spans more host NUMA nodes than the guest topology supports."

    # --- Host: image cache and disk clone
    IMAGE_CACHE_ERROR = "image_cache_error", "host_images", "The image cache failed; read the evidence."
    IMAGE_URL_REFUSED = "image_url_refused", "host_images", "The image URL is not allowed by policy; use an allowed URL."
    FETCH_FAILED = "fetch_failed", "host_images", "Downloading the image failed; evidence has the HTTP status or error."
    FETCH_STALLED = "fetch_stalled", "host_images", "The download made no progress; check the mirror and network."
    FETCH_TOOL_MISSING = "fetch_tool_missing", "host_images", "curl is not installed, so https images cannot be downloaded; install curl (the package depends on it)."
    FETCH_TIMEOUT = "fetch_timeout", "host_images", "The download did not finish in time; check the mirror and network."
    TOO_LARGE = "too_large", "host_images", "The download is larger than allowed; fix the image or the limit."
    TRUNCATED = "truncated", "host_images", "The download ended before its declared length; retry."
    DIGEST_MISMATCH = "digest_mismatch", "host_images", "The downloaded image does not have the expected SHA-256; fix the image or the digest."
    UNKNOWN_FORMAT = "unknown_format", "host_images", "The image format is not allowed; use qcow2 or raw."
    BACKING_FILE_REFUSED = "backing_file_refused", "host_images", "The image has a backing file; upload a flattened image."
    CACHE_FULL = "cache_full", "host_images", "The image cache has no room after evicting unused images; raise the limit or free space."
    CACHE_WRITE_FAILED = "cache_write_failed", "host_images", "Writing into the image cache failed; check the disk."
    CLONE_FAILED = "clone_failed", "host_images", "Cloning the image onto the disk failed; the disk is dirty, release wipes it."
    CLONE_CANCELLED = "clone_cancelled", "host_images", "The clone was cancelled; the disk is dirty, release wipes it."
    IMAGE_TOO_LARGE = "image_too_large", "host_images", "The image's virtual size exceeds the disk; use a smaller image."

    # --- Host: VFIO binding and uevents
    VFIO_BIND_FAILED = "vfio_bind_failed", "host_vfio", "Binding a device to vfio-pci failed; read the evidence."
    VFIO_DRIVER_MISSING = "vfio_driver_missing", "host_vfio", "The vfio-pci module is not loaded; modprobe vfio-pci."
    BIND_NOT_VERIFIED = "bind_not_verified", "host_vfio", "The bind could not be verified in sysfs; check the device."
    UNBIND_FAILED = "unbind_failed", "host_vfio", "Unbinding the device from its driver failed; check the driver."
    UNBIND_TIMEOUT = "unbind_timeout", "host_vfio", "Unbinding the device did not finish in time; the driver may be stuck, reboot may be needed."
    UEVENT_MONITOR_UNAVAILABLE = "uevent_monitor_unavailable", "host_vfio", "The uevent monitor cannot be opened; check netlink privileges."
    UEVENT_MONITOR_FAILED = "uevent_monitor_failed", "host_vfio", "The uevent monitor failed while running; the daemon falls back to periodic discovery."
    UEVENT_MONITOR_NOT_STARTED = "uevent_monitor_not_started", "host_vfio", "The uevent monitor was used before start (a bug); file it."
    NVME_CAPS_UNREADABLE = "nvme_caps_unreadable", "host_vfio", "NVMe capabilities cannot be read; check nvme-cli and the device."

    # --- Host: GPU handover between tenants
    GPU_HANDOVER_REFUSED = "gpu_handover_refused", "host_gpu", "A GPU handover was refused before anything was touched; read the evidence."
    GPU_HELD_BY_DOMAIN = "gpu_held_by_domain", "host_gpu", "A defined libvirt domain names the GPU or VF; undefine it (or find who defined it) and retry the release."
    GPU_RESET_PATH_MISSING = "gpu_reset_path_missing", "host_gpu", "The device offers no reset the agent may use (no sysfs reset_method, no bus reset, no FLR); check the kernel and the PCIe topology."
    GPU_MEMORY_CLEAR_UNPROVABLE = "gpu_memory_clear_unprovable", "host_gpu", "Only an FLR is possible and the profile requires a memory clear, which is proven only after a bus reset; fix the topology or the profile."
    GPU_HANDOVER_TOOL_MISSING = "gpu_handover_tool_missing", "host_gpu", "NVIDIA's nvidia_gpu_tools.py is not installed or configured; reinstall the package or set slice.gpu_admin_tool."
    GPU_HANDOVER_FAILED = "gpu_handover_failed", "host_gpu", "Handing the GPU over failed; the slot stays cleanup_blocked, read the evidence."
    GPU_RESET_FAILED = "gpu_reset_failed", "host_gpu", "The GPU or VF reset did not complete (or the device left vfio-pci); the slot stays cleanup_blocked, check the device and retry the release."
    GPU_MEMORY_CLEAR_UNVERIFIED = "gpu_memory_clear_unverified", "host_gpu", "The firmware's memory scrub was not proven finished after the reset; the slot stays cleanup_blocked, retry the release or drain the GPU."
    GPU_SETTINGS_NOT_RESTORED = "gpu_settings_not_restored", "host_gpu", "ECC/MIG/CC/PPCIe could not be set back to the profile's or read back so; the slot stays cleanup_blocked, read the mismatches."
    GPU_CONFIG_SPACE_NOT_RESTORED = "gpu_config_space_not_restored", "host_gpu", "After the reset the GPU's config space does not hold the kernel's BARs; the slot stays cleanup_blocked, rescan or reboot."

    # --- Host: disk wipe
    WIPE_REFUSED = "wipe_refused", "host_wipe", "A wipe was refused; read the evidence."
    WIPE_FAILED = "wipe_failed", "host_wipe", "Wiping the disk failed; the slot stays blocked, retry release or replace the disk."
    WIPE_PROBE_FAILED = "wipe_probe_failed", "host_wipe", "Probing the disk after the wipe failed; check blkid."
    WIPE_UNVERIFIED = "wipe_unverified", "host_wipe", "The wipe could not be verified; the slot stays blocked until a verified wipe."
    WIPE_CANCELLED = "wipe_cancelled", "host_wipe", "The wipe was cancelled; the disk is dirty, retry release."
    WIPE_TIMEOUT = "wipe_timeout", "host_wipe", "The wipe did not finish in time; check the drive, retry release."
    WIPE_IDENTITY_MISMATCH = "wipe_identity_mismatch", "host_wipe", "The disk identity changed during the wipe; investigate, the slot stays blocked."
    WIPE_METHOD_UNSUPPORTED = "wipe_method_unsupported", "host_wipe", "The drive does not support the configured wipe method; pick another policy."
    WIPE_SCOPE_EXCEEDS_LEASE = "wipe_scope_exceeds_lease", "host_wipe", "The wipe would reach beyond the leased namespace; it was refused, fix the policy."
    ZEROES_NOT_GUARANTEED = "zeroes_not_guaranteed", "host_wipe", "An erase was passed over at validate: the namespace does not promise erased blocks read zero (evidence only)."

    # --- Tasks: plan, admission, provision, release, power
    PLAN_REFUSED = "plan_refused", "tasks", "The plan was refused; read the evidence."
    DUPLICATE_BINDING = "duplicate_binding", "tasks", "Two slots in the plan bind the same device or address; fix the plan."
    SLOT_NOT_AVAILABLE = "slot_not_available", "tasks", "A planned slot is not available; refresh the topology."
    NVME_UNSAFE = "nvme_unsafe", "tasks", "A planned disk is not safe to use; refresh the topology."
    ADMISSION_REFUSED = "admission_refused", "tasks", "Admission refused the task; read the evidence."
    ALLOCATION_HAS_SLOT = "allocation_has_slot", "tasks", "The allocation already holds a slot here; release it first."
    PROVISION_REFUSED = "provision_refused", "tasks", "Provision was refused; read the evidence."
    ALREADY_PROVISIONED = "already_provisioned", "tasks", "The same provision already happened; nothing to do."
    SLOT_BUSY = "slot_busy", "tasks", "The slot is held by another allocation; pick another slot."
    SLOT_CLEANUP_BLOCKED = "slot_cleanup_blocked", "tasks", "The slot is blocked until a cleanup (wipe) succeeds; run release."
    PROVISION_INTERRUPTED = "provision_interrupted", "tasks", "A provision was interrupted (agent restart); the slot is blocked until release."
    EMULATED_DOMAIN_NOT_ALLOWED = "emulated_domain_not_allowed", "tasks", "An emulated (no-KVM) domain is not allowed by this profile; use a KVM host."
    RESERVATION_MISSING = "reservation_missing", "tasks", "The port could not be isolated because its DHCP reservation is missing; release and reprovision."
    RELAY_KEY_MISSING = "relay_key_missing", "tasks", "The terminal relay key is missing; run prepare-host."
    PIPELINE_FAILED = "pipeline_failed", "tasks", "A pipeline step failed; evidence names the step and its cause."
    CANCELLED = "cancelled", "tasks", "The task was cancelled; nothing more ran."
    RELEASE_REFUSED = "release_refused", "tasks", "Release was refused; read the evidence."
    FIRMWARE_CHANGED = "firmware_changed", "tasks", "A slot device's firmware changed during the tenancy; the slot is quarantined until it reads its recorded or a baseline version."
    POWER_REFUSED = "power_refused", "tasks", "The power operation was refused; read the evidence."
    DOMAIN_MISSING = "domain_missing", "tasks", "The slot's domain does not exist; reconcile the slot."
    DOMAIN_NOT_OURS = "domain_not_ours", "tasks", "The domain does not belong to this slot; it is never touched."
    DOMAIN_LEASE_MISMATCH = "domain_lease_mismatch", "tasks", "The domain does not match the slot's lease; investigate before acting."
    NOT_THIS_ALLOCATION = "not_this_allocation", "tasks", "The slot is held by another allocation; fix the task."
    SLOT_NOT_ACTIVE = "slot_not_active", "tasks", "The slot is not active; provision it first."
    SUPERSEDED = "superseded", "tasks", "A newer slice.vm_power request of the same slot took this one's place, or the same operation already runs (evidence: superseded_by); nothing was done by this task."
    CONSOLE_LOG_MISSING = "console_log_missing", "tasks", "No console log of this allocation and slot on this host (never provisioned here, or its retention ended)."
    CONSOLE_LOG_UNSAFE = "console_log_unsafe", "tasks", "The console log path is a link or not a regular file; it is never read: investigate the log directory."
    CONSOLE_LOG_UNREADABLE = "console_log_unreadable", "tasks", "The console log cannot be read; check the console_log_dir permissions."

    RELEASE_INTERRUPTED = "release_interrupted", "tasks", "A release was interrupted (agent killed) and its redelivery came after its deadline; the slot is cleanup_blocked: send a new release."

    BOOT_SLOT_NOT_IN_SET = "boot_slot_not_in_set", "tasks", "A multi-slot provision's slot set does not contain its boot slot; the control plane must send the boot slot in slots."
    DUPLICATE_SLOT = "duplicate_slot", "tasks", "A slot (or one of its devices) appears twice in a provision's slot set; nothing was leased."
    NOT_ENOUGH_FREE_SLOTS = "not_enough_free_slots", "tasks", "The slot set is larger than the host's free slots; nothing was leased. Plan on a host with enough free slots."
    PLACEMENT_VIOLATED = "placement_violated", "tasks", "The slot set crosses a NUMA node or PCIe switch the runtime profile's placement forbids; the evidence names a set that fits."
    READINESS_EGRESS_UNCONFIGURED = "readiness_egress_unconfigured", "tasks", "The profile asks readiness to prove egress but the host has no [slice] readiness_egress_target; refused before the lease."
    READINESS_EGRESS_UNPROVEN = "readiness_egress_unproven", "tasks", "The guest's first boot never reached the egress target through the NAT (conntrack shows no source-NATed, answered connection); check MASQUERADE and the uplink."
    CONNTRACK_UNREADABLE = "conntrack_unreadable", "tasks", "The host's connection tracking table could not be read to prove egress (nf_conntrack missing or no permission)."

    SLOT_DEVICES_CHANGED = "slot_devices_changed", "tasks", "After a host reboot an active slot's GPU, VF or disk is not what its lease names; the domain is not started and the slot is failed. Check the hardware."

    # --- Deploy: prepare-host and the terminal relay key
    HOST_PATH_REFUSED = "host_path_refused", "deploy", "prepare-host refused a host path; read the evidence."
    HOST_PATH_MISSING = "host_path_missing", "deploy", "A required host path does not exist; run prepare-host."
    HOST_PATH_NOT_DIRECTORY = "host_path_not_directory", "deploy", "A host path exists and is not a directory; remove it."
    HOST_PATH_MODE = "host_path_mode", "deploy", "A host path has the wrong mode; run prepare-host."
    HOST_PATH_INSECURE = "host_path_insecure", "deploy", "A host path is writable by others; fix its owner and mode."
    HOST_PATH_UNREACHABLE = "host_path_unreachable", "deploy", "A parent directory blocks search for others; chmod o+x it."
    HOST_PATH_READ_ONLY = "host_path_read_only", "deploy", "A host path is on a read-only filesystem; remount it."
    HOST_PATH_CONFLICT = "host_path_conflict", "deploy", "Two specs demand different modes for one path; fix the specs."
    HOST_PATH_WRITE_FAILED = "host_path_write_failed", "deploy", "Creating a host path failed; check the disk and permissions."
    RELAY_KEY_INVALID = "relay_key_invalid", "deploy", "The relay key file is not a valid key; regenerate it (prepare-host)."
    RELAY_KEY_INSECURE = "relay_key_insecure", "deploy", "The relay private key is readable by others; chmod 600 it."
    RELAY_KEY_INCOMPLETE = "relay_key_incomplete", "deploy", "Only half of the relay key pair exists; remove it or restore the private key."
    RELAY_KEY_MISMATCH = "relay_key_mismatch", "deploy", "The relay public key does not match the private key; regenerate the pair."
    RELAY_KEY_PATH_INVALID = "relay_key_path_invalid", "deploy", "The relay key path is not absolute; fix the configuration."
    RELAY_KEY_UNREADABLE = "relay_key_unreadable", "deploy", "A relay key file cannot be read; check its type and permissions."
    RELAY_KEY_WRITE_FAILED = "relay_key_write_failed", "deploy", "Writing the relay key failed; check the disk and ssh-keygen."

    # --- Fixtures: recorder and archives
    ARCHIVE_NAME = "archive_name", "fixtures", "The fixture archive name is invalid; use the documented naming."
    ARCHIVE_UNREADABLE = "archive_unreadable", "fixtures", "The fixture archive cannot be read; re-record it."
    NOT_A_TREE = "not_a_tree", "fixtures", "The path to archive is not a directory; fix the path."
    UNSAFE_ARCHIVE_ENTRY = "unsafe_archive_entry", "fixtures", "An archive entry escapes the destination; the archive is refused."
    UNSUPPORTED_ENTRY = "unsupported_entry", "fixtures", "An archive entry is of an unsupported type; re-record the fixture."
    OUTPUT_INSIDE_SOURCE = "output_inside_source", "fixtures", "The output is inside the recorded tree; choose another output path."
    UNSAFE_DESTINATION = "unsafe_destination", "fixtures", "A recorded path would land outside the output; the recording is refused."

    # --- Terminal relay: slice.terminal_* sessions into a slice (SSH PTY relayed over NATS)
    HOST_KEY_CHANGED = "host_key_changed", "terminal", "The slice's SSH host key differs from the one pinned at its first session; refused (possible interception). Check the guest."
    RESERVATION_INVALID = "reservation_invalid", "terminal", "The slot's DHCP reservation on this host is missing or malformed, so the relay has no address to trust; run slice.reconcile."
    SESSION_CLOSED = "session_closed", "terminal", "The terminal session has already ended; open a new one."
    SESSION_EXISTS = "session_exists", "terminal", "A terminal session with this id was already opened on this node; use a fresh session id."
    SESSION_NOT_FOUND = "session_not_found", "terminal", "No live terminal session with this id for this allocation on this node."
    SLICE_NOT_RUNNING = "slice_not_running", "terminal", "The slice's domain is missing, not this allocation's, or not running; start it (slice.vm_power) first."
    TARGET_NOT_SLICE_IP = "target_not_slice_ip", "terminal", "The task named an address that is not the slot's reserved IP; the relay only connects to the slice itself."
    TARGET_PORT_REFUSED = "target_port_refused", "terminal", "The task named an SSH port other than the configured one; refused."
    TERMINAL_AUTH_REFUSED = "terminal_auth_refused", "terminal", "The guest refused the relay key for that user; check the user's authorized_keys holds the node's relay public key."
    TERMINAL_CAPACITY = "terminal_capacity", "terminal", "This node already runs its maximum number of terminal sessions ([slice.terminal] max_sessions)."
    TERMINAL_CONNECT_FAILED = "terminal_connect_failed", "terminal", "The SSH connection to the slice failed or timed out; check the guest is up and sshd listens."
    TERMINAL_DATA_TOO_LARGE = "terminal_data_too_large", "terminal", "A terminal data task carried more bytes than one frame allows; send keystrokes on the session's .in subject."
    TERMINAL_INPUT_FULL = "terminal_input_full", "terminal", "The session already holds [slice.terminal] max_pending_input_bytes of slice.terminal_data input its guest has not read; nothing of this task was queued. Wait for the guest, or close the session."
    TERMINAL_INPUT_STALLED = "terminal_input_stalled", "terminal", "The guest did not read this slice.terminal_data input within [slice.terminal] input_wait_s (it is not reading its terminal); the bytes were dropped, never typed later."
    TERMINAL_SLOT_BUSY = "terminal_slot_busy", "terminal", "The slot was held by a release, provision or power operation for longer than [slice.terminal] connect_timeout_s; no terminal opened: retry once it is done."
    TERMINAL_PTY_REFUSED = "terminal_pty_refused", "terminal", "The guest's SSH server refused the PTY or shell request."
    TERMINAL_PUBLISH_FAILED = "terminal_publish_failed", "terminal", "Publishing the session's output to NATS failed; the session was closed."
    TERMINAL_REFUSED = "terminal_refused", "terminal", "The terminal task was refused before any connection; the message and evidence name why."
    TERMINAL_SUBSCRIBE_FAILED = "terminal_subscribe_failed", "terminal", "Subscribing to the session's input subject failed (NATS permissions or connection); nothing was opened."
    TOO_MANY_SESSIONS = "too_many_sessions", "terminal", "The slice already has its maximum of terminal sessions ([slice.terminal] max_sessions_per_slice)."

    # --- Fleet operations: maintenance and drain, quarantined components (docs/maintenance.md)
    HOST_IN_MAINTENANCE = "host_in_maintenance", "fleet", "The host is in maintenance: new provisions and plans are refused before anything is leased; place the slice elsewhere, or turn maintenance off (slice.maintenance / gpuaas-agent maintenance off)."
    MAINTENANCE_STATE_UNREADABLE = "maintenance_state_unreadable", "fleet", "The stored maintenance state does not validate, so new work is refused; set it again with gpuaas-agent maintenance on|off --reason."
    COMPONENT_QUARANTINED = "component_quarantined", "fleet", "A component of the slot (GPU, disk, VF or the slot) is quarantined; the slot is not offered until slice.unquarantine re-runs its failed check. Evidence names the quarantine."
    COMPONENT_IN_USE = "component_in_use", "fleet", "An allocation's lease holds the component: it is neither quarantined by an operator nor returned while held. Release that allocation first."
    NOT_QUARANTINED = "not_quarantined", "fleet", "The component named is not quarantined on this host (evidence lists what is); check the kind and identity."
    QUARANTINE_REFUSED = "quarantine_refused", "fleet", "A quarantine or unquarantine was refused; the message and evidence say why."
    RECHECK_FAILED = "recheck_failed", "fleet", "The check that quarantined the component still fails (evidence has its verdict); it stays quarantined. Repair or replace it, then ask again."
    RECHECK_UNAVAILABLE = "recheck_unavailable", "fleet", "This agent has no re-check for the quarantine's reason, so it cannot prove the component fit; it stays quarantined (evidence lists the re-checks it has)."
    UNKNOWN_COMPONENT = "unknown_component", "fleet", "The component named is not a GPU, NVMe namespace or fabric VF of this host, nor one of its slots; check the identity (discovery lists them)."
    SMART_LOG_UNREADABLE = "smart_log_unreadable", "fleet", "nvme smart-log failed or printed no JSON object for the disk; check nvme-cli and the device (evidence has the command)."

    # --- Operator: status and health
    DAEMON_STATUS_UNREADABLE = "daemon_status_unreadable", "operator", "The daemon status file cannot be read; check the daemon runs and the path."
    DAEMON_STATUS_INVALID = "daemon_status_invalid", "operator", "The daemon status file is not a status file; restart the daemon."
    BMC_CREDENTIALS_INVALID = "bmc_credentials_invalid", "operator", "The BMC credentials file is not JSON {\"username\", \"password\"}; rewrite it (0600); the BMC was not contacted."
    FM_FAILED = "fm_failed", "host_fabric", "A Fabric Manager call failed; the evidence has fmpm's argv and output."
    FM_UNAVAILABLE = "fm_unavailable", "host_fabric", "Fabric Manager did not answer (fmpm missing, FM not running or unreachable, or fmpm timed out); start nvidia-fabricmanager and check [slice.fabric_manager]."
    FM_REFUSED = "fm_refused", "host_fabric", "Fabric Manager refused the call (evidence: fm_return, e.g. FM_ST_IN_USE, FM_ST_NVLINK_ERROR); check FM's log and the partition's GPUs."
    FM_OUTPUT_INVALID = "fm_output_invalid", "host_fabric", "fmpm -l printed something that is not a partition list; check the fmpm version against docs/hgx.md."
    FM_ACTIVATION_UNVERIFIED = "fm_activation_unverified", "host_fabric", "fmpm reported an activation but FM does not list the partition active (FM restarted?); the provision is compensated."
    FM_DEACTIVATION_UNVERIFIED = "fm_deactivation_unverified", "host_fabric", "fmpm reported a deactivation but FM still lists the partition active; deactivate it by hand (fmpm -d) and release again."
    FM_RESTORE_UNVERIFIED = "fm_restore_unverified", "host_fabric", "After --set-activated-list FM does not list the leased partitions active (FM not in resiliency mode, or fmpm 1.0.1's list bug); restore them by hand."
    FABRIC_PARTITION_UNSUPPORTED = "fabric_partition_unsupported", "host_fabric", "The slot set is not exactly one supported Fabric Manager partition; choose a set from the evidence's supported list. Nothing was leased."
    FABRIC_PARTITION_UNHEALTHY = "fabric_partition_unhealthy", "host_fabric", "The set's partition has a GPU with NVLinks down; quarantine that GPU or sell a smaller set. Nothing was leased."
    FABRIC_PARTITION_IN_USE = "fabric_partition_in_use", "host_fabric", "The set's partition shares GPUs with an active partition; release that allocation first. Nothing was leased."
    FABRIC_PARTITION_CHANGED = "fabric_partition_changed", "host_fabric", "Fabric Manager's partition no longer holds the GPUs planned for the allocation (FM reconfigured); plan again."
    FABRIC_ATTACHMENT_MISSING = "fabric_attachment_missing", "host_fabric_vf", "fabric_isolation is required and the provision of a profile passing a fabric VF through carries no fabric_attachment; the control plane sends the VLAN or partition key (docs/contract.md). Nothing was leased."
    FABRIC_ATTACHMENT_KIND_MISMATCH = "fabric_attachment_kind_mismatch", "host_fabric_vf", "The attachment is Ethernet for an InfiniBand PF (or the reverse); send the attachment of the slot's fabric. Nothing was leased."
    FABRIC_PF_CANNOT_APPLY = "fabric_pf_cannot_apply", "host_fabric_vf", "fabric_isolation is required and a slot's PF cannot apply the attachment (no netdev, the VF not reported over netlink, eswitch not legacy); fix the PF, or declare fabric_isolation = dpu_enforced where the DPU enforces it. Nothing was leased."
    FABRIC_VF_MISSING = "fabric_vf_missing", "host_fabric_vf", "The PF netdev does not exist or does not report the slot's VF over netlink; check sriov_numvfs and the PF's driver."
    FABRIC_VF_UNSUPPORTED = "fabric_vf_unsupported", "host_fabric_vf", "The PF's driver refused a VF setting (EOPNOTSUPP/EINVAL: no VF ops, or switchdev mode); see the evidence's errno."
    FABRIC_VF_MISMATCH = "fabric_vf_mismatch", "host_fabric_vf", "The kernel took the VF settings but reads back other values; the domain is not started (provision) or the slot is cleanup_blocked and the VF quarantined (release)."
    FABRIC_VF_FAILED = "fabric_vf_failed", "host_fabric_vf", "A netlink request on the PF failed; the evidence has the errno."
    FABRIC_MANAGER_MISSING = "fabric_manager_missing", "guards", "A fabric_partitions profile on an NVSwitch host and Fabric Manager did not answer; start nvidia-fabricmanager and configure [slice.fabric_manager]. Nothing was leased."
    PARTITION_LEASED = "partition_leased", "state", "The Fabric Manager partition is held by another allocation on this host; release it first."
    NVML_FIXTURE_INVALID = "nvml_fixture_invalid", "operator", "The NVML fixture is invalid; re-record it."
    NVML_FIXTURE_UNREADABLE = "nvml_fixture_unreadable", "operator", "The NVML fixture cannot be read; check the path."


def render() -> str:
    """docs/error-codes.md: one table per room, in the enum's order."""
    out = ["# Error codes", "",
           "<!-- generated by `python -m gpuaas_agent.contract.errorcodes`; edit gpuaas_agent/contract/errorcodes.py -->",
           "",
           "Every refusal the agent reports carries one of these stable `code`s (in `AgentError`, discovery",
           "findings, task results and journal details), with a one-line `message` and `evidence`. The codes",
           "never change; scripts and runbooks key on them. Exit classes of the CLI: see `gpuaas_agent/exitcodes.py`.",
           "Codes marked *control plane* are sent by the control plane and relayed by the agent.", ""]
    for room, title in ROOMS.items():
        members = [m for m in ErrorCode if m.room == room]
        if not members:
            continue
        out += [f"## {title}", "", "| code | meaning and operator action |", "|---|---|"]
        out += [f"| `{m.value}` | {m.meaning}{' *(control plane)*' if m.control_plane else ''} |" for m in members]
        out.append("")
    return "\n".join(out)


def missing_lines(root: Path | None = None) -> list[str]:
    """Ready-to-paste enum lines for codes the package emits that are not members (after a merge)."""
    known = {m.value for m in ErrorCode} | set(TEMPLATES)
    places: dict[str, list[str]] = {}
    for site in scan(root or PACKAGE_ROOT):
        if site.code not in known:
            places.setdefault(site.code, []).append(f"{site.path}:{site.line}")
    lines = []
    for code, where in sorted(places.items()):
        if TEMPLATE_HOLE in code:
            lines.append(f"    # TODO template {code!r}: add it to TEMPLATES with every code it can produce, and those "
                         f"codes as members  # {', '.join(where[:3])}")
        else:
            lines.append(f'    {code.upper()} = "{code}", "unsorted", "TODO: what happened; what the operator does."'
                         f"  # {', '.join(where[:3])}")
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m gpuaas_agent.contract.errorcodes", description=__doc__.splitlines()[0])
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--check", action="store_true", help="exit 1 when docs/error-codes.md is stale")
    mode.add_argument("--missing", action="store_true", help="print enum lines for emitted codes that are not members")
    args = parser.parse_args(argv)
    if args.missing:
        lines = missing_lines()
        print("\n".join(lines) if lines else "# every emitted code is a member of ErrorCode")
        return 1 if lines else 0
    text = render()
    if args.check:
        current = DOC.read_text(encoding="utf-8") if DOC.exists() else ""
        if current != text:
            print(f"{DOC} is stale: run python -m gpuaas_agent.contract.errorcodes", file=sys.stderr)
            return 1
        return 0
    DOC.write_text(text, encoding="utf-8")
    print(f"wrote {DOC} ({len(ErrorCode)} codes)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
