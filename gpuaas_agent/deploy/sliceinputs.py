"""The ``[slice]`` settings of the rendered agent.toml: checked at render time, one clear problem per bad input.

A host installed by the user-data must provision on the first try (docs/safety.md §11), and a
provision needs settings only the site knows: where images may come from
(``image_https_hosts``, ``image_file_dir``), the CA that signs a private image server, the
bridge and subnet when they are not the defaults. So every ``[slice]`` key of
:class:`~gpuaas_agent.config.SliceConfig` is an input of ``cloud-init render`` (the
``slice`` table), checked by the agent's own model, plus the rules that only make sense at
deploy time:

- the CA is given as its PEM text (``image_ca_pem``), not as a path: the file does not exist
  on the host until the user-data writes it (to :data:`IMAGE_CA_PATH`), so a path input
  could only be wrong or unverifiable; the PEM is loaded here as the agent will load it;
- a slice host (MAAS tag ``gpuaas-profile-slice-vm``) with no image source would refuse
  every image: refused at render, not at the first provision on the host;
- lab-only switches (plain loopback http, TCG domains) need ``insecure: true``, the inputs'
  existing "this is a lab" statement;
- ``image_file_dir`` never names a kernel or system tree (the image source check refuses
  such files at run time; refusing the input says so before any host is installed).

Problems are collected, not raised at the first: an operator fixing an inputs file sees
every bad key at once, each named ``slice.<key>: what is wrong``.
"""

from __future__ import annotations

import ssl
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from gpuaas_agent.config import SliceConfig

# Where the user-data installs the image CA; the rendered config's slice.image_ca_bundle.
IMAGE_CA_PATH = Path("/etc/gpuaas-agent/image-ca.pem")
IMAGE_CA_MAX_BYTES = 1 << 20  # a bundle of a few hundred CAs is ~200 KiB
# image_file_dir may not be (under) these: kernel trees, the agent's own state, the system's config.
FILE_DIR_REFUSED = tuple(Path(p) for p in ("/dev", "/proc", "/sys", "/run", "/etc", "/boot", "/var/lib/gpuaas-agent"))
LAB_ONLY = ("allow_loopback_http", "allow_emulated_domains")


def ca_problems(pem: str) -> list[str]:
    """What is wrong with ``image_ca_pem`` (empty list: it loads as the agent will load it)."""
    if len(pem.encode()) > IMAGE_CA_MAX_BYTES:
        return [f"image_ca_pem: {len(pem.encode())} bytes, more than {IMAGE_CA_MAX_BYTES} (a CA bundle, not a file dump)"]
    if "PRIVATE KEY" in pem:
        return ["image_ca_pem: holds a private key; give only the CA certificate(s) (the key must never leave the CA)"]
    if "-----BEGIN CERTIFICATE-----" not in pem:
        return ["image_ca_pem: no PEM certificate (-----BEGIN CERTIFICATE-----) in it"]
    try:
        context = ssl.create_default_context(cadata=pem)
    except (ssl.SSLError, ValueError) as exc:
        return [f"image_ca_pem: not loadable as PEM CA certificates: {exc}"]
    if not context.get_ca_certs():
        return ["image_ca_pem: no CA certificate in it (a server certificate is not a CA: basicConstraints CA:TRUE)"]
    return []


def _file_dir_problem(raw: Any) -> str | None:
    if not isinstance(raw, str):
        return None  # the model names the type error
    path = Path(raw)
    if any(ord(c) < 0x20 or ord(c) == 0x7f for c in raw):
        return f"slice.image_file_dir: {raw!r} holds a control character (a newline is never part of an image path)"
    if ".." in path.parts:
        return f"slice.image_file_dir: {raw} holds '..' (give the directory itself)"
    for refused in FILE_DIR_REFUSED:
        if path == refused or refused in path.parents:
            return f"slice.image_file_dir: {raw} is under {refused}, never a directory of images"
    return None


def slice_problems(table: dict[str, Any], *, ca_pem: str | None, slice_host: bool, insecure: bool) -> list[str]:
    """Every problem of the inputs' ``slice`` table and ``image_ca_pem``, each naming its key."""
    problems: list[str] = []
    if "image_ca_bundle" in table:
        problems.append("slice.image_ca_bundle: give the CA itself as image_ca_pem (the user-data writes it to "
                        f"{IMAGE_CA_PATH}; a path here does not exist on the host yet)")
    values = {k: v for k, v in table.items() if k != "image_ca_bundle"}
    try:
        SliceConfig.model_validate(values)
    except ValidationError as exc:
        for err in exc.errors(include_url=False):
            key = ".".join(str(p) for p in ("slice", *err["loc"]))
            message = str(err["msg"]).removeprefix("Value error, ")
            problems.append(f"unknown key {key!r}" if err["type"] == "extra_forbidden" else f"{key}: {message}")
    if "image_file_dir" in values and (problem := _file_dir_problem(values["image_file_dir"])):
        problems.append(problem)
    for key in LAB_ONLY:
        if values.get(key) is True and not insecure:
            problems.append(f"slice.{key}: a lab-only switch; set insecure: true too (never on a production host)")
    if ca_pem is not None:
        problems += ca_problems(ca_pem)
        if not values.get("image_https_hosts"):
            problems.append("image_ca_pem: given but slice.image_https_hosts is empty (the CA would sign no allowed source)")
    if slice_host and not values.get("image_https_hosts") and not values.get("image_file_dir"):
        problems.append("slice: a slice host (gpuaas-profile-slice-vm) with neither slice.image_https_hosts nor "
                        "slice.image_file_dir refuses every image; name where images come from")
    return problems


def slice_table(table: dict[str, Any], *, ca_pem: str | None) -> dict[str, Any]:
    """The ``[slice]`` table to write: the inputs' keys in JSON form, plus the installed CA's path."""
    values = SliceConfig.model_validate(table).model_dump(mode="json", include=set(table))
    if ca_pem is not None:
        values["image_ca_bundle"] = str(IMAGE_CA_PATH)
    return values
