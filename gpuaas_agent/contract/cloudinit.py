"""Typed inputs of a slice VM's cloud-init NoCloud seed, and the record of the ISO built from them.

Everything a tenant or the control plane can put into the seed is validated
here, before any file is written: the seed becomes ``authorized_keys``,
``/etc/hostname``, a sudoers line and a netplan file inside the guest, so a
value that is merely "a string" is an injection waiting to happen (a newline in
a key comment is a second authorized key; a ``command="..."`` prefix is a key
option). Imports nothing of ours but the contract base and types.
"""

from __future__ import annotations

import base64
import binascii
import re
from ipaddress import IPv4Address, IPv4Interface
from typing import Annotated, Final, Literal
from uuid import UUID

from pydantic import AfterValidator, Field, Strict, model_validator

from gpuaas_agent.contract.base import WireEnum, WireModel
from gpuaas_agent.contract.egress import EgressTarget
from gpuaas_agent.contract.types import MacAddress, Sha256Hex

SEED_VOLUME_LABEL: Final = "cidata"  # the NoCloud datasource looks for this label (or CIDATA)

# Addresses, UUIDs and tuples are spelled as strings and lists wherever they come from (JSON has
# no other way): these fields take them in Python too, while ints and bools stay strict.
LAX = Strict(False)


# ---------------------------------------------------------------------------
# SSH public keys
# ---------------------------------------------------------------------------

SSH_KEY_LINE_MAX = 8192  # an ssh-rsa 16384-bit key is ~2.8 KB of base64
MAX_SSH_KEYS = 32
SSH_KEY_COMMENT_MAX = 255
RSA_MIN_BITS = 2048  # OpenSSH refuses < 1024; we refuse what no tenant should still use
RSA_MAX_BITS = 16384  # OpenSSH's own upper bound
_ECDSA_POINT_BYTES = {"nistp256": 65, "nistp384": 97, "nistp521": 133}  # 0x04 || X || Y
_KEY_TYPES = (
    "ssh-ed25519",
    "ssh-rsa",
    "ecdsa-sha2-nistp256",
    "ecdsa-sha2-nistp384",
    "ecdsa-sha2-nistp521",
    "sk-ssh-ed25519@openssh.com",
    "sk-ecdsa-sha2-nistp256@openssh.com",
)
_BASE64_RE = re.compile(r"[A-Za-z0-9+/]+={0,2}")
_COMMENT_RE = re.compile(r"[\x20-\x7e]*")  # printable ASCII: no newline, NUL, tab or Unicode line separator


class _Blob:
    """Reader of the SSH wire encoding (RFC 4251 §5): uint32 length + bytes."""

    def __init__(self, data: bytes) -> None:
        self._data = data
        self._pos = 0

    def string(self, what: str) -> bytes:
        if self._pos + 4 > len(self._data):
            raise ValueError(f"ssh public key: key data ends before its {what}")
        length = int.from_bytes(self._data[self._pos : self._pos + 4], "big")
        start = self._pos + 4
        if start + length > len(self._data):
            raise ValueError(f"ssh public key: key data ends inside its {what}")
        self._pos = start + length
        return self._data[start : self._pos]

    def mpint(self, what: str) -> int:
        raw = self.string(what)
        if raw and raw[0] & 0x80:
            raise ValueError(f"ssh public key: negative {what}")
        return int.from_bytes(raw, "big")

    def expect_end(self) -> None:
        if self._pos != len(self._data):
            raise ValueError(f"ssh public key: {len(self._data) - self._pos} unexpected bytes after the key")


def _check_key_blob(key_type: str, blob: bytes) -> None:
    """The decoded key must be a well-formed key of exactly the type its prefix announces."""
    reader = _Blob(blob)
    embedded = reader.string("key type")
    if embedded != key_type.encode():
        raise ValueError(
            f"ssh public key: prefix says {key_type!r} but the key data is {embedded[:64].decode('ascii', 'replace')!r}"
        )
    if key_type in ("ssh-ed25519", "sk-ssh-ed25519@openssh.com"):
        if len(reader.string("ed25519 point")) != 32:
            raise ValueError("ssh public key: an ed25519 key is 32 bytes")
        if key_type.startswith("sk-") and not reader.string("FIDO application"):
            raise ValueError("ssh public key: a security-key key names its FIDO application")
    elif key_type == "ssh-rsa":
        exponent = reader.mpint("RSA exponent")
        bits = reader.mpint("RSA modulus").bit_length()
        if exponent < 3 or exponent % 2 == 0:
            raise ValueError("ssh public key: RSA exponent must be odd and at least 3")
        if not RSA_MIN_BITS <= bits <= RSA_MAX_BITS:
            raise ValueError(f"ssh public key: RSA modulus is {bits} bits; {RSA_MIN_BITS}..{RSA_MAX_BITS} are accepted")
    else:  # ecdsa-sha2-nistpNNN, sk-ecdsa-sha2-nistp256@openssh.com
        curve = key_type.removeprefix("sk-").removeprefix("ecdsa-sha2-").removesuffix("@openssh.com")
        if reader.string("ECDSA curve name") != curve.encode():
            raise ValueError(f"ssh public key: ECDSA curve name does not match {key_type!r}")
        point = reader.string("ECDSA point")
        if len(point) != _ECDSA_POINT_BYTES[curve] or point[0] != 0x04:
            raise ValueError(f"ssh public key: not an uncompressed {curve} point")
        if key_type.startswith("sk-") and not reader.string("FIDO application"):
            raise ValueError("ssh public key: a security-key key names its FIDO application")
    reader.expect_end()


def check_ssh_public_key(line: str) -> str:
    """Accept one ``authorized_keys`` line ``<type> <base64>[ <comment>]`` and nothing else.

    No key options (``command=``, ``from=``...), exactly one space between the
    fields, printable-ASCII comment; the base64 must be canonical and decode to
    a key of the announced type with nothing left over.
    """
    if len(line) > SSH_KEY_LINE_MAX:
        raise ValueError(f"ssh public key: longer than {SSH_KEY_LINE_MAX} characters")
    if any(ch in line for ch in "\r\n\x00"):
        raise ValueError("ssh public key: must be a single line (newline, carriage return or NUL found)")
    key_type, _, rest = line.partition(" ")
    if key_type not in _KEY_TYPES:
        raise ValueError(f"ssh public key: type must be one of {', '.join(_KEY_TYPES)} (no key options)")
    b64, sep, comment = rest.partition(" ")
    if not _BASE64_RE.fullmatch(b64):
        raise ValueError("ssh public key: key data is not base64")
    try:
        blob = base64.b64decode(b64, validate=True)
    except binascii.Error as exc:
        raise ValueError(f"ssh public key: key data is not valid base64 ({exc})") from None
    if base64.b64encode(blob).decode() != b64:
        raise ValueError("ssh public key: key data is not canonical base64")
    if sep and not comment:
        raise ValueError("ssh public key: trailing space without a comment")
    if comment and (
        comment != comment.strip() or len(comment) > SSH_KEY_COMMENT_MAX or not _COMMENT_RE.fullmatch(comment)
    ):
        raise ValueError(
            f"ssh public key: comment must be printable ASCII, at most {SSH_KEY_COMMENT_MAX} characters, "
            "without leading or trailing spaces"
        )
    _check_key_blob(key_type, blob)
    return line


def _check_relay_key(line: str) -> str:
    # The node's terminal relay key is created as /var/lib/gpuaas/terminal/id_ed25519 (seed 004).
    if not line.startswith("ssh-ed25519 "):
        raise ValueError("terminal relay key: must be the node's ssh-ed25519 key")
    return line


SshPublicKey = Annotated[str, AfterValidator(check_ssh_public_key)]
RelayPublicKey = Annotated[str, AfterValidator(check_ssh_public_key), AfterValidator(_check_relay_key)]

# ---------------------------------------------------------------------------
# Host and user names
# ---------------------------------------------------------------------------

_DNS_LABEL_RE = re.compile(r"[a-z0-9](?:[a-z0-9-]{0,61}[a-z0-9])?")
_USER_NAME_RE = re.compile(r"[a-z_][a-z0-9_-]{0,31}")

# Accounts and groups a stock Debian/Ubuntu cloud image already has (base-passwd,
# systemd, cloud-image packages) plus privileged groups: cloud-init would either
# fail (useradd: group exists) or, worse, hand the tenant an existing identity.
RESERVED_USER_NAMES = frozenset(
    """
    root daemon bin sys sync games man lp mail news uucp proxy www-data backup list irc gnats nobody
    nogroup _apt messagebus syslog uuidd tcpdump sshd landscape pollinate lxd tss usbmux fwupd-refresh
    dnsmasq polkitd systemd-network systemd-resolve systemd-timesync systemd-coredump systemd-journal
    systemd-oom ubuntu debian admin adm sudo wheel shadow utmp tty disk kmem dialout fax voice cdrom
    floppy tape audio video render input kvm plugdev netdev staff users operator src sasl dip docker
    libvirt libvirt-qemu lpadmin sambashare ssl-cert crontab ssh _ssh nvidia-persistenced rdma
    """.split()
)


def _check_dns_label(value: str) -> str:
    if not _DNS_LABEL_RE.fullmatch(value):
        raise ValueError("hostname must be one DNS label: 1-63 of a-z, 0-9 and '-', not starting or ending with '-'")
    if value.isdigit():
        raise ValueError("hostname must not be all digits")
    return value


def _check_user_name(value: str) -> str:
    if not _USER_NAME_RE.fullmatch(value):
        raise ValueError("user name must match [a-z_][a-z0-9_-]{0,31} (a portable Linux user name)")
    if value in RESERVED_USER_NAMES:
        raise ValueError(f"user name {value!r} is a system account or group of the guest image")
    return value


Hostname = Annotated[str, AfterValidator(_check_dns_label)]
LinuxUserName = Annotated[str, AfterValidator(_check_user_name)]

# ---------------------------------------------------------------------------
# Models
# ---------------------------------------------------------------------------


class SudoPolicy(WireEnum):
    """What the allocation user may do with sudo (the user has no password: it is locked)."""

    none = "none"
    nopasswd_all = "nopasswd_all"  # "ALL=(ALL) NOPASSWD:ALL": the tenant owns the VM


class LoginShell(WireEnum):
    """Shells every supported guest image ships (a missing shell means no login at all)."""

    bash = "/bin/bash"
    sh = "/bin/sh"


class GuestAddressing(WireEnum):
    """How the guest gets its address.

    ``static`` (default): the slot's address is known before boot, so the guest
    configures it itself and does not depend on dnsmasq having re-read its
    reservations when the VM boots (a guest that asks first gets a pool address
    or nothing, and readiness then waits on the wrong IP). The dnsmasq
    reservation is still written: it keeps the address out of the pool and
    serves firmware/initramfs phases. ``dhcp4``: rely on that reservation.
    """

    static = "static"
    dhcp4 = "dhcp4"


class GuestDriverProfile(WireEnum):
    """Known guest driver installs; the package lists live with the builder (host/vm/cloudinit.py)."""

    nvidia_570_server_rdma = "nvidia-570-server-rdma"

    @property
    def requires_secure_boot_off(self) -> bool:
        # DKMS-built nvidia modules are unsigned: with Secure Boot on, `modprobe nvidia`
        # fails with "Key was rejected by service" (seed 004, allocation 158ea147).
        return True


class GuestUser(WireModel):
    """The allocation user: the only account cloud-init creates (no distro default user)."""

    name: LinuxUserName
    sudo: SudoPolicy = SudoPolicy.nopasswd_all
    shell: LoginShell = LoginShell.bash
    ssh_authorized_keys: Annotated[tuple[SshPublicKey, ...], LAX] = Field(
        default=(), max_length=MAX_SSH_KEYS, description="the tenant's keys")


class GuestNetwork(WireModel):
    """The VM's one management NIC, matched by MAC (network-config v2)."""

    mac: MacAddress
    address: Annotated[IPv4Interface, LAX] = Field(description="private IP with prefix, e.g. 10.100.0.10/24")
    gateway: Annotated[IPv4Address, LAX]
    nameservers: Annotated[tuple[Annotated[IPv4Address, LAX], ...], LAX] = Field(min_length=1, max_length=3)
    addressing: GuestAddressing = GuestAddressing.static

    @model_validator(mode="after")
    def _coherent(self) -> GuestNetwork:
        if int(self.mac[:2], 16) & 1:
            raise ValueError(f"mac {self.mac} is a multicast address; a NIC needs a unicast MAC")
        net = self.address.network
        if not 8 <= net.prefixlen <= 30:
            raise ValueError(f"address prefix /{net.prefixlen} leaves no room for a gateway; use /8../30")
        ends = (net.network_address, net.broadcast_address)
        if self.address.ip in ends:
            raise ValueError(f"address {self.address.ip} is the network or broadcast address of {net}")
        if self.gateway not in net or self.gateway in ends:
            raise ValueError(f"gateway {self.gateway} is not a host address in {net}")
        if self.gateway == self.address.ip:
            raise ValueError(f"gateway {self.gateway} is the VM's own address")
        return self


class SeedSpec(WireModel):
    """Everything the seed ISO of one slice VM is built from."""

    instance_id: Annotated[UUID, LAX] = Field(description="the allocation id; cloud-init runs first-boot modules once per id")
    hostname: Hostname
    user: GuestUser
    terminal_relay_key: RelayPublicKey = Field(
        description="public half of /var/lib/gpuaas/terminal/id_ed25519, added to the user's authorized keys"
    )
    network: GuestNetwork
    guest_driver_profile: GuestDriverProfile | None = None
    # Set when the runtime profile asks readiness to prove egress: first boot connects to it (runcmd).
    egress_probe: EgressTarget | None = None


class SeedFile(WireModel):
    name: Literal["meta-data", "network-config", "user-data"]
    size: int = Field(ge=0)
    sha256: Sha256Hex


class SeedIso(WireModel):
    """What was written: evidence for the journal and for idempotent re-provisioning."""

    path: str
    volume_label: Literal["cidata"] = SEED_VOLUME_LABEL
    size: int = Field(gt=0)
    sha256: Sha256Hex
    files: tuple[SeedFile, ...]
