"""Cloud-init seed ISO: built from typed inputs, read back with pycdlib (and isoinfo, blkid,
cloud-init itself when installed), byte-identical for identical inputs, and nothing written
for an input that does not validate."""

from __future__ import annotations

import asyncio
import base64
import functools
import hashlib
import io
import os
import shutil
import time
from pathlib import Path
from typing import Any

import pycdlib
import pytest
import yaml
from pydantic import ValidationError

from gpuaas_agent.contract.cloudinit import GuestDriverProfile, SeedIso, SeedSpec
from gpuaas_agent.errors import HostError
from gpuaas_agent.host.run import run
from gpuaas_agent.host.vm.cloudinit import SEED_ISO_EPOCH, build_seed_iso, render_seed_files, write_seed_iso

# Real keys made by ssh-keygen (public halves only).
ED25519 = "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIIG81KbW458JUOjDcJx4OcOIor8JRkPZz7IlijLFZsgC tenant@laptop"
RSA3072 = (
    "ssh-rsa AAAAB3NzaC1yc2EAAAADAQABAAABgQCtd2sThq8ENnZOQgqML6OMsoxF2jz2haHeKIPZJHADTDTqhUmEGcjELpsGm0WN"
    "HlNhDNKPiQs117fLakHOaf69wv4FSGKPJ63DEDcgeQzA1v52hyrDg98Hj24+FF3TBEoifjEHWKEai4sQ6WTaSpsixtBAnX7tQJhJ"
    "9WiLgns+v2EG/L2A5ta1BmWlYQUourqw6KDxwhZg7QL3CQa7VW3HsHoNqNo/IL5xhobSuR8RIbFb/OhdusaQ+w2vOg7gWk5jT9rv"
    "12hGUMljh+Tc8Dxk8SwnLMDcNxzURuzQ+unfb/0uwpvpSDhz9/4EJpdVXSpy5JE5EwxiEi+5H1BZzC51w/YDYlUuL7RPGALoFGeK"
    "JdiQbf4cvRYXjR5numFbSwarInmePu8PuqZfeCZ3EXq3YW0MN0V2fXV4VIkxjtqjpViZevAZzUVeYxYXNSjBITgKaGG+phvrXZaL"
    "4sg/XY8Yb75+GRkD/cqVPhRo19ohsPgmTTr3ctnOfFTngglEWb0= tenant@laptop"
)
RSA1024 = (
    "ssh-rsa AAAAB3NzaC1yc2EAAAADAQABAAAAgQDEi1F8lZfYSL2TfBBBnTaq6g2ePHcw9Wfwnp5X0rsw2f4beVsg57uPGhP4EKEq"
    "6Yef6E+4hsqHasbZ8w/9HwAleyydseNhd9UJUbWnonjydTN9Y2ue/hgyHKp8IXAUkvvKyqr5wTQtyE59skkSAflBZ4fWY6Gx1kxC"
    "hOcAclr/qw== tenant@laptop"
)
ECDSA256 = (
    "ecdsa-sha2-nistp256 AAAAE2VjZHNhLXNoYTItbmlzdHAyNTYAAAAIbmlzdHAyNTYAAABBBI0OEwKL1bUMyEtV94Z3d7KgyKlq"
    "zpQ7CUOcqWNL/bE+GizK5KUYE/1GuJPb51UgTOUy8u1FDaGSJP8bykjdI0c="
)
ECDSA384 = (
    "ecdsa-sha2-nistp384 AAAAE2VjZHNhLXNoYTItbmlzdHAzODQAAAAIbmlzdHAzODQAAABhBMf+ZT2ebCYHMywEjQm+okn6Ma+Z"
    "EEHYgXSD32hkrbr3O9kjY8VKSuR62f7trf+poGM1wGTe5hLyuuo59RACO8bDHeyAjP/ll+tNHTE2I6VGz0IUv3aykx+WB+rdBCrX"
    "lQ== tenant@laptop"
)
ECDSA521 = (
    "ecdsa-sha2-nistp521 AAAAE2VjZHNhLXNoYTItbmlzdHA1MjEAAAAIbmlzdHA1MjEAAACFBABq4ywkRD7iJqnNTaZc7Ok2NQ6s"
    "UTHGGRlg+nNh4d/cUn8IMAxY+/JQWOYAhjpuXc6SzcpOv+iykFWbDjWXCwnMNwAd1LM5IDftAZHjA7CZ5Ef8QqxPzcplGv7+Z2+B"
    "k7akjCXJQjAzZVC3LlqtAj3m5+wNN8ccVt7WQ9wqIxi9kxWR2Q== tenant@laptop"
)
RELAY = "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIDycr+WYP28NHqowyYs7Wg4kv6keU8P+K/OQKQiKOkbf gpuaas-terminal@j22u05"

ALLOCATION = "158ea147-0115-407f-bbd5-1850c32b9517"
MAC = "52:54:00:12:34:56"  # all digits: YAML 1.1 would read it as a base-60 integer unless quoted


def _ssh_string(data: bytes) -> bytes:
    return len(data).to_bytes(4, "big") + data


def _key(prefix: str, *fields: bytes, comment: str = "") -> str:
    """An authorized_keys line whose key data is the given SSH-encoded fields."""
    line = f"{prefix} {base64.b64encode(b''.join(_ssh_string(f) for f in fields)).decode()}"
    return f"{line} {comment}" if comment else line


def _blob(line: str) -> bytes:
    return base64.b64decode(line.split(" ")[1])


# No FIDO token here: the security-key layout (type, 32-byte point, application) built by hand.
SK_ED25519 = _key(
    "sk-ssh-ed25519@openssh.com", b"sk-ssh-ed25519@openssh.com", bytes(range(32)), b"ssh:", comment="yubikey"
)


def _raw(**changes: Any) -> dict[str, Any]:
    raw: dict[str, Any] = {
        "instance_id": ALLOCATION,
        "hostname": "slice-158ea147",
        "user": {
            "name": "u_adda9308def04a2f",
            "sudo": "nopasswd_all",
            "shell": "/bin/bash",
            "ssh_authorized_keys": [ED25519, RSA3072, ECDSA256, ECDSA384, ECDSA521, SK_ED25519],
        },
        "terminal_relay_key": RELAY,
        "network": {
            "mac": MAC,
            "address": "10.100.0.10/24",
            "gateway": "10.100.0.1",
            "nameservers": ["10.100.0.1"],
        },
        "guest_driver_profile": None,
    }
    for dotted, value in changes.items():
        *parents, leaf = dotted.split("__")
        node = raw
        for part in parents:
            node = node[part]
        node[leaf] = value
    return raw


def _spec(**changes: Any) -> SeedSpec:
    return SeedSpec.model_validate(_raw(**changes))


def _write(spec: SeedSpec, dest: Path) -> SeedIso:
    return asyncio.run(write_seed_iso(spec, dest))


def _read_back(path: Path) -> dict[str, Any]:
    """Open the ISO with pycdlib: label, and each file by its ISO 9660, Joliet and Rock Ridge name."""
    iso = pycdlib.PyCdlib()
    iso.open(str(path))
    try:
        result: dict[str, Any] = {
            "label": iso.pvd.volume_identifier.decode().rstrip(),
            "has_joliet": iso.has_joliet(),
            "has_rock_ridge": iso.has_rock_ridge(),
            "rr_names": sorted(c.rock_ridge.name().decode() for c in iso.list_children(rr_path="/") if c.is_file()),
            "iso_names": sorted(c.file_identifier().decode() for c in iso.list_children(iso_path="/") if c.is_file()),
            "files": {},
        }
        for name in result["rr_names"]:
            by_rr, by_joliet = io.BytesIO(), io.BytesIO()
            iso.get_file_from_iso_fp(by_rr, rr_path="/" + name)
            iso.get_file_from_iso_fp(by_joliet, joliet_path="/" + name)
            assert by_rr.getvalue() == by_joliet.getvalue()
            result["files"][name] = by_rr.getvalue()
        result["pvd_created"] = iso.pvd.volume_creation_date.date_str[:14].decode()
    finally:
        iso.close()
    return result


@pytest.fixture
def seed(tmp_path):
    """A seed with every key type and the driver profile, written and read back."""
    dest = tmp_path / "seed.iso"
    record = _write(_spec(guest_driver_profile="nvidia-570-server-rdma"), dest)
    return dest, record, _read_back(dest)


# --- what is in the ISO ----------------------------------------------------------------------


def test_seed_iso_is_labelled_cidata_and_holds_the_three_files_under_long_names(seed):
    _, _, back = seed
    assert back["label"] == "cidata"
    assert back["has_joliet"] and back["has_rock_ridge"]
    assert back["rr_names"] == ["meta-data", "network-config", "user-data"]
    assert back["iso_names"] == ["META_DATA.;1", "NETWORK_CONFIG.;1", "USER_DATA.;1"]


def test_user_data_is_cloud_config_with_one_locked_user_the_tenant_keys_and_the_relay_key(tmp_path):
    dest = tmp_path / "seed.iso"
    _write(_spec(), dest)
    user_data = _read_back(dest)["files"]["user-data"]
    assert user_data.startswith(b"#cloud-config\n")
    assert yaml.safe_load(user_data) == {
        "hostname": "slice-158ea147",
        "preserve_hostname": False,
        "manage_etc_hosts": True,
        "users": [
            {
                "name": "u_adda9308def04a2f",
                "shell": "/bin/bash",
                "lock_passwd": True,
                "sudo": "ALL=(ALL) NOPASSWD:ALL",
                "ssh_authorized_keys": [ED25519, RSA3072, ECDSA256, ECDSA384, ECDSA521, SK_ED25519, RELAY],
            }
        ],
        "disable_root": True,
        "ssh_pwauth": False,
    }


def test_meta_data_names_the_allocation_as_instance_id(seed):
    _, _, back = seed
    assert yaml.safe_load(back["files"]["meta-data"]) == {
        "instance-id": ALLOCATION,
        "local-hostname": "slice-158ea147",
    }


def test_network_config_matches_the_nic_by_mac_with_static_address(seed):
    _, _, back = seed
    assert yaml.safe_load(back["files"]["network-config"]) == {
        "version": 2,
        "ethernets": {
            "slice0": {
                "match": {"macaddress": MAC},
                "dhcp4": False,
                "addresses": ["10.100.0.10/24"],
                "routes": [{"to": "0.0.0.0/0", "via": "10.100.0.1"}],
                "nameservers": {"addresses": ["10.100.0.1"]},
            }
        },
    }


def test_dhcp4_addressing_keeps_the_mac_match_and_no_static_fields():
    files = render_seed_files(_spec(network__addressing="dhcp4"))
    assert yaml.safe_load(files["network-config"]) == {
        "version": 2,
        "ethernets": {"slice0": {"match": {"macaddress": MAC}, "dhcp4": True}},
    }


def test_driver_profile_installs_nvidia_and_rdma_packages_then_reboots(seed):
    _, _, back = seed
    user_data = yaml.safe_load(back["files"]["user-data"])
    assert user_data["package_update"] is True
    assert user_data["packages"] == ["rdma-core", "ibverbs-utils", "infiniband-diags"]
    headers, driver = user_data["runcmd"]
    assert headers[:2] == ["sh", "-c"] and '"linux-headers-$(uname -r)"' in headers[2]
    assert '"linux-modules-extra-$(uname -r)"' in headers[2]
    assert driver[-2:] == ["nvidia-driver-570-server", "nvidia-utils-570-server"]
    assert user_data["power_state"]["mode"] == "reboot" and user_data["power_state"]["condition"] is True
    assert b"&id" not in back["files"]["user-data"]  # plain YAML: no anchors or aliases
    # The libvirt room must refuse Secure Boot for such a VM (DKMS modules are unsigned).
    assert GuestDriverProfile("nvidia-570-server-rdma").requires_secure_boot_off


def test_without_driver_profile_nothing_is_installed_and_nothing_reboots():
    user_data = yaml.safe_load(render_seed_files(_spec())["user-data"])
    assert not {"packages", "package_update", "runcmd", "power_state"} & user_data.keys()


def test_sudo_none_writes_no_sudo_rule_and_sh_shell_is_kept():
    user = yaml.safe_load(render_seed_files(_spec(user__sudo="none", user__shell="/bin/sh"))["user-data"])["users"][0]
    assert "sudo" not in user and user["shell"] == "/bin/sh"


def test_relay_key_also_given_by_the_tenant_is_listed_once():
    relay_other_comment = RELAY.rsplit(" ", 1)[0] + " copied-by-tenant"
    keys = yaml.safe_load(render_seed_files(_spec(user__ssh_authorized_keys=[relay_other_comment]))["user-data"])[
        "users"
    ][0]["ssh_authorized_keys"]
    assert keys == [relay_other_comment]


def test_tenant_may_give_no_key_and_still_gets_the_relay_key():
    keys = yaml.safe_load(render_seed_files(_spec(user__ssh_authorized_keys=[]))["user-data"])["users"][0][
        "ssh_authorized_keys"
    ]
    assert keys == [RELAY]


def test_yaml_special_characters_in_a_comment_survive_as_plain_text():
    tricky = ED25519.rsplit(" ", 1)[0] + " a: b # not-a-comment ' \" {x} [y] &z *w !tag %p @q `r"
    keys = yaml.safe_load(render_seed_files(_spec(user__ssh_authorized_keys=[tricky]))["user-data"])["users"][0][
        "ssh_authorized_keys"
    ]
    assert keys[0] == tricky


def test_record_matches_what_was_written(seed):
    dest, record, back = seed
    data = dest.read_bytes()
    assert record.path == str(dest) and record.volume_label == "cidata"
    assert record.size == len(data) and record.sha256 == hashlib.sha256(data).hexdigest()
    assert [f.name for f in record.files] == ["meta-data", "network-config", "user-data"]
    for f in record.files:
        assert f.size == len(back["files"][f.name]) and f.sha256 == hashlib.sha256(back["files"][f.name]).hexdigest()
    assert SeedIso.model_validate_json(record.model_dump_json()) == record
    assert oct(dest.stat().st_mode & 0o777) == "0o644"


# --- reproducible and atomic --------------------------------------------------------------------


def test_same_inputs_give_a_byte_identical_iso_whatever_the_clock_and_timezone(tmp_path, monkeypatch):
    first = _write(_spec(guest_driver_profile="nvidia-570-server-rdma"), tmp_path / "a.iso")
    monkeypatch.setenv("TZ", "Asia/Kolkata")  # +05:30: a local-time date would differ in every field
    time.tzset()
    try:
        time.sleep(1.1)  # a "now" date would differ by a second
        second = _write(_spec(guest_driver_profile="nvidia-570-server-rdma"), tmp_path / "b.iso")
    finally:
        monkeypatch.delenv("TZ")
        time.tzset()
    assert (tmp_path / "a.iso").read_bytes() == (tmp_path / "b.iso").read_bytes()
    assert first.sha256 == second.sha256
    assert _read_back(tmp_path / "a.iso")["pvd_created"] == time.strftime("%Y%m%d%H%M%S", time.gmtime(SEED_ISO_EPOCH))


def test_different_inputs_give_different_isos():
    base = build_seed_iso(render_seed_files(_spec()))
    assert build_seed_iso(render_seed_files(_spec(hostname="slice-other"))) != base


def test_rewriting_replaces_the_file_and_leaves_no_temporary_behind(tmp_path):
    dest = tmp_path / "seed.iso"
    _write(_spec(hostname="first"), dest)
    record = _write(_spec(hostname="second"), dest)
    assert os.listdir(tmp_path) == ["seed.iso"]
    assert yaml.safe_load(_read_back(dest)["files"]["meta-data"])["local-hostname"] == "second"
    assert record.sha256 == hashlib.sha256(dest.read_bytes()).hexdigest()


def test_missing_destination_directory_is_a_host_error_and_nothing_is_created(tmp_path):
    with pytest.raises(HostError) as err:
        _write(_spec(), tmp_path / "absent" / "seed.iso")
    assert err.value.code == "seed_iso_write_failed"
    assert os.listdir(tmp_path) == []


def test_relative_destination_is_refused(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(HostError):
        _write(_spec(), Path("seed.iso"))
    assert os.listdir(tmp_path) == []


def test_a_spec_built_without_validation_is_validated_again_before_writing(tmp_path):
    forged = SeedSpec.model_construct(**{**_spec().__dict__, "hostname": "evil\nhost"})
    with pytest.raises(ValidationError, match="hostname"):
        _write(forged, tmp_path / "seed.iso")
    assert os.listdir(tmp_path) == []


# --- refusals: each before any file exists ---------------------------------------------------

_ED25519_BLOB = _blob(ED25519)
_ECDSA384_BLOB = _blob(ECDSA384)

REFUSED = {
    # keys
    "key with junk base64": ("user__ssh_authorized_keys", ["ssh-ed25519 AAAA!!!!junk== me"], "not base64"),
    "key with bad padding": ("user__ssh_authorized_keys", ["ssh-ed25519 AAAAC3NzaC1lZDI1NTE5A"], "base64"),
    "key data not canonical base64": (
        "user__ssh_authorized_keys",
        [ECDSA256[:-2] + "d="],  # same bytes, but the unused low bits of the last character are set
        "not canonical",
    ),
    "key data cut short": ("user__ssh_authorized_keys", ["ssh-ed25519 AAAAC3NzaC1lZDI1NTE5"], "ends before"),
    "rsa prefix on an ed25519 key": (
        "user__ssh_authorized_keys",
        ["ssh-rsa " + ED25519.split(" ", 1)[1]],
        "prefix says 'ssh-rsa'",
    ),
    "nistp256 prefix on a nistp384 key": (
        "user__ssh_authorized_keys",
        ["ecdsa-sha2-nistp256 " + base64.b64encode(_ECDSA384_BLOB).decode()],
        "prefix says",
    ),
    "newline injects a second key": (
        "user__ssh_authorized_keys",
        [ED25519 + "\nssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIDycr+WYP28NHqowyYs7Wg4kv6keU8P+K/OQKQiKOkbf attacker"],
        "single line",
    ),
    "trailing newline": ("user__ssh_authorized_keys", [ED25519 + "\n"], "single line"),
    "carriage return in comment": ("user__ssh_authorized_keys", [ED25519 + "\rx"], "single line"),
    "key options prefix": (
        "user__ssh_authorized_keys",
        ['command="/bin/sh" ' + ED25519],
        "no key options",
    ),
    "bytes after the key": (
        "user__ssh_authorized_keys",
        ["ssh-ed25519 " + base64.b64encode(_ED25519_BLOB + b"\0").decode()],
        "unexpected bytes",
    ),
    "ed25519 point of the wrong size": (
        "user__ssh_authorized_keys",
        [_key("ssh-ed25519", b"ssh-ed25519", bytes(31))],
        "32 bytes",
    ),
    "weak rsa key": ("user__ssh_authorized_keys", [RSA1024], "1024 bits"),
    "tab in comment": ("user__ssh_authorized_keys", [ED25519 + "\tx"], "printable ASCII"),
    "unicode line separator in comment": ("user__ssh_authorized_keys", [ED25519 + "\u2028x"], "printable ASCII"),
    "unknown key type": ("user__ssh_authorized_keys", ["ssh-dss AAAAB3NzaC1kc3MAAACBAP"], "type must be one of"),
    "relay key that is not ed25519": ("terminal_relay_key", RSA3072, "ssh-ed25519"),
    "relay key with junk": ("terminal_relay_key", "ssh-ed25519 AAAA!!!!", "not base64"),
    # hostname
    "hostname with underscore and capitals": ("hostname", "Slice_1", "one DNS label"),
    "hostname with a dot": ("hostname", "slice.example.com", "one DNS label"),
    "hostname starting with a hyphen": ("hostname", "-slice", "one DNS label"),
    "hostname ending with a hyphen": ("hostname", "slice-", "one DNS label"),
    "hostname of 64 characters": ("hostname", "a" * 64, "one DNS label"),
    "hostname with a newline": ("hostname", "slice\nruncmd: x", "one DNS label"),
    "hostname all digits": ("hostname", "12345", "all digits"),
    "empty hostname": ("hostname", "", "one DNS label"),
    # user
    "user root": ("user__name", "root", "system account"),
    "user sudo (a group)": ("user__name", "sudo", "system account"),
    "user with a semicolon": ("user__name", "bob;rm", "portable Linux user name"),
    "user with capitals": ("user__name", "Bob", "portable Linux user name"),
    "user of 33 characters": ("user__name", "u" * 33, "portable Linux user name"),
    "user shell not known": ("user__shell", "/usr/bin/fish", "/bin/bash"),
    "sudo policy as free text": ("user__sudo", "ALL=(ALL) ALL", "nopasswd_all"),
    # driver profile
    "unknown driver profile": ("guest_driver_profile", "nvidia-999-magic", "nvidia-570-server-rdma"),
    "driver profile as a package name": ("guest_driver_profile", "nvidia-driver-570-server", "nvidia-570-server-rdma"),
    # network
    "mac too short": ("network__mac", "52:54:00:12:34", "pattern"),
    "mac with dashes": ("network__mac", "52-54-00-12-34-56", "pattern"),
    "mac with non-hex": ("network__mac", "52:54:00:12:34:zz", "pattern"),
    "mac in capitals": ("network__mac", "52:54:00:AB:CD:EF", "pattern"),
    "mac with a newline": ("network__mac", MAC + "\n", "pattern"),
    "multicast mac": ("network__mac", "01:00:5e:00:00:01", "multicast"),
    "gateway outside the subnet": ("network__gateway", "10.200.0.1", "not a host address"),
    "address is the network address": ("network__address", "10.100.0.0/24", "network or broadcast"),
    "host route only": ("network__address", "10.100.0.10/32", "no room for a gateway"),
    "gateway is the vm itself": ("network__gateway", "10.100.0.10", "own address"),
    "no nameserver": ("network__nameservers", [], "at least 1"),
    "address is not an ip": ("network__address", "10.100.0.300/24", "IPv4"),
    "addressing as free text": ("network__addressing", "slaac", "static"),
    # the rest
    "instance id not a uuid": ("instance_id", "158ea147; rm -rf /", "UUID"),
    "unknown field": ("user__password", "hunter2", "Extra inputs are not permitted"),
}


@pytest.mark.parametrize("case", sorted(REFUSED), ids=sorted(REFUSED))
def test_invalid_input_is_refused_before_any_file_is_written(case, tmp_path):
    field, value, message = REFUSED[case]
    dest = tmp_path / "seed.iso"
    with pytest.raises(ValidationError) as err:
        _write(SeedSpec.model_validate(_raw(**{field: value})), dest)
    assert message in str(err.value)
    assert os.listdir(tmp_path) == []


def test_every_supported_key_type_is_accepted():
    spec = _spec()
    assert [k.split(" ")[0] for k in spec.user.ssh_authorized_keys] == [
        "ssh-ed25519",
        "ssh-rsa",
        "ecdsa-sha2-nistp256",
        "ecdsa-sha2-nistp384",
        "ecdsa-sha2-nistp521",
        "sk-ssh-ed25519@openssh.com",
    ]


# --- real tools, when installed -----------------------------------------------------------------


def _needs(tool: str):
    """The tool must be there (scripts/apt-packages.txt installs it): a missing one fails, never skips."""

    def decorate(test):
        @functools.wraps(test)
        def wrapper(*args, **kwargs):
            if shutil.which(tool) is None:
                pytest.fail(f"{tool} is not installed; scripts/apt-packages.txt must provide it")
            return test(*args, **kwargs)

        return wrapper

    return decorate


@_needs("ssh-keygen")
@pytest.mark.parametrize(
    "key_type", [["ed25519"], ["rsa", "-b", "2048"], ["ecdsa", "-b", "256"], ["ecdsa", "-b", "521"]], ids=str
)
def test_keys_fresh_from_ssh_keygen_are_accepted(tmp_path, key_type):
    key = tmp_path / "id"
    argv = ["ssh-keygen", "-q", "-t", *key_type, "-N", "", "-C", "someone@somewhere", "-f", str(key)]
    asyncio.run(run(argv, timeout=30))
    line = key.with_suffix(".pub").read_text().strip()
    assert line in _spec(user__ssh_authorized_keys=[line]).user.ssh_authorized_keys


@_needs("isoinfo")
def test_isoinfo_sees_volume_cidata_with_joliet_and_rock_ridge(seed):
    dest, _, back = seed
    info = asyncio.run(run(["isoinfo", "-d", "-i", str(dest)], timeout=30)).stdout.decode()
    assert "Volume id: cidata" in info.splitlines()
    assert "Joliet with UCS level 3 found" in info and "Rock Ridge signatures version 1 found" in info
    extracted = asyncio.run(run(["isoinfo", "-J", "-i", str(dest), "-x", "/user-data"], timeout=30)).stdout
    assert extracted == back["files"]["user-data"]


@_needs("blkid")
def test_blkid_probes_label_cidata(seed):
    dest, _, _ = seed
    done = asyncio.run(run(["blkid", "-p", "-o", "export", str(dest)], timeout=30))
    tags = dict(line.split("=", 1) for line in done.stdout.decode().splitlines() if "=" in line)
    assert tags["TYPE"] == "iso9660" and tags["LABEL"] == "cidata"


@_needs("cloud-init")
def test_cloud_init_accepts_the_user_data(seed, tmp_path):
    _, _, back = seed
    (tmp_path / "user-data").write_bytes(back["files"]["user-data"])
    done = asyncio.run(run(["cloud-init", "schema", "-c", str(tmp_path / "user-data")], timeout=60))
    assert b"Valid cloud-config" in done.stdout


@_needs("cloud-init")
def test_cloud_init_renders_the_network_config_for_the_mac(seed, tmp_path):
    _, _, back = seed
    (tmp_path / "network-config").write_bytes(back["files"]["network-config"])
    out = tmp_path / "rendered"
    asyncio.run(
        run(
            # fmt: off
            [
                "cloud-init",
                "devel",
                "net-convert",
                "-p",
                str(tmp_path / "network-config"),
                "-k",
                "yaml",
                "-d",
                str(out),
                "-D",
                "ubuntu",
                "-O",
                "netplan",
            ],
            # fmt: on
            timeout=60,
        )
    )
    (rendered,) = [p for p in out.rglob("*") if p.is_file()]
    slice0 = yaml.safe_load(rendered.read_text())["network"]["ethernets"]["slice0"]
    assert slice0["match"] == {"macaddress": MAC}
    assert slice0["addresses"] == ["10.100.0.10/24"]
    assert slice0["routes"] == [{"to": "0.0.0.0/0", "via": "10.100.0.1"}]


def test_an_egress_probe_runs_first_in_runcmd_as_argv_with_the_target_as_arguments(tmp_path):
    user_data = yaml.safe_load(render_seed_files(_spec(egress_probe={"ip": "192.0.2.2", "port": 7777}))["user-data"])
    probe = user_data["runcmd"][0]
    assert probe[:2] == ["sh", "-c"] and probe[3:] == ["gpuaas-egress-probe", "192.0.2.2", "7777"]
    assert "192.0.2.2" not in probe[2]  # the target travels as arguments, never spliced into the script
    # The script is valid sh (the lab guest's busybox and the real guests' dash/bash both parse it).
    assert asyncio.run(run(["sh", "-n", "-c", probe[2]], timeout=30)).returncode == 0
    assert probe[2].rstrip().endswith("&")  # backgrounded: a guest without egress still finishes booting
    with pytest.raises(ValidationError):
        _spec(egress_probe={"ip": "192.0.2.2; reboot", "port": 7777})
