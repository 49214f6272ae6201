"""cloud-init user-data that brings a freshly deployed MAAS host to an enrolled, running agent (seed 000 step 4).

Typed inputs (:class:`UserDataInputs`) become a ``#cloud-config`` document built
as data and dumped with PyYAML; nothing is string-templated, so a token or URL
with YAML-special characters cannot change the document's shape. Every command
is an argv list (cloud-init runs those without a shell).

The order on the host: write the bootstrap token (0600) and the agent config
into a bootstrap directory, download the package and check its sha256, install
it (``--force-confold`` keeps a config already there), install the config,
then ``gpuaas-agent prepare-host`` with that config (directories and the
terminal relay key a provision needs), then, only on hosts tagged
``gpuaas-profile-slice-vm``, enable and run the network baseline, then enroll
and enable the agent. A bare-metal-intent host (seed 004:
``gpuaas-profile-baremetal``) gets the agent but no slice network.

Fail closed: cloud-init runs ``runcmd`` as one shell script without ``set -e``,
so on its own a failed ``sha256sum --check`` is followed by installing the
package anyway. Every step therefore goes through :data:`STEP_SCRIPT` (written
by ``write_files``): the first failing step records its reason (journal via
``logger -t gpuaas-bootstrap``, stderr into cloud-init-output.log) and every
later step refuses to run.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Any, cast

import yaml
from pydantic import AnyHttpUrl, Field, SecretStr, ValidationError, field_validator, model_validator

from gpuaas_agent.config import ConfigError, parse_config
from gpuaas_agent.contract.base import WireModel
from gpuaas_agent.contract.types import SHA256_PATTERN
from gpuaas_agent.deploy.sliceinputs import IMAGE_CA_PATH, slice_problems, slice_table
from gpuaas_agent.errors import ContractError

SLICE_PROFILE_TAG = "gpuaas-profile-slice-vm"
BOOTSTRAP_DIR = Path("/run/gpuaas-agent-bootstrap")
STATE_DIR = Path("/var/lib/gpuaas-agent")
TOKEN_PATH = STATE_DIR / "bootstrap-token"
BOOTSTRAP_CREDS_PATH = STATE_DIR / "bootstrap.creds"  # the shared enrollment login (operator-mode servers)
CONFIG_PATH = Path("/etc/gpuaas-agent/agent.toml")
DEB_PATH = Path("/var/cache/gpuaas-agent/gpuaas-agent.deb")
AGENT = "/usr/bin/gpuaas-agent"
STEP_PATH = BOOTSTRAP_DIR / "step"
FAILED_PATH = BOOTSTRAP_DIR / "failed"
LOG_TAG = "gpuaas-bootstrap"
CREDS_MARKERS = ("-----BEGIN NATS USER JWT-----", "-----BEGIN USER NKEY SEED-----")

# Constant text (nothing of the inputs is interpolated): data reaches it only as argv of a runcmd entry.
STEP_SCRIPT = f"""#!/bin/sh
# One step of the gpuaas bootstrap (gpuaas-agent cloud-init render). Every runcmd entry runs
#   sh {STEP_PATH} NAME COMMAND [ARG...]
# cloud-init runs runcmd as one shell script without `set -e`: on its own, a failed step is followed
# by the next one (a package whose digest is wrong installed anyway). Here the first failure records
# its reason in {FAILED_PATH}, in the journal (logger -t {LOG_TAG}) and on stderr
# (/var/log/cloud-init-output.log), and every later step refuses to run.
# To retry once the cause is fixed: rm {FAILED_PATH}, then run cloud-init's runcmd script again.
set -eu
failed={FAILED_PATH}
err={BOOTSTRAP_DIR}/step.stderr
step="$1"
shift
say() {{
    printf '{LOG_TAG}: %s\\n' "$2" >&2
    logger -t {LOG_TAG} -p "user.$1" -- "$2" 2>/dev/null || true
}}
if [ -e "$failed" ]; then
    say err "step $step not run: an earlier step failed: $(cat "$failed")"
    exit 1
fi
rc=0
"$@" 2>"$err" || rc=$?
cat "$err" >&2
if [ "$rc" -ne 0 ]; then
    why="$(tail -n 3 "$err" | tr '\\n' ' ')"
    printf 'step %s failed (exit %s): %s\\n' "$step" "$rc" "$why" > "$failed"
    say err "step $step failed (exit $rc): $why"
    exit "$rc"
fi
say info "step $step ok"
"""

Sha256 = Annotated[str, Field(pattern=SHA256_PATTERN)]
MaasTag = Annotated[str, Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,255}$")]


class UserDataInputs(WireModel):
    """What the control plane knows about one host at deploy time."""

    package_url: AnyHttpUrl
    package_sha256: Sha256
    bootstrap_token: SecretStr = Field(min_length=16)
    nats_url: str = Field(pattern=r"^(nats|tls)://[^\s]+$")
    maas_tags: list[MaasTag] = Field(default_factory=list)
    # Extra flags for gpuaas-slice-network-baseline (e.g. ["--tmfifo"]), one argv item each.
    baseline_args: list[Annotated[str, Field(pattern=r"^--?[A-Za-z0-9][A-Za-z0-9_./=:-]*$")]] = Field(default_factory=list)
    # A plaintext nats:// URL is a lab: the agent refuses it unless its config says insecure = true,
    # so the render refuses it too unless this says so (and then writes that setting).
    insecure: bool = False
    # The [slice] table of agent.toml (config.SliceConfig's keys: image_https_hosts, image_file_dir, the
    # bridge...), checked by deploy/sliceinputs.py; a slice host must name at least one image source.
    slice: dict[str, Any] = Field(default_factory=dict)
    # PEM of the CA(s) that sign the https image sources (default: the system store): written to
    # /etc/gpuaas-agent/image-ca.pem, which becomes slice.image_ca_bundle.
    image_ca_pem: str | None = None
    # A bootstrap account login (.creds: allowed only to enroll): a server in operator mode (the account-per-node
    # layout, docs/security-auth.md) has no anonymous users. Written 0600 and named in agent.toml as
    # nats_enroll_creds_file; it can enroll, nothing else. One per host, issued with its token: the agent deletes
    # it once enrolled and the plane revokes it then (docs/security-auth.md "The bootstrap login").
    bootstrap_creds: SecretStr | None = None

    @field_validator("bootstrap_creds")
    @classmethod
    def _creds_shape(cls, value: SecretStr | None) -> SecretStr | None:
        if value is not None:
            text = value.get_secret_value()
            missing = [m for m in CREDS_MARKERS if m not in text]
            if missing:
                raise ValueError(f"not a NATS .creds file (no {missing[0]!r} block)")
        return value

    @model_validator(mode="after")
    def _plaintext_needs_insecure(self) -> UserDataInputs:
        if self.nats_url.startswith("nats://") and not self.insecure:
            raise ValueError("nats_url is plaintext nats://: use tls://, or set insecure: true (labs only)")
        return self

    def problems(self) -> list[str]:
        """What the model alone cannot see: the slice settings and the CA, one line per bad input."""
        return slice_problems(self.slice, ca_pem=self.image_ca_pem, slice_host=self.slice_vm, insecure=self.insecure)

    @property
    def slice_vm(self) -> bool:
        return SLICE_PROFILE_TAG in self.maas_tags


def load_inputs(path: Path) -> UserDataInputs:
    """Inputs from a JSON file; :class:`ContractError` names each bad or unknown key."""
    try:
        data = json.loads(Path(path).read_text())
    except OSError as exc:
        raise ContractError(f"cannot read {path}: {exc.strerror}", code="userdata_inputs_unreadable",
                            evidence={"path": str(path)}) from None
    except json.JSONDecodeError as exc:
        raise ContractError(f"{path}: not valid JSON: {exc}", code="userdata_inputs_invalid",
                            evidence={"path": str(path)}) from None
    try:
        inputs = UserDataInputs.from_wire(data)  # JSON-decoded: validated with JSON's rules
    except ValidationError as exc:
        problems = "; ".join(
            f"unknown key {'.'.join(map(str, e['loc']))!r}" if e["type"] == "extra_forbidden"
            else f"{'.'.join(map(str, e['loc']))}: {e['msg']}"
            for e in exc.errors(include_url=False))
        raise ContractError(f"{path}: {problems}", code="userdata_inputs_invalid",
                            evidence={"path": str(path), "errors": exc.errors(include_url=False, include_input=False)}) from None
    return check_inputs(inputs, source=str(path))


def check_inputs(inputs: UserDataInputs, *, source: str = "inputs") -> UserDataInputs:
    """``inputs`` when every slice setting and the CA are usable; else :class:`ContractError` listing each problem."""
    problems = inputs.problems()
    if problems:
        raise ContractError(f"{source}: " + "; ".join(problems), code="userdata_inputs_invalid",
                            evidence={"path": source, "problems": problems})
    return inputs


def _toml_key(key: str) -> str:
    return key if key.replace("_", "a").replace("-", "a").isalnum() and key.isascii() else json.dumps(key)


def _toml_value(value: Any) -> str:
    """One TOML value from JSON-form data: strings, numbers and booleans as JSON spells them (TOML agrees on
    those, ASCII escaped), lists as inline arrays, tables as inline tables; ``None`` never reaches here."""
    if isinstance(value, dict):
        return "{" + ", ".join(f"{_toml_key(k)} = {_toml_value(v)}" for k, v in value.items() if v is not None) + "}"
    if isinstance(value, list | tuple):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    return json.dumps(value, ensure_ascii=True)


def agent_toml(inputs: UserDataInputs) -> str:
    """The site part of agent.toml; checked by the agent's own config parser before it is shipped."""
    check_inputs(inputs)
    values: dict[str, Any] = {"nats_url": inputs.nats_url, "token_file": str(TOKEN_PATH)}
    if inputs.bootstrap_creds is not None:
        values["nats_enroll_creds_file"] = str(BOOTSTRAP_CREDS_PATH)
    if inputs.insecure:
        values["insecure"] = True
    table = slice_table(inputs.slice, ca_pem=inputs.image_ca_pem)
    # The CA file does not exist here; the PEM itself was loaded by check_inputs.
    checked = {**values, "slice": {k: v for k, v in table.items() if k != "image_ca_bundle"}}
    try:
        parse_config(checked, source="rendered agent.toml")
    except ConfigError as exc:
        raise ContractError(str(exc), code="userdata_config_invalid", evidence=exc.evidence) from None
    lines = ["# Written by cloud-init (gpuaas-agent cloud-init render); keys: see /usr/share/doc/gpuaas-agent."]
    lines += [f"{key} = {_toml_value(value)}" for key, value in values.items()]
    if table:
        lines += ["", "[slice]"]
        lines += [f"{_toml_key(key)} = {_toml_value(value)}" for key, value in table.items() if value is not None]
    return "\n".join(lines) + "\n"


class _Argv(list[str]):
    """A runcmd entry: dumped on one line (``[systemctl, enable, ...]``) so the document reads like the commands."""


class _Dumper(yaml.SafeDumper):  # type: ignore[misc]  # PyYAML ships no stubs: SafeDumper is Any to mypy
    """SafeDumper with readable shapes: argv lists inline, multi-line file contents as ``|`` blocks."""


def _represent_str(dumper: yaml.SafeDumper, value: str) -> yaml.Node:
    style = "|" if "\n" in value else None
    return dumper.represent_scalar("tag:yaml.org,2002:str", value, style=style)


_Dumper.add_representer(str, _represent_str)
_Dumper.add_representer(_Argv, lambda d, v: d.represent_sequence("tag:yaml.org,2002:seq", v, flow_style=True))


def steps(inputs: UserDataInputs) -> list[tuple[str, list[str]]]:
    """The bootstrap's steps in order: (name, argv). Each becomes one runcmd entry through :data:`STEP_SCRIPT`."""
    deb, sums = str(DEB_PATH), str(BOOTSTRAP_DIR / "package.sha256")
    cmds: list[tuple[str, list[str]]] = [
        ("make-cache-dir", ["install", "-d", "-m", "0755", str(DEB_PATH.parent)]),
        ("download-package", ["curl", "--fail", "--silent", "--show-error", "--location", "--retry", "5",
                              "--output", deb, str(inputs.package_url)]),
        ("verify-package", ["sha256sum", "--check", "--strict", sums]),
        ("install-package", ["env", "DEBIAN_FRONTEND=noninteractive", "apt-get", "install", "--yes",
                             "-o", "Dpkg::Options::=--force-confold", "-o", "Dpkg::Options::=--force-confdef", deb]),
        ("install-config", ["install", "-m", "0644", "-o", "root", "-g", "root", str(BOOTSTRAP_DIR / "agent.toml"),
                            str(CONFIG_PATH)]),
    ]
    if inputs.image_ca_pem is not None:
        cmds.append(("install-image-ca", ["install", "-m", "0644", "-o", "root", "-g", "root",
                                          str(BOOTSTRAP_DIR / "image-ca.pem"), str(IMAGE_CA_PATH)]))
    cmds += [
        ("make-state-dir", ["install", "-d", "-m", "0700", "-o", "root", "-g", "root", str(STATE_DIR)]),
        ("install-token", ["install", "-m", "0600", "-o", "root", "-g", "root", str(BOOTSTRAP_DIR / "bootstrap-token"),
                           str(TOKEN_PATH)]),
        ("remove-staged-token", ["rm", "-f", str(BOOTSTRAP_DIR / "bootstrap-token")]),
    ]
    if inputs.bootstrap_creds is not None:
        cmds += [
            ("install-bootstrap-creds", ["install", "-m", "0600", "-o", "root", "-g", "root",
                                         str(BOOTSTRAP_DIR / "bootstrap.creds"), str(BOOTSTRAP_CREDS_PATH)]),
            ("remove-staged-bootstrap-creds", ["rm", "-f", str(BOOTSTRAP_DIR / "bootstrap.creds")]),
        ]
    cmds += [
        # Again with the site config just installed (postinst ran with the packaged default).
        ("prepare-host", [AGENT, "prepare-host", "--config", str(CONFIG_PATH)]),
    ]
    if inputs.slice_vm:
        if inputs.baseline_args:
            cmds.append(("install-baseline-args", ["install", "-m", "0644", str(BOOTSTRAP_DIR / "network-baseline.env"),
                                                   "/etc/default/gpuaas-slice-network-baseline"]))
        cmds.append(("enable-network-baseline", ["systemctl", "enable", "--now", "gpuaas-slice-network-baseline.service"]))
    cmds += [
        ("enroll", [AGENT, "enroll", "--config", str(CONFIG_PATH)]),
        ("enable-agent", ["systemctl", "enable", "--now", "gpuaas-agent.service"]),
    ]
    return cmds


def _runcmd(inputs: UserDataInputs) -> list[list[str]]:
    return [["sh", str(STEP_PATH), name, *argv] for name, argv in steps(inputs)]


def render_userdata(inputs: UserDataInputs) -> str:
    """The ``#cloud-config`` document for ``inputs`` (a pure function: same inputs, same bytes)."""
    files = [
        {"path": str(STEP_PATH), "owner": "root:root", "permissions": "0700", "content": STEP_SCRIPT},
        {"path": str(BOOTSTRAP_DIR / "bootstrap-token"), "owner": "root:root", "permissions": "0600",
         "content": inputs.bootstrap_token.get_secret_value() + "\n"},
        {"path": str(BOOTSTRAP_DIR / "agent.toml"), "owner": "root:root", "permissions": "0600",
         "content": agent_toml(inputs)},
        {"path": str(BOOTSTRAP_DIR / "package.sha256"), "owner": "root:root", "permissions": "0600",
         "content": f"{inputs.package_sha256}  {DEB_PATH}\n"},
    ]
    if inputs.bootstrap_creds is not None:
        files.append({"path": str(BOOTSTRAP_DIR / "bootstrap.creds"), "owner": "root:root", "permissions": "0600",
                      "content": inputs.bootstrap_creds.get_secret_value().rstrip("\n") + "\n"})
    if inputs.image_ca_pem is not None:
        files.append({"path": str(BOOTSTRAP_DIR / "image-ca.pem"), "owner": "root:root", "permissions": "0644",
                      "content": inputs.image_ca_pem.rstrip("\n") + "\n"})
    if inputs.slice_vm and inputs.baseline_args:
        files.append({"path": str(BOOTSTRAP_DIR / "network-baseline.env"), "owner": "root:root",
                      "permissions": "0644", "content": f"BASELINE_ARGS={' '.join(inputs.baseline_args)}\n"})
    document = {
        "package_update": True,
        "packages": ["curl", "ca-certificates"],
        "write_files": files,
        "runcmd": [_Argv(cmd) for cmd in _runcmd(inputs)],
    }
    return "#cloud-config\n" + cast(str, yaml.dump(document, Dumper=_Dumper, sort_keys=False, default_flow_style=False, width=1000))
