"""``host/vm/virsh.py``: libvirt's read-only answers through a real ``virsh -r`` child equal the binding's own (the
test driver in-process and in the child, and a libvirtd socket that is not there); no virsh is "ask in-process"."""

from __future__ import annotations

import asyncio

import libvirt
import pytest

from gpuaas_agent.host.run import Completed
from gpuaas_agent.host.vm import virsh

UNREACHABLE = "qemu+unix:///system?socket=/nonexistent/libvirt-sock"


def _empty_driver(tmp_path) -> str:
    path = tmp_path / "no-domains.xml"
    path.write_text("<node>\n</node>\n")
    return f"test://{path}"


def test_the_version_is_the_number_the_binding_gives():
    answer = asyncio.run(virsh.read_version("test:///default", timeout=30))
    conn = libvirt.openReadOnly("test:///default")
    try:
        assert answer == virsh.VersionAnswer(lib_version=conn.getLibVersion())
    finally:
        conn.close()


def test_a_libvirtd_that_is_not_there_is_refused_with_libvirts_own_message():
    answer = asyncio.run(virsh.read_version(UNREACHABLE, timeout=30))
    libvirt.registerErrorHandler(lambda _ctx, _err: None, None)
    with pytest.raises(libvirt.libvirtError) as refused:
        libvirt.openReadOnly(UNREACHABLE)
    assert answer == virsh.VersionAnswer(connected=False, error=refused.value.get_error_message())


def test_the_domain_names_are_every_domain_and_none_on_a_libvirt_without_one(tmp_path):
    assert asyncio.run(virsh.domain_names("test:///default", timeout=30)) == ["test"]  # the test driver's own
    assert asyncio.run(virsh.domain_names(_empty_driver(tmp_path), timeout=30)) == []
    assert asyncio.run(virsh.domain_names(UNREACHABLE, timeout=30)) is None  # not an answer: ask in-process


def test_without_virsh_nothing_is_answered(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))  # an empty directory: no virsh to run
    assert asyncio.run(virsh.read_version("test:///default", timeout=30)) is None
    assert asyncio.run(virsh.domain_names("test:///default", timeout=30)) is None


def test_a_version_output_without_the_daemons_line_is_no_version():
    done = Completed(argv=("virsh",), returncode=0, stdout=b"Compiled against library: libvirt 9.0.0\n", stderr=b"")
    assert virsh.version_answer(done) == virsh.VersionAnswer(error="virsh version printed no daemon version")
    failed = Completed(argv=("virsh",), returncode=1, stdout=b"", stderr=b"error: internal error: broken\n")
    assert virsh.version_answer(failed) == virsh.VersionAnswer(connected=True, error="internal error: broken")
