"""The dnsmasq driver: reservations in a hosts file it owns, refusals, junk kept, locking, SIGHUP, real DHCP."""

from __future__ import annotations

import multiprocessing
import os
import threading
from ipaddress import IPv4Address, IPv4Network
from pathlib import Path

import pytest

from gpuaas_agent.contract.dhcp import LeaseState, Reservation
from gpuaas_agent.host.network.dnsmasq import (
    DnsmasqError,
    DnsmasqReservations,
    ReservationRefused,
    lease_status,
    make_reservation,
    parse_leases,
    stale_reservations,
)
from tests.support.dnsmasq_fixture import DhcpLab

SUBNET = IPv4Network("10.100.0.0/24")
GATEWAY = IPv4Address("10.100.0.1")
A1 = "1111aaaa-2222-4333-8444-555555555555"
A2 = "22222222-3333-4444-8555-666666666666"
A3 = "33333333-4444-4555-8666-777777777777"


def res(allocation_id: str = A1, slot: int = 0, mac: str = "52:54:00:00:00:0a", ip: str = "10.100.0.10",
        hostname: str = "slice-a") -> Reservation:
    return make_reservation(allocation_id, slot, mac, ip, hostname)


def driver(tmp_path: Path, pid_file: Path | None = None) -> DnsmasqReservations:
    return DnsmasqReservations(tmp_path / "dhcp-hosts", SUBNET, GATEWAY, pid_file)


# -- the file ------------------------------------------------------------------------------------------------


def test_reservation_line_names_its_owner_and_survives_an_agent_restart(tmp_path):
    d = driver(tmp_path)
    assert d.add(res()) is True
    assert d.add(res(A2, 3, "52:54:00:00:00:0b", "10.100.0.11", "slice-b")) is True
    text = d.hosts_file.read_text()
    assert text == (
        f"52:54:00:00:00:0a,10.100.0.10,slice-a # gpuaas allocation={A1} slot=0\n"
        f"52:54:00:00:00:0b,10.100.0.11,slice-b # gpuaas allocation={A2} slot=3\n"
    )
    assert oct(d.hosts_file.stat().st_mode & 0o777) == "0o644"
    fresh = driver(tmp_path)  # no state but the file
    assert fresh.reservations() == [res(), res(A2, 3, "52:54:00:00:00:0b", "10.100.0.11", "slice-b")]
    assert fresh.junk_lines() == []


def test_adding_the_same_reservation_twice_changes_nothing(tmp_path):
    d = driver(tmp_path)
    assert d.add(res()) is True
    before = d.hosts_file.stat()
    assert d.add(res()) is False
    after = d.hosts_file.stat()
    assert (before.st_ino, before.st_mtime_ns) == (after.st_ino, after.st_mtime_ns)


def test_upper_case_mac_is_stored_lower_case(tmp_path):
    assert res(mac="52:54:00:AB:CD:EF").mac == "52:54:00:ab:cd:ef"


@pytest.mark.parametrize("mac", ["52:54:00:00:00", "52-54-00-00-00-0a", "52:54:00:00:00:0g", "5254.0000.000a", "",
                                 "01:00:5e:00:00:01", "ff:ff:ff:ff:ff:ff", "00:00:00:00:00:00"])
def test_malformed_or_non_unicast_mac_is_refused(mac):
    with pytest.raises(ReservationRefused) as exc:
        res(mac=mac)
    assert exc.value.code == "bad_mac"
    assert exc.value.evidence["mac"] == mac.lower() or exc.value.evidence["mac"] == mac


@pytest.mark.parametrize("hostname", ["-slice", "slice-", "slice_a", "slice.a", "a" * 64, "", "slice a", "slicé"])
def test_hostname_that_is_not_a_dns_label_is_refused(hostname):
    with pytest.raises(ReservationRefused) as exc:
        res(hostname=hostname)
    assert exc.value.code == "bad_hostname"


@pytest.mark.parametrize("ip", ["10.100.0.256", "10.100.0", "fe80::1", "10.100.0.10/24", " 10.100.0.10"])
def test_malformed_ip_is_refused(ip):
    with pytest.raises(ReservationRefused) as exc:
        res(ip=ip)
    assert exc.value.code == "bad_ip"


@pytest.mark.parametrize("allocation_id,slot,code", [("not-a-uuid", 0, "bad_allocation_id"),
                                                     (A1.upper(), 0, "bad_allocation_id"),
                                                     (A1, 256, "bad_slot_index"), (A1, -1, "bad_slot_index")])
def test_bad_allocation_or_slot_is_refused(allocation_id, slot, code):
    with pytest.raises(ReservationRefused) as exc:
        res(allocation_id=allocation_id, slot=slot)
    assert exc.value.code == code


@pytest.mark.parametrize("ip,code,role", [
    ("10.100.1.10", "ip_outside_subnet", None), ("192.168.0.10", "ip_outside_subnet", None),
    ("10.100.0.0", "ip_reserved", "network"), ("10.100.0.1", "ip_reserved", "gateway"),
    ("10.100.0.255", "ip_reserved", "broadcast"),
])
def test_address_the_subnet_cannot_give_is_refused_and_nothing_is_written(tmp_path, ip, code, role):
    d = driver(tmp_path)
    d.add(res(A2, 0, "52:54:00:00:00:0b", "10.100.0.11", "slice-b"))
    before = d.hosts_file.read_bytes()
    with pytest.raises(ReservationRefused) as exc:
        d.add(res(ip=ip))
    assert exc.value.code == code
    assert exc.value.evidence.get("role") == role
    assert d.hosts_file.read_bytes() == before


def test_gateway_outside_the_subnet_is_a_configuration_error(tmp_path):
    with pytest.raises(ValueError):
        DnsmasqReservations(tmp_path / "h", SUBNET, IPv4Address("10.0.0.1"))


@pytest.mark.parametrize("other,code", [
    (dict(allocation_id=A2, slot=0, mac="52:54:00:00:00:0a", ip="10.100.0.20", hostname="slice-z"), "mac_in_use"),
    (dict(allocation_id=A2, slot=0, mac="52:54:00:00:00:0c", ip="10.100.0.10", hostname="slice-z"), "ip_in_use"),
    (dict(allocation_id=A2, slot=0, mac="52:54:00:00:00:0c", ip="10.100.0.20", hostname="SLICE-A"), "hostname_in_use"),
    (dict(allocation_id=A1, slot=1, mac="52:54:00:00:00:0a", ip="10.100.0.20", hostname="slice-z"), "mac_in_use"),
    (dict(allocation_id=A1, slot=0, mac="52:54:00:00:00:0c", ip="10.100.0.20", hostname="slice-z"), "slot_reserved"),
])
def test_conflicting_reservation_is_refused_and_the_existing_one_kept(tmp_path, other, code):
    d = driver(tmp_path)
    d.add(res())
    before = d.hosts_file.read_bytes()
    with pytest.raises(ReservationRefused) as exc:
        d.add(res(**other))
    assert exc.value.code == code
    assert d.hosts_file.read_bytes() == before
    assert d.reservations() == [res()]


HAND_EDITED = (
    "# written by an operator\n"
    "\n"
    "junk line here\n"
    "52:54:00:00:00:99,10.100.0.99,manual-box\n"
    f"zz:54:00:00:00:0e,10.100.0.14,slice-broken # gpuaas allocation={A3} slot=0\n"
    "# gpuaas reservations follow (an operator's comment, not a damaged line)\n"
    "\xff\xfe not utf-8 \x00 \x0c \r\n"
)


def _write_hand_edited(path: Path) -> bytes:
    data = HAND_EDITED.encode("latin-1")
    path.write_bytes(data[:-1])  # and no final newline
    return data


def test_hand_edited_junk_is_reported_and_kept_verbatim_through_add_and_remove(tmp_path):
    d = driver(tmp_path)
    original = _write_hand_edited(d.hosts_file)
    report = d.report()
    assert report.reservations == []
    assert report.foreign_lines == ["52:54:00:00:00:99,10.100.0.99,manual-box"]
    assert [(j.line_number, j.reason.split(":")[0]) for j in report.junk] == [
        (3, "neither a MAC nor an IPv4 address"), (5, "bad_mac"), (7, "neither a MAC nor an IPv4 address")]
    assert report.junk[0].text == "junk line here"

    assert d.add(res()) is True
    assert d.add(res(A2, 0, "52:54:00:00:00:0b", "10.100.0.11", "slice-b")) is True
    data = d.hosts_file.read_bytes()
    assert data.startswith(original)  # every old byte kept, in order
    assert d.remove(A1) == [res()]
    assert d.remove(A2, 0) == [res(A2, 0, "52:54:00:00:00:0b", "10.100.0.11", "slice-b")]
    assert d.hosts_file.read_bytes() == original
    assert [j.line_number for j in d.junk_lines()] == [3, 5, 7]


def test_lines_the_agent_did_not_write_still_block_their_mac_ip_and_name(tmp_path):
    d = driver(tmp_path)
    _write_hand_edited(d.hosts_file)
    for kwargs, code in [(dict(mac="52:54:00:00:00:99"), "mac_in_use"), (dict(ip="10.100.0.99"), "ip_in_use"),
                         (dict(hostname="manual-box"), "hostname_in_use"),
                         (dict(ip="10.100.0.14"), "ip_in_use")]:  # the damaged line of ours still holds its IP
        with pytest.raises(ReservationRefused) as exc:
            d.add(res(**kwargs))
        assert exc.value.code == code, kwargs


def test_remove_takes_one_slot_or_the_whole_allocation_and_never_another_allocation(tmp_path):
    d = driver(tmp_path)
    a1s0, a1s1 = res(A1, 0), res(A1, 1, "52:54:00:00:01:0a", "10.100.0.20", "slice-a1")
    a2 = res(A2, 0, "52:54:00:00:00:0b", "10.100.0.11", "slice-b")
    for r in (a1s0, a2, a1s1):
        d.add(r)
    assert d.remove(A1, 1) == [a1s1]
    assert d.reservations() == [a1s0, a2]
    assert d.remove(A3) == []
    before = d.hosts_file.stat()
    assert d.remove(A1, 7) == []
    assert d.hosts_file.stat().st_ino == before.st_ino  # nothing removed: not rewritten
    assert d.remove(A1) == [a1s0]
    assert d.reservations() == [a2]


def test_stale_reservations_are_those_of_allocations_no_longer_live(tmp_path):
    d = driver(tmp_path)
    d.add(res(A1))
    d.add(res(A2, 0, "52:54:00:00:00:0b", "10.100.0.11", "slice-b"))
    assert [r.allocation_id for r in stale_reservations(driver(tmp_path).reservations(), {A2})] == [A1]


def _add_in_child(hosts_file: str, index: int) -> None:
    d = DnsmasqReservations(Path(hosts_file), SUBNET, GATEWAY)
    d.add(make_reservation(A1, index, f"52:54:00:00:02:{index:02x}", f"10.100.0.{100 + index}", f"slice-{index}"))


def test_concurrent_adds_from_processes_and_threads_lose_nothing(tmp_path):
    d = driver(tmp_path)
    _write_hand_edited(d.hosts_file)
    ctx = multiprocessing.get_context("fork")
    procs = [ctx.Process(target=_add_in_child, args=(str(d.hosts_file), i)) for i in range(12)]
    threads = [threading.Thread(target=_add_in_child, args=(str(d.hosts_file), i)) for i in range(12, 24)]
    for worker in (*procs, *threads):
        worker.start()
    for p in procs:
        p.join(60)
        assert p.exitcode == 0
    for t in threads:
        t.join(60)
        assert not t.is_alive()
    assert sorted(r.slot_index for r in d.reservations()) == list(range(24))
    assert d.hosts_file.read_bytes().startswith(HAND_EDITED.encode("latin-1"))
    assert not [p for p in tmp_path.iterdir() if p.name.endswith(".tmp")]


# -- SIGHUP ----------------------------------------------------------------------------------------------------


def test_reload_without_a_pid_file_is_a_typed_error(tmp_path):
    with pytest.raises(DnsmasqError) as exc:
        driver(tmp_path, tmp_path / "missing.pid").reload()
    assert exc.value.code == "dnsmasq_not_running"
    with pytest.raises(DnsmasqError) as exc:
        driver(tmp_path).reload()
    assert exc.value.code == "dnsmasq_pid_unknown"


def test_reload_refuses_a_pid_file_with_junk(tmp_path):
    (tmp_path / "dnsmasq.pid").write_text("12ab\n")
    with pytest.raises(DnsmasqError) as exc:
        driver(tmp_path, tmp_path / "dnsmasq.pid").reload()
    assert exc.value.code == "dnsmasq_pid_unknown"


def test_reload_never_signals_a_process_that_is_not_dnsmasq(tmp_path):
    pid_file = tmp_path / "dnsmasq.pid"
    pid_file.write_text(f"{os.getpid()}\n")  # this pytest: a SIGHUP would kill the test run
    with pytest.raises(DnsmasqError) as exc:
        driver(tmp_path, pid_file).reload()
    assert exc.value.code == "pid_not_dnsmasq"
    assert exc.value.evidence["pid"] == os.getpid()


# -- lease file ------------------------------------------------------------------------------------------------

NOW = 1_800_000_000
LEASES = (
    f"{NOW + 3600} 52:54:00:00:00:0a 10.100.0.10 slice-a 01:52:54:00:00:00:0a\n"
    f"{NOW + 3600} 52:54:00:00:00:0b 10.100.0.50 * *\n"
    f"{NOW - 10} 52:54:00:00:00:0c 10.100.0.12 slice-c *\n"
    f"0 52:54:00:00:00:0d 10.100.0.13 slice-d *\n"
    f"{NOW + 3600} 52:54:00:00:00:ee 10.100.0.14 stale *\n"
    "duid 00:01:00:01:2c:aa:bb:cc:52:54:00:00:00:01\n"
    f"{NOW + 3600} 1234 fd00::10 * 00:01:00:01\n"
    f"{NOW + 3600} 52:54:00:00:00:0f 10.1"  # torn: dnsmasq rewrites this file in place
)


def test_lease_file_is_parsed_and_foreign_lines_skipped(tmp_path):
    (tmp_path / "leases").write_text(LEASES)
    leases = parse_leases(tmp_path / "leases")
    assert [(ls.mac, str(ls.ip), ls.hostname) for ls in leases] == [
        ("52:54:00:00:00:0a", "10.100.0.10", "slice-a"), ("52:54:00:00:00:0b", "10.100.0.50", None),
        ("52:54:00:00:00:0c", "10.100.0.12", "slice-c"), ("52:54:00:00:00:0d", "10.100.0.13", "slice-d"),
        ("52:54:00:00:00:ee", "10.100.0.14", "stale")]
    assert leases[0].client_id == "01:52:54:00:00:00:0a" and leases[1].client_id is None
    assert parse_leases(tmp_path / "absent") == []


@pytest.mark.parametrize("mac,ip,state,actual,conflict", [
    ("52:54:00:00:00:0a", "10.100.0.10", "bound", "10.100.0.10", None),
    ("52:54:00:00:00:0b", "10.100.0.11", "wrong_ip", "10.100.0.50", None),
    ("52:54:00:00:00:0c", "10.100.0.12", "expired", "10.100.0.12", None),
    ("52:54:00:00:00:0d", "10.100.0.13", "bound", "10.100.0.13", None),  # expires 0: infinite
    ("52:54:00:00:00:0e", "10.100.0.14", "missing", None, "52:54:00:00:00:ee"),
    ("52:54:00:00:00:0f", "10.100.0.15", "missing", None, None),
])
def test_lease_status_names_the_state_and_what_was_seen(tmp_path, mac, ip, state, actual, conflict):
    (tmp_path / "leases").write_text(LEASES)
    status = lease_status(tmp_path / "leases", mac.upper(), ip, now=NOW)
    assert status.lease_state == LeaseState(state)
    assert status.mac == mac
    assert (str(status.actual_ip) if status.actual_ip else None) == actual
    assert status.conflicting_mac == conflict


# -- the real dnsmasq ------------------------------------------------------------------------------------------


def test_reserved_mac_gets_exactly_its_ip_from_real_dnsmasq_and_loses_it_on_release(dhcp_lab: DhcpLab):
    lab = dhcp_lab
    dns = lab.dnsmasq
    dns.hosts_file.write_text("# operator note\njunk line here\n")  # dnsmasq must keep serving around junk
    d = DnsmasqReservations(dns.hosts_file, dns.subnet, dns.gateway, dns.pid_file)
    mine = make_reservation(A1, 0, "52:54:00:12:34:56", "10.100.0.10", "slice-a")
    other = make_reservation(A2, 1, "52:54:00:12:34:57", "10.100.0.11", "slice-b")
    assert d.add(other) and d.add(mine)
    before = dns.reads()
    assert d.reload() == dns.proc.pid
    dns.wait_reread(before)

    lab.set_client_mac(mine.mac)
    assert lab.lease() == "10.100.0.10"
    status = lease_status(dns.lease_file, mine.mac, mine.ip)
    assert status.lease_state == LeaseState.bound and str(status.actual_ip) == "10.100.0.10"
    assert [r.allocation_id for r in d.reservations()] == [A2, A1]

    # a MAC nobody reserved gets nothing: the range is static
    lab.set_client_mac("52:54:00:12:34:99")
    assert lab.lease(tries=2) is None

    # released: the other allocation's reservation stays and dnsmasq still serves it
    assert d.remove(A1) == [mine]
    before = dns.reads()
    d.reload()
    dns.wait_reread(before)
    assert d.reservations() == [other]
    assert [j.text for j in d.junk_lines()] == ["junk line here"]
    lab.set_client_mac(other.mac)
    assert lab.lease() == "10.100.0.11"
    lab.set_client_mac(mine.mac)
    assert lab.lease(tries=2) is None, "a released reservation must not be served after SIGHUP"
    assert dns.proc.poll() is None, "SIGHUP must not stop dnsmasq"
