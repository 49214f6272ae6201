"""A TCG guest whose PCIe NIC is QEMU's SR-IOV ``igb``: runs a Python script against a real kernel's VF netlink.

Why it exists: the fabric VF code (``host/network/fabricvf.py``) sets a VF's MAC, VLAN,
spoof check, trust and link state through rtnetlink on the PF and reads them back from
IFLA_VFINFO_LIST. No machine here (nor CI) has an SR-IOV NIC, and Debian's kernels do not build
netdevsim. QEMU >= 8 emulates the Intel 82576 (``-device igb``) with SR-IOV; the guest's Debian
kernel drives it with ``igb`` (the PF: it implements ndo_set_vf_mac/vlan/spoofchk/trust/link_state)
and ``igbvf`` (the VFs). The QEMU comes from bookworm-backports (``lab/qemu_backport.py``).

The guest: the lab guest's initramfs (``lab/build_guest_image.py``: busybox, Debian kernel) with a
second cpio archive appended (the kernel unpacks concatenated archives in order, later files win):
the ``igb``/``igbvf``/``8021q`` modules, Python 3.11 from Debian's packages (``dpkg-deb -x``; unused
parts of the stdlib left out; byte-compiled on the host as unchecked-hash .pyc so nothing compiles
under TCG), the pure-Python libraries the agent's code needs from this venv (pyroute2, pydantic...),
and an ``inittab`` that runs :data:`RUNNER` instead of the SSH/DHCP bring-up. That archive is cached
by the digest of its inputs. Per run, a third small archive carries the job script and copies of the
named packages (e.g. ``gpuaas_agent/``).

The job's stdout/stderr/exit status come back as one JSON line on the guest's second serial port
(``-serial file:``), so kernel messages on the console cannot interleave with it; the guest powers
off after it, and QEMU is killed by PID whatever happens. Tests and the lab only.
"""

from __future__ import annotations

import gzip
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
if str(HERE.parent) not in sys.path:  # run as a script: the agent package and lab/ are importable
    sys.path.insert(0, str(HERE.parent))

from lab.build_guest_image import (  # noqa: E402
    DEFAULT_CACHE,
    Cpio,
    Kernel,
    LabImageError,
    build_initramfs,
    decompress_module,
    download_deb,
    fetch_kernel,
    module_load_order,
    run_tool,
    sha256_file,
    shared_libraries,
)
from lab.qemu_backport import BackportQemu, fetch_backport_qemu  # noqa: E402

IGB_FORMAT = "gpuaas-igb-guest/1"  # bump when the archive layout changes without an input change
IGB_MODULES = ("igb", "igbvf", "8021q")
PYTHON = "python3.11"
PYTHON_DEBS = ("python3.11-minimal", "libpython3.11-minimal", "libpython3.11-stdlib")
# Pure-Python (or cp311 manylinux) libraries copied from this venv into the guest's dist-packages.
SITE_PACKAGES = ("pyroute2", "pydantic", "pydantic_core", "typing_extensions", "annotated_types", "typing_inspection",
                 # the agent's step runner (tasks/pipeline.py) imports these: its context names the NATS client,
                 # its log events go through logs.py (systemd-python: a C extension, its libraries copied by ldd)
                 "nats", "systemd")
# Parts of the stdlib a netlink script never imports: left out to keep the initramfs small.
STDLIB_LEFT_OUT = (
    "test", "idlelib", "tkinter", "turtledemo", "ensurepip", "lib2to3", "pydoc_data", "venv",
    "distutils", "__phello__", "config-3.11-x86_64-linux-gnu", "turtle.py", "pydoc.py", "sitecustomize.py",
)  # fmt: skip
# Host tools copied into the guest with their libraries: iproute2's ``ip`` reads the PF's VFs as an operator
# does (``ip -d -j link show``; busybox's ip has no -d/-j), at /usr/local/sbin/<name>.
IGB_TOOLS = (Path("/usr/sbin/ip"),)
GUEST_TOOLS = "usr/local/sbin"
GUEST_DIST = "usr/lib/python3/dist-packages"  # Debian's python puts it on sys.path by itself
JOB_DIR = "job"
JOBS_PACKAGE = HERE / "igb_jobs"  # shipped with every run: the jobs import their shared reads from it
RESULT_MARK = "GPUAAS-IGB-RESULT "
BOOT_MARK = "GPUAAS-IGB-GUEST-BOOTED"
IGB_MAC = "52:54:00:1b:00:01"

INITTAB = "::sysinit:/etc/igb-sysinit\n"
SYSINIT = f"""#!/bin/sh
# igb guest: load the modules, run the job (etc/igb-run.py), power off. No SSH, no DHCP.
export PATH=/bin:/sbin:/usr/bin:/usr/sbin
exec >/dev/console 2>&1
while read -r module params; do
    # shellcheck disable=SC2086
    insmod "/lib/modules/$(uname -r)/$module" $params 2>/dev/null
done </etc/modules.load
ip link set lo up
echo "{BOOT_MARK} kernel=$(uname -r) uptime=$(cut -d' ' -f1 /proc/uptime)"
/usr/bin/{PYTHON} /etc/igb-run.py
echo "GPUAAS-IGB-GUEST-DONE uptime=$(cut -d' ' -f1 /proc/uptime)"
poweroff -f
"""
# Runs the job with a deadline and writes {rc, stdout, stderr, uptimes} as one JSON line to ttyS1.
RUNNER = f"""import json, os, subprocess, sys, termios
def uptime():
    with open("/proc/uptime") as fh:
        return float(fh.read().split()[0])
started = uptime()
env = dict(os.environ, PYTHONPATH="/{JOB_DIR}/pkg", PYTHONDONTWRITEBYTECODE="1", PATH="/bin:/sbin:/usr/bin:/usr/sbin")
try:
    timeout = float(open("/{JOB_DIR}/timeout").read())
except OSError:
    timeout = 300.0
try:
    done = subprocess.run([sys.executable, "/{JOB_DIR}/job.py"], cwd="/{JOB_DIR}", env=env,
                          capture_output=True, timeout=timeout)
    rc, out, err = done.returncode, done.stdout, done.stderr
except subprocess.TimeoutExpired as exc:
    rc, out, err = -9, exc.stdout or b"", (exc.stderr or b"") + b"\\njob ran past its timeout"
line = json.dumps({{"rc": rc, "stdout": out.decode("utf-8", "replace"), "stderr": err.decode("utf-8", "replace"),
                   "uptime_job_start": started, "uptime_job_end": uptime()}})
fd = os.open("/dev/ttyS1", os.O_WRONLY | os.O_NOCTTY)
attrs = termios.tcgetattr(fd)
attrs[1] &= ~termios.OPOST  # no \\n -> \\r\\n
termios.tcsetattr(fd, termios.TCSANOW, attrs)
data = ("{RESULT_MARK}" + line + "\\n").encode()
while data:
    data = data[os.write(fd, data):]
termios.tcdrain(fd)
os.close(fd)
"""


class IgbGuestError(LabImageError):
    """The igb guest could not be built, booted or did not answer; ``evidence`` names what was seen."""

    default_code = "lab_igb_guest_failed"


@dataclass(frozen=True)
class IgbRun:
    """What one boot of the igb guest gave back."""

    rc: int
    stdout: str
    stderr: str
    wall_s: float  # host: QEMU start to QEMU exit
    uptime_booted_s: float  # guest clock when the modules were loaded (the boot's length under TCG)
    uptime_job_s: float  # guest clock spent in the job
    kernel_version: str
    qemu_version: str
    console: str
    argv: tuple[str, ...]

    def json(self) -> Any:
        """The job's stdout as JSON (the jobs print one JSON document)."""
        try:
            return json.loads(self.stdout)
        except ValueError as exc:
            raise IgbGuestError("the igb job printed no JSON", stdout=self.stdout[-3000:],
                                stderr=self.stderr[-3000:], rc=self.rc) from exc  # fmt: skip


# ---------------------------------------------------------------------------
# The cached archive: modules, python, libraries
# ---------------------------------------------------------------------------


def _venv_site_packages() -> Path:
    import pyroute2

    return Path(pyroute2.__file__).resolve().parents[1]


def _python_root(cache: Path) -> tuple[Path, tuple[Path, ...]]:
    """Debian's python3.11 packages unpacked (once) into the cache; returns (root, debs)."""
    debs = tuple(download_deb(pkg, cache / "debs") for pkg in PYTHON_DEBS)
    digest = hashlib.sha256(b"".join(f"{d.name}\0{sha256_file(d)}\0".encode() for d in debs)).hexdigest()
    root = cache / "python" / digest[:24]
    if not (root / ".unpacked").exists():
        shutil.rmtree(root, ignore_errors=True)
        root.mkdir(parents=True)
        for deb in debs:
            run_tool(["dpkg-deb", "-x", str(deb), str(root)])
        (root / ".unpacked").write_text("".join(f"{d}\n" for d in debs))
    return root, debs


def _input_digest(kernel: Kernel, python_debs: tuple[Path, ...], site: Path) -> str:
    digest = hashlib.sha256(f"{IGB_FORMAT}\0{kernel.version}\0".encode())
    for path in (*kernel.debs, *python_debs, Path(__file__).resolve(), HERE / "build_guest_image.py"):
        digest.update(f"{path.name}\0{sha256_file(path)}\0".encode())
    for name in SITE_PACKAGES:
        for path in sorted(_package_files(site, name)):
            digest.update(f"{path.relative_to(site)}\0{path.stat().st_size}\0{path.stat().st_mtime_ns}\0".encode())
    digest.update(repr((IGB_MODULES, SITE_PACKAGES, STDLIB_LEFT_OUT)).encode())
    return digest.hexdigest()


def _package_files(site: Path, name: str) -> list[Path]:
    top = site / name
    if top.is_dir():
        return [p for p in top.rglob("*") if p.is_file() and "__pycache__" not in p.parts]
    single = site / f"{name}.py"
    if single.is_file():
        return [single]
    raise IgbGuestError(f"{name} is not installed in this venv", site=str(site))


def _stage_python(py_root: Path, site: Path, stage: Path) -> list[str]:
    """Copy the interpreter, the trimmed stdlib and the venv libraries into ``stage``; returns what was left out."""
    left_out: list[str] = []
    (stage / "usr/bin").mkdir(parents=True)
    shutil.copy2(py_root / "usr/bin" / PYTHON, stage / "usr/bin" / PYTHON)
    (stage / "usr/bin/python3").symlink_to(PYTHON)
    stdlib_src = py_root / "usr/lib" / PYTHON
    shutil.copytree(stdlib_src, stage / "usr/lib" / PYTHON, symlinks=True,
                    ignore=shutil.ignore_patterns(*STDLIB_LEFT_OUT, "__pycache__"))  # fmt: skip
    dist = stage / GUEST_DIST
    dist.mkdir(parents=True)
    for name in SITE_PACKAGES:
        if (site / name).is_dir():
            shutil.copytree(site / name, dist / name, ignore=shutil.ignore_patterns("__pycache__", "tests"))
        else:
            shutil.copy2(site / f"{name}.py", dist / f"{name}.py")
    # An extension whose library this host cannot resolve would fail at import in the guest too: leave it out.
    for ext in sorted((stage / "usr/lib" / PYTHON / "lib-dynload").glob("*.so")):
        probe = subprocess.run(["ldd", str(ext)], capture_output=True, text=True, timeout=30, check=False)
        if "not found" in probe.stdout:
            ext.unlink()
            left_out.append(ext.name)
    # unchecked-hash: valid whatever mtime the cpio gives the sources; same magic for every 3.11.x
    run_tool([sys.executable, "-m", "compileall", "-q", "-j", "0", "--invalidation-mode", "unchecked-hash",
          "-s", str(stage), "-p", "/", str(stage / "usr/lib" / PYTHON), str(dist)], timeout=900)  # fmt: skip
    return left_out


def build_igb_archive(kernel: Kernel, py_root: Path, site: Path) -> bytes:
    """The appended cpio (gzip): igb modules, python + libraries, the runner and its inittab."""
    extra = Cpio()
    order = module_load_order(kernel.modules, IGB_MODULES)
    if not any(rel.endswith(("igb.ko", "igb.ko.xz", "igb.ko.zst")) for rel in order):
        raise IgbGuestError("the guest kernel has no igb module", kernel=kernel.version)
    # This archive's etc/modules.load replaces the base one: the igb guest needs no virtio/disk modules.
    loaded = []
    for rel in order:
        plain = re.sub(r"\.(xz|zst|gz)$", "", rel)
        extra.file(f"lib/modules/{kernel.version}/{plain}", decompress_module(kernel.modules / rel))
        loaded.append(plain)
    extra.file("etc/modules.load", "".join(f"{m}\n" for m in loaded).encode())
    extra.file("etc/inittab", INITTAB.encode())
    extra.file("etc/igb-sysinit", SYSINIT.encode(), 0o755)
    extra.file("etc/igb-run.py", RUNNER.encode())
    with tempfile.TemporaryDirectory(prefix="igb-stage-") as tmp:
        stage = Path(tmp)
        _stage_python(py_root, site, stage)
        (stage / GUEST_TOOLS).mkdir(parents=True)
        for tool in IGB_TOOLS:
            if not tool.exists():
                raise IgbGuestError(f"{tool} is missing on this host (apt install iproute2)", tool=str(tool))
            shutil.copy2(tool.resolve(), stage / GUEST_TOOLS / tool.name)
        libs: set[Path] = set()
        binaries = [stage / "usr/bin" / PYTHON, *stage.rglob("*.so"), *(stage / GUEST_TOOLS).iterdir()]
        for binary in binaries:
            libs.update(shared_libraries(binary))
        for lib in sorted(libs):
            if not str(lib).startswith(str(stage)):
                extra.file(str(lib).lstrip("/"), lib.resolve().read_bytes(), 0o755)
        for path in sorted(stage.rglob("*")):
            rel = str(path.relative_to(stage))
            if path.is_symlink():
                extra.symlink(rel, os.readlink(path))
            elif path.is_dir():
                extra.dir(rel)
            else:
                extra.file(rel, path.read_bytes(), 0o755 if os.access(path, os.X_OK) else 0o644)
    extra.dir("tmp")
    return gzip.compress(extra.render(), compresslevel=6, mtime=0)


@dataclass(frozen=True)
class IgbImage:
    kernel: Kernel
    initrd: Path  # the base lab initramfs + the igb archive (cached)
    qemu: BackportQemu


def ensure_igb_image(cache: Path = DEFAULT_CACHE) -> IgbImage:
    """The backported QEMU and the igb guest's initramfs for the current inputs, built when missing."""
    qemu = fetch_backport_qemu(cache)
    kernel = fetch_kernel(cache)
    py_root, py_debs = _python_root(cache)
    site = _venv_site_packages()
    key = _input_digest(kernel, py_debs, site)
    initrd = cache / "igb" / f"igb-initrd-{key[:24]}.gz"
    if not initrd.is_file():
        initrd.parent.mkdir(parents=True, exist_ok=True)
        data = build_initramfs(kernel) + build_igb_archive(kernel, py_root, site)
        staged = initrd.with_name(f".{initrd.name}.{os.getpid()}")
        staged.write_bytes(data)
        os.replace(staged, initrd)
        for old in sorted(initrd.parent.glob("igb-initrd-*.gz"), key=lambda p: p.stat().st_mtime)[:-2]:
            old.unlink(missing_ok=True)
    return IgbImage(kernel=kernel, initrd=initrd, qemu=qemu)


# ---------------------------------------------------------------------------
# One run
# ---------------------------------------------------------------------------


def job_archive(script: str, packages: Mapping[str, Path], timeout_s: float) -> bytes:
    """The per-run cpio: /job/job.py, /job/timeout and /job/pkg/<name> for each package directory, the jobs'
    own ``igb_jobs`` (their shared guest-side reads, :mod:`igb_jobs.guestsys`) always among them."""
    packages = {"igb_jobs": JOBS_PACKAGE, **packages}
    cpio = Cpio()
    cpio.file(f"{JOB_DIR}/job.py", script.encode())
    cpio.file(f"{JOB_DIR}/timeout", f"{timeout_s}".encode())
    for name, src in packages.items():
        for path in sorted(src.rglob("*")):
            if path.is_file() and "__pycache__" not in path.parts and path.suffix in (".py", ".json", ".typed"):
                cpio.file(f"{JOB_DIR}/pkg/{name}/{path.relative_to(src)}", path.read_bytes())
    return gzip.compress(cpio.render(), compresslevel=1, mtime=0)


# One boot, several jobs: the guest runs each as its own process, in order, and puts the PF back as the boot left
# it between them (no VFs, link down), so each job starts where it would on a boot of its own.
SEQUENCE = """import json, os, subprocess, sys, time
JOBS = json.loads(%r)
TIMEOUT_S = %r
from igb_jobs.guestsys import igb_pfs
def reset(pf):
    with open(f"/sys/class/net/{pf}/device/sriov_numvfs", "w") as fh:
        fh.write("0")
    subprocess.run(["/usr/local/sbin/ip", "link", "set", "dev", pf, "down"], check=True, timeout=30)
os.makedirs("/tmp/igb-jobs", exist_ok=True)
results = {}
for name, source in JOBS.items():
    path = f"/tmp/igb-jobs/{name}.py"
    with open(path, "w") as fh:
        fh.write(source)
    started = time.monotonic()
    try:
        done = subprocess.run([sys.executable, path], capture_output=True, text=True, timeout=TIMEOUT_S, cwd="/tmp/igb-jobs")
        rc, out, err = done.returncode, done.stdout, done.stderr
    except subprocess.TimeoutExpired as exc:
        rc, out, err = -9, str(exc.stdout or ""), f"{exc.stderr or ''}\\njob ran past its timeout"
    results[name] = {"rc": rc, "stdout": out, "stderr": err, "job_s": round(time.monotonic() - started, 1)}
    try:
        reset(igb_pfs()[0])
    except Exception as exc:  # the next job then starts where this one left the PF: say so in its result
        results[name]["stderr"] += f"\\nPF reset after the job failed: {exc!r}"
print(json.dumps(results))
"""


def sequence_script(jobs: Mapping[str, str], job_timeout_s: float = 300.0) -> str:
    """A guest script that runs ``jobs`` (name -> Python source) in order in one boot, each as its own process
    with ``job_timeout_s``, the PF reset between them (``sriov_numvfs`` 0, link down), and prints one JSON
    document: name -> {rc, stdout, stderr, job_s}. :func:`sequence_results` reads it back."""
    return SEQUENCE % (json.dumps(dict(jobs)), job_timeout_s)


def sequence_results(run: IgbRun) -> dict[str, IgbRun]:
    """Each job of a :func:`sequence_script` run as an :class:`IgbRun` of its own (``uptime_job_s``: its own
    time; the boot's fields shared)."""
    if run.rc != 0:
        raise IgbGuestError("the igb job sequence failed", rc=run.rc, stderr=run.stderr[-3000:])
    return {name: replace(run, rc=out["rc"], stdout=out["stdout"], stderr=out["stderr"], uptime_job_s=out["job_s"])
            for name, out in run.json().items()}


def qemu_argv(image: IgbImage, initrd: Path, console: Path, result: Path, memory_mib: int = 768,
              smp: int = 1, root_port: bool = False, trace: Sequence[str] = (), trace_log: Path | None = None,
              append: str = "") -> list[str]:
    """q35, TCG, direct kernel boot, two serial ports; the igb on the root complex or behind a root port.

    ``root_port``: the igb behind a ``pcie-root-port`` (a PCIe endpoint with ARI, its VFs at devfn +0x80 on the
    port's bus) instead of an integrated endpoint on ``pcie.0``. ``trace``: QEMU trace-event patterns
    (``igb_*``, ``e1000e_core_*``...), logged to ``trace_log`` (QEMU's log backend, ``-D``).
    """
    topology = ["-device", "pcie-root-port,id=rp0,chassis=1,slot=1"] if root_port else []
    bus = ",bus=rp0" if root_port else ""
    tracing: list[str] = []
    for pattern in trace:
        tracing += ["-trace", pattern]
    if trace and trace_log is not None:
        tracing += ["-D", str(trace_log)]
    return [
        *image.qemu.argv_prefix(),
        "-machine", "q35", "-accel", "tcg", "-cpu", "max", "-m", str(memory_mib), "-smp", str(smp),
        "-nodefaults", "-no-user-config", "-display", "none", "-no-reboot",
        "-kernel", str(image.kernel.vmlinuz), "-initrd", str(initrd),
        "-append", f"console=ttyS0 panic=-1 loglevel=4 {append}".strip(),
        "-serial", f"file:{console}", "-serial", f"file:{result}",
        # The PF's uplink: user networking with no route out (restrict=on); the VFs switch inside the model.
        "-netdev", "user,id=fab0,restrict=on",
        *topology,
        "-device", f"igb,netdev=fab0,mac={IGB_MAC},romfile={bus}",
        *tracing,
    ]  # fmt: skip


def run_in_igb_guest(
    script: str,
    *,
    workdir: Path,
    packages: Mapping[str, Path] | None = None,
    cache: Path = DEFAULT_CACHE,
    timeout_s: float = 600.0,
    smp: int = 1,
    root_port: bool = False,
    trace: Sequence[str] = (),
    append: str = "",
) -> IgbRun:
    """Boot the igb guest, run ``script`` (Python, as root, with ``packages`` on its path), return its output.

    QEMU is killed by PID before this returns, whatever happens (the guest powers off by itself after
    the job; the kill is for a job or boot that never ends).
    ``smp``: vCPUs. A job that brings ``igbvf`` up wants 2: the VF driver busy-waits for the PF's mailbox
    answer, which the PF driver's interrupt handler can only give on another vCPU.
    ``root_port``, ``trace``, ``append``: see :func:`qemu_argv` (``append``: extra kernel command line); the
    trace lands in ``workdir/qemu-trace.log``.
    """
    image = ensure_igb_image(cache)
    workdir.mkdir(parents=True, exist_ok=True)
    job_timeout = max(timeout_s - 120.0, 30.0)  # leave the boot its share of the deadline
    initrd = workdir / "initrd-job.gz"
    initrd.write_bytes(image.initrd.read_bytes() + job_archive(script, packages or {}, job_timeout))
    console, result = workdir / "console.log", workdir / "result.log"
    argv = qemu_argv(image, initrd, console, result, smp=smp, root_port=root_port, trace=trace,
                     trace_log=workdir / "qemu-trace.log", append=append)  # fmt: skip
    started = time.monotonic()
    with open(workdir / "qemu.out", "wb") as out:
        proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)  # fmt: skip
    try:
        try:
            proc.wait(timeout=timeout_s)  # the guest powers off after writing its result
        except subprocess.TimeoutExpired:
            pass
        wall = time.monotonic() - started
    finally:
        if proc.poll() is None:
            proc.kill()  # by PID: this QEMU only
            proc.wait(timeout=30)
    console_text = console.read_text(errors="replace") if console.exists() else ""
    line = next((ln for ln in (result.read_text(errors="replace") if result.exists() else "").splitlines()
                 if ln.startswith(RESULT_MARK)), None)  # fmt: skip
    if line is None:
        qemu_out = (workdir / "qemu.out").read_text(errors="replace")
        raise IgbGuestError("the igb guest gave no result", returncode=proc.returncode, wall_s=round(wall, 1),
                            qemu=qemu_out[-2000:], console=console_text[-4000:], argv=argv)  # fmt: skip
    answer = json.loads(line.removeprefix(RESULT_MARK).strip())
    booted = re.search(rf"{BOOT_MARK} kernel=\S+ uptime=([\d.]+)", console_text)
    return IgbRun(
        rc=answer["rc"], stdout=answer["stdout"], stderr=answer["stderr"], wall_s=wall,
        uptime_booted_s=float(booted.group(1)) if booted else -1.0,
        uptime_job_s=answer["uptime_job_end"] - answer["uptime_job_start"],
        kernel_version=image.kernel.version, qemu_version=image.qemu.version, console=console_text,
        argv=tuple(argv),
    )  # fmt: skip


if __name__ == "__main__":  # exploration: run a script file (or a one-liner) in the guest and print its output
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("script", help="a Python file to run in the guest, or '-c CODE'")
    parser.add_argument("--cache", type=Path, default=DEFAULT_CACHE)
    parser.add_argument("--keep", type=Path, help="work directory to keep (console, result, qemu output)")
    parser.add_argument("--smp", type=int, default=1, help="vCPUs [%(default)s]")
    parser.add_argument("--root-port", action="store_true", help="the igb behind a pcie-root-port")
    parser.add_argument("--trace", action="append", default=[], help="QEMU trace pattern (repeatable)")
    parser.add_argument("--append", default="", help="extra guest kernel command line")
    args = parser.parse_args()
    code = Path(args.script).read_text() if Path(args.script).is_file() else args.script
    work = args.keep or Path(tempfile.mkdtemp(prefix="igb-guest-"))
    run = run_in_igb_guest(code, workdir=work, cache=args.cache, smp=args.smp, root_port=args.root_port,
                           trace=args.trace, append=args.append)  # fmt: skip
    print(f"rc={run.rc} wall={run.wall_s:.1f}s booted_at={run.uptime_booted_s}s job={run.uptime_job_s:.1f}s "
          f"kernel={run.kernel_version} qemu={run.qemu_version}")  # fmt: skip
    print(run.stdout)
    print(run.stderr, file=sys.stderr)
