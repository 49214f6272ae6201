"""The lab's provision and release, run by systemd from the package's own unit, inside its sandbox (issue #22).

The ``.deb`` is built and installed into a real systemd 252 manager (lab/systemd_manager.py:
PID 1 of its own namespaces on a throwaway overlay of this machine's root, sharing the host's
network, /dev and the lab's directories). ``systemctl start gpuaas-agent`` then runs the
installed ``gpuaas-agent.service`` unchanged (asserted byte-identical to systemd/): its
``ExecStartPre=+prepare-host``, ``prepare-host --check`` and ``enroll`` and its ``ExecStart=run``,
under every property of the unit as systemd applies it — CapabilityBoundingSet=,
NoNewPrivileges=, SystemCallFilter=, ProtectSystem=strict/ReadWritePaths=, PrivateTmp=,
ProtectHome=, DevicePolicy=closed/DeviceAllow= (the cgroup device controller), and the rest.
The lab's control plane sends real tasks over NATS; a real TCG guest boots and is released.

Only a lab drop-in is added, for what differs between the lab and a host: its config keeps the
dnsmasq hosts file and the seed ISOs in the lab's work dir (``ReadWritePaths=``, as the unit
comment says a site does), the lab's ovsdb socket lives under /tmp (``BindPaths=``, through
PrivateTmp=), and its slot disks are loop devices (``DeviceAllow=block-loop rw``; NVMe
namespaces are ``block-blkext``, already allowed). dnsmasq runs as a unit of the same manager,
as on a host, because the agent signals it by PID.

Negative controls prove the sandbox is applied: the agent process's capability bounding set,
no_new_privs, seccomp mode and device cgroup are read from /proc and cgroupfs; without the
seed directory in ReadWritePaths= the unit does not start (``prepare-host --check`` names it
read-only); without CAP_NET_ADMIN a provision fails at its network step with a typed error.
A probe run by the installed unit itself (an ``ExecStartPost=`` of a drop-in: the same sandbox as
``ExecStart=``) finds kernel.core_pattern read-only, other processes' memory closed and PID 1's
private socket unreachable, each of which succeeds from outside the sandbox.
"""

from __future__ import annotations

import json
import os
import posixpath
import shutil
import subprocess
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from gpuaas_agent.deploy import sysfswrites
from gpuaas_agent.hostfs import HostRoot
from lab.harness import Lab, LabSettings
from lab.systemd_manager import SystemdManager
from tests.deploy.units import AGENT_UNIT, agent_capabilities
from tests.e2e.conftest import LoopThread
from tests.support.daemons import stop_pid

INSTALLED_AGENT = Path("/opt/gpuaas-agent/bin/gpuaas-agent")
INSTALLED_UNIT = Path("/lib/systemd/system/gpuaas-agent.service")
STATE_DIR = Path("/var/lib/gpuaas-agent")
APT_ARCHIVES = Path("/var/cache/gpuaas-agent-ci/apt-archives")  # tests/deploy/test_deb.py's offline apt cache
NOT_ON_THE_LAB_MACHINE = ("python3-libvirt", "python3-systemd")
DROPIN_DIR = Path("/etc/systemd/system/gpuaas-agent.service.d")
CAPS = {"CAP_DAC_OVERRIDE": 1, "CAP_KILL": 5, "CAP_NET_ADMIN": 12, "CAP_SYS_PTRACE": 19, "CAP_SYS_ADMIN": 21}


@dataclass
class UnitLab:
    lab: Lab
    runner: LoopThread
    manager: SystemdManager
    timings: dict[str, float]

    def task(self, task_type: str, payload: dict, timeout: float = 600):
        return self.runner.run(self.lab.task(task_type, payload, timeout=timeout), timeout=timeout + 30)

    def write(self, inside: str, text: str, mode: int = 0o644) -> None:
        path = self.manager.root / inside.lstrip("/")
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        path.chmod(mode)

    def restart_agent(self, *, expect_active: bool = True) -> dict[str, str]:
        self.manager.systemctl("daemon-reload")
        self.manager.systemctl("reset-failed", "gpuaas-agent.service", check=False)
        done = self.manager.systemctl("restart", "gpuaas-agent.service", timeout=180, check=False)
        state = self.manager.show("gpuaas-agent.service", "ActiveState", "Result", "StatusText", "MainPID",
                                  "ExecMainStatus")
        if expect_active:
            status = self.manager.systemctl("status", "gpuaas-agent.service", check=False).stdout
            assert done.returncode == 0 and state["ActiveState"] == "active", (state, status, self.agent_log()[-3000:])
        return state

    def agent_log(self) -> str:
        log = self.lab.work / "agent.log"
        return log.read_text(errors="replace") if log.exists() else ""


def _toml(config: dict) -> str:
    """The lab's JSON config as agent.toml (JSON strings, numbers and lists are TOML values)."""
    def value(v) -> str:
        if isinstance(v, dict):
            return "{ " + ", ".join(f"{k} = {value(x)}" for k, x in v.items()) + " }"
        return json.dumps(v)
    top = [f"{k} = {value(v)}" for k, v in config.items() if not isinstance(v, dict) or k != "slice"]
    table = [f"{k} = {value(v)}" for k, v in config.get("slice", {}).items()]
    return "\n".join([*top, "", "[slice]", *table]) + "\n"


def _dependency_debs() -> list[str]:
    """The .debs of the two Depends a lab machine lacks: from test_deb.py's apt cache (``apt-get download`` once)."""
    APT_ARCHIVES.mkdir(parents=True, exist_ok=True)
    debs = []
    for name in NOT_ON_THE_LAB_MACHINE:
        if not list(APT_ARCHIVES.glob(f"{name}_*_amd64.deb")):
            subprocess.run(["apt-get", "download", name], cwd=APT_ARCHIVES, check=True, capture_output=True, timeout=300)
        debs.append(str(sorted(APT_ARCHIVES.glob(f"{name}_*_amd64.deb"))[-1]))
    return debs


def _lab_dropin(lab: Lab) -> str:
    env = " ".join(f'"{k}={v}"' for k, v in lab.ovs_env.items())
    return (
        "# The lab's drop-in: only what differs between the lab and a slice host.\n"
        "[Service]\n"
        f"ReadWritePaths=-{lab.work / 'dnsmasq'} -{lab.work / 'seeds'} -{lab.work / 'console'}\n"
        f"BindPaths={lab.switch.rundir}\n"
        "DeviceAllow=block-loop rw\n"
        f"Environment={env}\n"
        f"StandardOutput=append:{lab.work / 'agent.log'}\n"
        "StandardError=inherit\n"
    )


@pytest.fixture(scope="module")
def unit_lab(request, deb_build) -> Iterator[UnitLab]:
    if os.geteuid() != 0:
        pytest.fail("the unit lab needs root (namespaces, loop devices, OVS, libvirtd)", pytrace=False)
    timings: dict[str, float] = {}
    mark = time.monotonic()
    # Not under /tmp or /var/tmp: the unit's PrivateTmp= would hide the lab's files from the agent.
    work = Path(tempfile.mkdtemp(prefix="gpuaas-unitlab-", dir="/var/lib"))
    work.chmod(0o755)
    deb = deb_build(None, work / "dist")  # the session's build of this tree (tests/deploy/machine.py)
    timings["build"] = time.monotonic() - mark

    lines: list[str] = []
    lab = Lab(LabSettings(workdir=work, slots=2, readiness_timeout_s=300, say=lines.append,
                          agent_binary=INSTALLED_AGENT, use_package_paths=True))
    runner = LoopThread()
    manager: SystemdManager | None = None
    ok = False
    try:
        mark = time.monotonic()
        runner.run(lab.start_services(), timeout=900)
        timings["lab services"] = time.monotonic() - mark

        mark = time.monotonic()
        manager = SystemdManager(work / "manager", [work, Path("/run/libvirt"), lab.switch.rundir]).start()
        timings["manager"] = time.monotonic() - mark
        mark = time.monotonic()
        manager.run("dpkg", "-i", *_dependency_debs(), str(deb), timeout=600,
                    env={"PATH": "/usr/sbin:/usr/bin:/sbin:/bin", "DEBIAN_FRONTEND": "noninteractive"})
        timings["install"] = time.monotonic() - mark
        ulab = UnitLab(lab, runner, manager, timings)

        # dnsmasq as a unit of the same manager (the agent signals it by PID, in the manager's namespace).
        stop_pid(lab.procs.pop("dnsmasq"))
        (work / "dnsmasq" / "dnsmasq.pid").unlink(missing_ok=True)
        ulab.write("/etc/systemd/system/lab-dnsmasq.service",
                   "[Service]\nExecStart=" + " ".join(lab.dnsmasq_argv()) + "\n")
        manager.systemctl("daemon-reload")
        manager.systemctl("start", "lab-dnsmasq.service")
        manager.wait_for(lambda: (work / "dnsmasq" / "dnsmasq.pid").exists(), "dnsmasq's pid file", 30)

        # The node: the package's config file and bootstrap token, then the unit as a host starts it.
        lab._make_keys()
        lab._write_config()
        config = json.loads(lab.config_path.read_text())
        config["slice"]["seed_dir"] = str(work / "seeds")
        del config["slice"]["image_cache_dir"]  # the package default: <state_dir>/images (StateDirectory=)
        ulab.write("/etc/gpuaas-agent/agent.toml", _toml(config), 0o640)
        (manager.root / STATE_DIR.relative_to("/")).mkdir(mode=0o700, exist_ok=True)
        ulab.write(str(STATE_DIR / "bootstrap-token"), lab.cp.issue_token() + "\n", 0o600)
        ulab.write(str(DROPIN_DIR / "lab.conf"), _lab_dropin(lab))
        mark = time.monotonic()
        ulab.restart_agent()
        timings["unit start"] = time.monotonic() - mark
        lab.node_id = json.loads((manager.root / STATE_DIR.relative_to("/") / "enrollment.json").read_text())["node_id"]
        runner.run(lab.approve_slots(), timeout=180)
        assert len(lab.approved) == 2, lab.approved
        yield ulab
        ok = True
    finally:
        problems = []
        if manager is not None:
            problems += manager.close()
        problems += runner.run(lab.stop(), timeout=300)
        runner.close()
        print("unit lab: " + " ".join(f"{k}={v:.1f}s" for k, v in timings.items()))
        if problems or not ok or request.session.testsfailed:
            print("\n".join(lines) + f"\nlogs kept in {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)
        assert not problems, problems


def _in_manager(ulab: UnitLab, *argv: str) -> str:
    return ulab.manager.run(*argv).stdout


# The start of a probe script run as the agent: ``attempt(name, fn)`` records "ok" or the errno's name in ``out``.
ATTEMPT = r"""
out = {}
def attempt(name, fn):
    try:
        fn(); out[name] = "ok"
    except OSError as exc:
        out[name] = errno.errorcode.get(exc.errno, str(exc.errno))
"""

# What code running as the agent could try: each attempt is reported as "ok" or the errno's name.
# core_pattern is rewritten with its own value, so an open sandbox would change nothing.
PROBE = r"""
import errno, json, os, socket, sys
""" + ATTEMPT + r"""
def rewrite(path):
    with open(path) as fh:
        value = fh.read()
    with open(path, "w") as fh:
        fh.write(value)
attempt("core_pattern", lambda: rewrite("/proc/sys/kernel/core_pattern"))
for pid in sys.argv[1:]:
    attempt(f"mem {pid}", lambda: os.close(os.open(f"/proc/{pid}/mem", os.O_RDONLY)))
def pid1():
    with socket.socket(socket.AF_UNIX) as sock:
        sock.settimeout(10)
        sock.connect("/run/systemd/private")
attempt("systemd_private", pid1)
print("sandbox-probe " + json.dumps(out), flush=True)
"""


def test_the_installed_unit_is_the_repositorys_and_systemd_applied_its_sandbox_to_the_agent(unit_lab):
    assert (unit_lab.manager.root / INSTALLED_UNIT.relative_to("/")).read_bytes() == AGENT_UNIT.read_bytes()
    pid = unit_lab.manager.show("gpuaas-agent.service", "MainPID")["MainPID"]
    status = dict(line.split(":\t", 1) for line in _in_manager(unit_lab, "cat", f"/proc/{pid}/status").splitlines()
                  if ":\t" in line)
    expected = sum(1 << CAPS[c] for c in agent_capabilities())
    assert int(status["CapBnd"], 16) == expected  # exactly the unit's five, nothing else
    assert status["NoNewPrivs"].strip() == "1"
    assert status["Seccomp"].strip() == "2"  # SystemCallFilter= is a loaded seccomp filter
    # DevicePolicy=closed: the device cgroup allows the unit's list (and the lab's loop disks), not everything.
    devices = _in_manager(unit_lab, "cat", "/sys/fs/cgroup/devices/system.slice/gpuaas-agent.service/devices.list")
    allowed = set(devices.split("\n")) - {""}
    assert "a *:* rwm" not in allowed
    # NVMe namespaces rw, virtio disks read-only, /dev/kvm read-only (/dev/vfio/vfio only where the module is loaded).
    assert {"b 259:* rw", "b 254:* r", "b 7:* rw", "c 10:232 r"} <= allowed, allowed
    assert not any(entry.startswith(("b 8:", "b 1:", "c 1:1 ", "c 1:2 ")) and "w" in entry for entry in allowed), allowed
    # ProtectSystem=strict: / is read-only in the agent's mount namespace, the seed dir is not.
    mounts = {line.split()[4]: line.split()[5] for line in _in_manager(unit_lab, "cat", f"/proc/{pid}/mountinfo").splitlines()}
    assert "ro" in mounts["/"].split(",")
    assert "rw" in mounts[str(unit_lab.lab.work / "seeds")].split(",")


def test_the_sandbox_closes_kernel_tunables_other_processes_memory_and_pid1s_socket(unit_lab):
    pid = unit_lab.manager.show("gpuaas-agent.service", "MainPID")["MainPID"]
    mounts = {line.split()[4]: line.split()[5].split(",")
              for line in _in_manager(unit_lab, "cat", f"/proc/{pid}/mountinfo").splitlines()}
    # ProtectKernelTunables=yes: /proc/sys and all of /sys read-only, no sysfs tree opened by the unit itself
    # (the slot devices' files are, by prepare-host's drop-in: test_sysfs_is_writable_only_...).
    assert "ro" in mounts["/proc/sys"] and "ro" in mounts["/sys"], mounts
    assert not any(m.startswith("/sys/") and "rw" in o for m, o in mounts.items()), mounts
    # Another process of the manager (PID 1, root with every capability; the lab's dnsmasq; QEMU runs outside
    # this PID namespace, tests/deploy/test_unit_sandbox.py opens another user's process the same way).
    targets = ["1", unit_lab.manager.show("lab-dnsmasq.service", "MainPID")["MainPID"]]
    unit_lab.write("/usr/local/lib/gpuaas-sandbox-probe.py", PROBE)
    unit_lab.write(str(DROPIN_DIR / "zz-probe.conf"),
                   "[Service]\nExecStartPost=/usr/bin/python3 /usr/local/lib/gpuaas-sandbox-probe.py "
                   + " ".join(targets) + "\n")
    try:
        before = len(unit_lab.agent_log())
        unit_lab.restart_agent()
        said = [line for line in unit_lab.agent_log()[before:].splitlines() if line.startswith("sandbox-probe ")]
    finally:
        (unit_lab.manager.root / DROPIN_DIR.relative_to("/") / "zz-probe.conf").unlink()
        unit_lab.restart_agent()
    assert len(said) == 1, unit_lab.agent_log()[-3000:]
    inside = json.loads(said[0].split(" ", 1)[1])
    assert inside["core_pattern"] == "EROFS", inside
    assert all(inside[f"mem {t}"] in ("EACCES", "EPERM") for t in targets), inside
    assert inside["systemd_private"] in ("ECONNREFUSED", "ENOENT", "EACCES"), inside
    # Control: the same probe outside the sandbox (as root in the manager) reaches all three.
    outside = _in_manager(unit_lab, "/usr/bin/python3", "/usr/local/lib/gpuaas-sandbox-probe.py", *targets)
    assert json.loads(outside.split(" ", 1)[1]) == {"core_pattern": "ok", "systemd_private": "ok",
                                                     **{f"mem {t}": "ok" for t in targets}}, outside


# Each attempt: "open_w" opens for writing and closes, writing nothing (a read-only mount refuses at
# open(2) with EROFS; a real sysfs attribute stores only on write(2)), "open_rw" likewise read-write (as
# gpu-admin-tools opens a config space), "rewrite" writes a lab fixture file's own content back.
SYSFS_PROBE = r"""
import errno, json, os, sys
""" + ATTEMPT + r"""
def open_w(path):
    os.close(os.open(path, os.O_WRONLY | os.O_CLOEXEC))
def open_rw(path):
    os.close(os.open(path, os.O_RDWR | os.O_CLOEXEC))
def rewrite(path):
    with open(path, "rb") as fh:
        value = fh.read()
    with open(path, "r+b") as fh:
        fh.write(value)
with open(sys.argv[1]) as fh:
    attempts = json.load(fh)
for name, (how, path) in attempts.items():
    attempt(name, lambda: {"open_w": open_w, "open_rw": open_rw, "rewrite": rewrite}[how](path))
print("sysfs-probe " + json.dumps(out), flush=True)
"""

# The agent's own vfio binding (host/devices/vfio.py) of one slot GPU of the lab's recorded host, run by the installed
# agent's interpreter inside the unit; the fixture's kernel stand-in re-points ``driver`` after drivers_probe.
BIND_PROBE = r"""
import asyncio, json, os, sys
from gpuaas_agent.host.devices.vfio import bind_to_vfio
from gpuaas_agent.hostfs import HostRoot
root, address = sys.argv[1:3]
host = HostRoot.open(root)
writes = []
# drivers_probe written: re-pointing the device's driver link is the kernel's work, not the agent's, and the
# unit opens only the files the agent writes, so a stand-in for the kernel cannot do it inside the sandbox.
class KernelsTurn(Exception):
    pass
def kernel(step):
    writes.append(step.path)
    if step.path.endswith("drivers_probe"):
        raise KernelsTurn()
try:
    asyncio.run(bind_to_vfio(host, address, [address], after_write=kernel))
    out = {"error": "returned", "message": "the bind finished without drivers_probe", "writes": writes}
except KernelsTurn:
    out = {"writes": writes}
except Exception as exc:
    out = {"error": getattr(exc, "code", type(exc).__name__), "message": str(exc), "writes": writes}
print("bind-probe " + json.dumps(out), flush=True)
"""

GENERATED_DROPIN = DROPIN_DIR / "50-sysfs-writes.conf"


def _probe_lines(ulab: UnitLab, before: int, prefix: str) -> list[dict]:
    return [json.loads(line.split(" ", 1)[1]) for line in ulab.agent_log()[before:].splitlines()
            if line.startswith(prefix + " ")]


def test_sysfs_is_writable_only_where_the_slot_devices_files_are_and_the_agents_bind_still_writes_them(unit_lab):
    lab, manager = unit_lab.lab, unit_lab.manager
    host = HostRoot.open(lab.host.root)
    # The drop-in prepare-host --sysfs-dropin wrote (ExecStartPre=+) from the lab's recorded host, as on a slice
    # host: exactly the write set of its candidate slots, nothing of the machine's own /sys.
    generated = (manager.root / GENERATED_DROPIN.relative_to("/")).read_text()
    expected = sysfswrites.host_write_set(host)
    opened = [line.removeprefix("ReadWritePaths=-") for line in generated.splitlines() if line.startswith("ReadWritePaths=")]
    assert opened == [p.path for p in expected] and opened, generated
    gpus = [p for p in expected if p.item.endswith(".gpu.driver_override")]  # files, never a device directory
    assert gpus and all(str(lab.host.root) in p for p in opened)
    # The first start ran under the drop-in the postinst wrote for the machine's own (GPU-less) host, as after a
    # hot-add: prepare-host --check inside the sandbox named every slot path read-only, with the fix, and the unit
    # still started (it costs those slots, which preflight's sysfs_writable refuses, not the node).
    first_start = unit_lab.agent_log()
    for p in expected:
        assert f"item=sysfs.{p.item} path={p.path} outcome=read_only fix='systemctl daemon-reload" in first_start, p

    # A stand-in for a slot GPU on the real sysfs of this machine (it has no GPU): the last PCI function,
    # its write set rendered by the same code; the other functions of the same PCI root stay outside.
    real = HostRoot.open("/")
    functions = sorted(os.listdir("/sys/bus/pci/devices"))
    standin, outsider = functions[-1], functions[0]
    standin_set = sysfswrites.write_set(real, [("standin.gpu", "gpu", standin)])
    standin_dir = real.resolve(f"/sys/bus/pci/devices/{standin}")
    outsider_dir = real.resolve(f"/sys/bus/pci/devices/{outsider}")
    assert posixpath.dirname(standin_dir) == posixpath.dirname(outsider_dir)  # the same PCI root
    platform = sorted(Path("/sys/devices/platform").glob("*/uevent"))[0]
    # The lab host's boot disk: another PCI root than any slot, its driver (nvme) never unbound by the agent.
    boot_disk = sorted(n for n in os.listdir(host.real("/sys/bus/pci/drivers/nvme")) if n.startswith("0000:01:"))[0]
    boot_dir = host.real(host.resolve(f"/sys/bus/pci/devices/{boot_disk}"))
    gpu_dir = Path(gpus[-1].path).parent
    attempts = {
        "standin_driver_override": ("open_w", f"{standin_dir}/driver_override"),
        "standin_config": ("open_rw", f"{standin_dir}/config"),
        "same_root_other_device": ("open_w", f"{outsider_dir}/driver_override"),
        "pci_rescan": ("open_w", "/sys/bus/pci/rescan"),
        "kernel_mm": ("open_w", "/sys/kernel/mm/transparent_hugepage/enabled"),
        "platform_device": ("open_w", str(platform)),
        "lab_slot_gpu_driver_override": ("rewrite", str(gpu_dir / "driver_override")),
        "lab_slot_gpu_reset": ("rewrite", str(gpu_dir / "reset")),
        "lab_other_root_device": ("rewrite", str(boot_dir / "driver_override")),
        "lab_boot_disk_driver_unbind": ("rewrite", host.real("/sys/bus/pci/drivers/nvme/unbind").as_posix()),
    }
    address = gpu_dir.name
    saved_link = os.readlink(gpu_dir / "driver")
    saved_override = (gpu_dir / "driver_override").read_bytes()
    unit_lab.write("/usr/local/lib/gpuaas-sysfs-probe.py", SYSFS_PROBE)
    unit_lab.write("/usr/local/lib/gpuaas-bind-probe.py", BIND_PROBE)
    unit_lab.write("/usr/local/lib/gpuaas-sysfs-probe.json", json.dumps(attempts))
    dropin = ("[Service]\n" + sysfswrites.render_dropin(standin_set, host_root="/").split("[Service]\n", 1)[1]
              + "ExecStartPost=/usr/bin/python3 /usr/local/lib/gpuaas-sysfs-probe.py /usr/local/lib/gpuaas-sysfs-probe.json\n"
              + f"ExecStartPost={INSTALLED_AGENT.parent / 'python'} /usr/local/lib/gpuaas-bind-probe.py "
              + f"{lab.host.root} {address}\n")
    unit_lab.write(str(DROPIN_DIR / "zz-sysfs-probe.conf"), dropin)
    try:
        before = len(unit_lab.agent_log())
        unit_lab.restart_agent()
        log = unit_lab.agent_log()[before:]
        said, bound = _probe_lines(unit_lab, before, "sysfs-probe"), _probe_lines(unit_lab, before, "bind-probe")
        pid = manager.show("gpuaas-agent.service", "MainPID")["MainPID"]
        mounts = {line.split()[4]: line.split()[5].split(",")
                  for line in _in_manager(unit_lab, "cat", f"/proc/{pid}/mountinfo").splitlines()}
    finally:
        (manager.root / DROPIN_DIR.relative_to("/") / "zz-sysfs-probe.conf").unlink()
        (gpu_dir / "driver").unlink()
        (gpu_dir / "driver").symlink_to(saved_link)
        (gpu_dir / "driver_override").write_bytes(saved_override)
        unit_lab.restart_agent()
    assert len(said) == 1 and len(bound) == 1, log[-3000:]
    inside = said[0]
    # Open: the slot devices' own files the agent writes (the real stand-in and the lab host's slot GPU).
    assert {k: inside[k] for k in ("standin_driver_override", "standin_config", "lab_slot_gpu_driver_override")
            } == dict.fromkeys(("standin_driver_override", "standin_config", "lab_slot_gpu_driver_override"), "ok"), inside
    # Closed: another device of the same PCI root, the PCI rescan, /sys/kernel, a platform device, and on the lab
    # host another root's device, the boot disk's driver, and the slot GPU's own files the agent never writes
    # (its reset: gpu-admin-tools resets through config space).
    for name in ("same_root_other_device", "pci_rescan", "kernel_mm", "platform_device", "lab_other_root_device",
                 "lab_boot_disk_driver_unbind", "lab_slot_gpu_reset"):
        assert inside[name] == "EROFS", (name, inside)
    # The agent's bind wrote driver_override, the leaving driver's unbind and drivers_probe under the unit (each
    # write succeeded; the driver link that drivers_probe moves is the kernel's, outside any unit's reach).
    assert bound[0] == {"writes": [f"/sys/bus/pci/devices/{address}/driver_override",
                                   "/sys/bus/pci/drivers/nvidia/unbind", "/sys/bus/pci/drivers_probe"]}, bound
    # In the agent's mount namespace each opened path is its own read-write mount over the read-only /sys.
    assert "ro" in mounts["/sys"] and all("rw" in mounts[p] for p in opened), mounts
    assert "rw" in mounts[f"{standin_dir}/driver_override"] and standin_dir not in mounts, mounts
    # prepare-host --check (inside the sandbox) found every slot file writable.
    assert all(f"item=sysfs.{p.item} path={p.path} outcome=ok" in log for p in expected), log[-3000:]
    # Control: outside the sandbox (root in the manager) every attempt succeeds.
    outside = json.loads(_in_manager(unit_lab, "/usr/bin/python3", "/usr/local/lib/gpuaas-sysfs-probe.py",
                                     "/usr/local/lib/gpuaas-sysfs-probe.json").split(" ", 1)[1])
    assert outside == dict.fromkeys(attempts, "ok"), outside


def test_the_lab_provision_and_release_succeed_inside_the_units_sandbox(unit_lab):
    lab = unit_lab.lab
    slot = lab.approved[0]
    mark = time.monotonic()
    payload = lab.provision_payload(slot)
    result = unit_lab.task("slice.vm_provision", payload)
    unit_lab.timings["provision"] = time.monotonic() - mark
    assert result.status.value == "succeeded", (result.error, unit_lab.agent_log()[-3000:])
    assert result.output["ssh_ready"] is True and result.output["actual_ip"] == slot.private_ip
    mark = time.monotonic()
    released = unit_lab.task("slice.vm_release", Lab.release_payload(payload["allocation_id"], slot, 30))
    unit_lab.timings["release"] = time.monotonic() - mark
    assert released.status.value == "succeeded", released.error
    assert released.output["cleanup_proof"]["wipe"]["verified"] is True


def test_without_the_seed_dir_in_read_write_paths_the_unit_refuses_to_start_naming_it(unit_lab):
    work = unit_lab.lab.work
    unit_lab.write(str(DROPIN_DIR / "zz-negative.conf"),
                   f"[Service]\nReadWritePaths=\nReadWritePaths={work / 'dnsmasq'}\n")
    try:
        before = len(unit_lab.agent_log())
        state = unit_lab.restart_agent(expect_active=False)
        # ExecStartPre=prepare-host --check, inside the sandbox, found the seed dir read-only: no ExecStart= ran.
        assert state["Result"] == "exit-code" and state["MainPID"] == "0", state
        said = unit_lab.agent_log()[before:]
        assert f"host_path_read_only: seed_dir {work / 'seeds'} is not writable here" in said, said
    finally:
        (unit_lab.manager.root / DROPIN_DIR.relative_to("/") / "zz-negative.conf").unlink()
        unit_lab.restart_agent()


def test_without_cap_net_admin_a_provision_fails_at_the_network_step_with_a_typed_error(unit_lab):
    lab = unit_lab.lab
    slot = lab.approved[1]
    unit_lab.write(str(DROPIN_DIR / "zz-negative.conf"), "[Service]\nCapabilityBoundingSet=~CAP_NET_ADMIN\n")
    unit_lab.restart_agent()
    payload = lab.provision_payload(slot)
    try:
        result = unit_lab.task("slice.vm_provision", payload)
    finally:
        (unit_lab.manager.root / DROPIN_DIR.relative_to("/") / "zz-negative.conf").unlink()
        unit_lab.restart_agent()
    # The guard table of the slice's port (host/network/nftguard.py) is the first step that needs CAP_NET_ADMIN.
    assert result.status.value == "failed", result
    error = result.error
    assert (error.code, error.evidence["failed_step"], error.evidence["argv"][0]) == ("command_failed", "ovs_port", "nft"), error
    assert "Operation not permitted" in error.evidence["stderr"], error
    assert error.evidence["disk_touched"] is True and result.slot_outcomes[0].status.value == "cleanup_blocked"
    # The full unit again: the release cleans the slot the failed provision left.
    released = unit_lab.task("slice.vm_release", Lab.release_payload(payload["allocation_id"], slot, 10))
    assert released.status.value == "succeeded", released.error
