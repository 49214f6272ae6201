"""``gpuaas-agent`` command line: one subcommand per job, heavy imports only where needed.

Exit codes, every command: 0 ok, 1 the check or job ran and failed, 2 usage or
input error (an unknown flag, a ``--root`` that does not exist, a bad config), 3
environment error (NATS unreachable, state unreadable, not enrolled, a file the
agent cannot open), 130 interrupted (Ctrl-C). ``discover`` and
``parity``/``preflight`` say whether the host is usable: discover exits 1 when
no candidate slot is ready, parity 1 when any hard check FAILs; ``status`` exits
1 when the host is degraded and 3 when it is broken. Every error is one line on
stderr, ``gpuaas-agent: error: <code>: <message>``; ``--debug`` adds the traceback.
"""

from __future__ import annotations

import argparse
import ipaddress
import sqlite3
import sys
import traceback
from pathlib import Path

from gpuaas_agent import __version__
from gpuaas_agent.errors import AgentError
from gpuaas_agent.exitcodes import EXIT_ENVIRONMENT, EXIT_FAILED, EXIT_INTERRUPTED, EXIT_OK, EXIT_USAGE, exit_code_for

DEFAULT_CONFIG = Path("/etc/gpuaas-agent/agent.toml")


class _Parser(argparse.ArgumentParser):
    """argparse, with its errors as one line (``usage: ...``), exit 2; ``--help`` as usual."""

    def error(self, message: str):
        self.exit(EXIT_USAGE, f"gpuaas-agent: error: usage: {self.prog}: {message} (see --help)\n")


def _subnet(value: str) -> ipaddress.IPv4Network:
    try:
        return ipaddress.IPv4Network(value, strict=True)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"not an IPv4 subnet: {exc}") from exc


def _parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="gpuaas-agent", description=__doc__.splitlines()[0])
    parser.add_argument("--version", action="version", version=f"gpuaas-agent {__version__}")
    parser.add_argument("--debug", action="store_true", help="print the traceback of an error (default: one line)")
    sub = parser.add_subparsers(dest="command", required=True)

    discover = sub.add_parser("discover", help="report GPU/NVMe/fabric topology and candidate slots")
    discover.add_argument("--root", default="/", help="host root: / (live) or a recorded fixture directory")
    discover.add_argument("--json", action="store_true", help="print the full report as JSON")
    discover.add_argument("--subnet", type=_subnet, default=ipaddress.IPv4Network("10.100.0.0/24"),
                          help="slice private subnet for IP suggestions (default 10.100.0.0/24)")
    discover.add_argument("--ovs-bridge", default="ovsbr0", help="OVS bridge slots attach to (default ovsbr0)")

    run = sub.add_parser("run", help="the daemon: claim tasks over NATS JetStream and run them")
    run.add_argument("--config", type=Path, default=DEFAULT_CONFIG, help=f"agent config (default {DEFAULT_CONFIG})")

    enroll = sub.add_parser("enroll", help="enroll this host with its bootstrap token (idempotent)")
    enroll.add_argument("--config", type=Path, default=DEFAULT_CONFIG, help=f"agent config (default {DEFAULT_CONFIG})")
    enroll.add_argument("--token-file", type=Path, default=None, help="bootstrap token file (default from the config)")

    for name, text in (("preflight", "check every slice-host prerequisite (seed 002 Phase 5)"),
                       ("parity", "slice-host parity check: one GPUAAS_SLICE_PARITY line per condition")):
        check = sub.add_parser(name, help=text)
        check.add_argument("--root", default="/", help="host root: / (live) or a recorded fixture directory")
        check.add_argument("--json", action="store_true", help="print the report as JSON")
        check.add_argument("--subnet", type=_subnet, default=ipaddress.IPv4Network("10.100.0.0/24"),
                           help="slice private subnet (default 10.100.0.0/24)")
        check.add_argument("--ovs-bridge", default="ovsbr0", help="OVS bridge owning the gateway (default ovsbr0)")
        check.add_argument("--netns", default=None, help="read the network of this namespace (live host only)")
        check.add_argument("--ovsdb-socket", default=None, help="OVSDB socket (default $OVS_RUNDIR/db.sock or /run/openvswitch/db.sock)")
        check.add_argument("--libvirt-socket", action="append", default=None, help="libvirt socket to probe (repeatable)")
        check.add_argument("--config", type=Path, default=None,
                           help="agent config whose [slice] gives the dnsmasq hosts/pid files and the seed dir "
                                "(default: built-in defaults)")
        check.add_argument("--dnsmasq-hosts-file", type=Path, default=None,
                           help="the reservations file a running dnsmasq must read (default [slice].dnsmasq_hosts_file)")
        check.add_argument("--seed-dir", type=Path, default=None, help="where seed ISOs go (default [slice].seed_dir)")
        check.add_argument("--runtime-profile", action="append", default=None,
                           help="runtime profile this host runs (repeatable; default h200_1g_24c_64g)")

    status = sub.add_parser("status", help="what this host is doing and whether it is healthy (no NATS needed)")
    status.add_argument("--config", type=Path, default=DEFAULT_CONFIG, help=f"agent config (default {DEFAULT_CONFIG})")
    status.add_argument("--json", action="store_true", help="print the report as JSON")
    status.add_argument("--no-checks", action="store_true",
                        help="show the daemon's last health checks instead of running them now")

    maint = sub.add_parser("maintenance", help="put this host in maintenance (no new slices) or take it out")
    maint.add_argument("mode", choices=("on", "off"), help="on: refuse new provisions and plans; off: take them again")
    maint.add_argument("--reason", required=True, help="why (one printable line, at most 500 characters)")
    maint.add_argument("--config", type=Path, default=DEFAULT_CONFIG, help=f"agent config (default {DEFAULT_CONFIG})")
    maint.add_argument("--json", action="store_true", help="print the state and the drain as JSON")

    record = sub.add_parser("record-fixture", help="snapshot what discovery reads into a fixture directory")
    record.add_argument("out", type=Path, help="new, empty output directory (with --archive: new NAME.tar.xz file)")
    record.add_argument("--root", default="/", help="host root to record (default: the live host)")
    record.add_argument("--archive", action="store_true",
                        help="write one deterministic .tar.xz (what fixtures/hosts/ keeps) instead of a directory")

    cloud_init = sub.add_parser("cloud-init", help="cloud-init user-data that installs, enrolls and enables the agent")
    cloud_init_sub = cloud_init.add_subparsers(dest="cloud_init_command", required=True)
    render = cloud_init_sub.add_parser("render", help="render #cloud-config user-data from a JSON inputs file")
    render.add_argument("inputs", type=Path, help="JSON: package_url, package_sha256, bootstrap_token, nats_url, maas_tags")
    render.add_argument("--out", type=Path, default=None, help="write here (0600) instead of stdout")

    prepare = sub.add_parser("prepare-host",
                             help="create the directories and terminal relay key a provision needs (idempotent)")
    prepare.add_argument("--config", type=Path, default=DEFAULT_CONFIG, help=f"agent config (default {DEFAULT_CONFIG})")
    prepare.add_argument("--check", action="store_true",
                         help="write nothing: verify everything exists and the agent can write where it must")
    prepare.add_argument("--sysfs-dropin", type=Path, default=None, metavar="PATH",
                         help="also write the unit drop-in opening the sysfs files the slots' devices need "
                              "(with --check: report whether they are writable here)")

    baseline = sub.add_parser("network-baseline",
                              help="converge ovsbr0 + gateway, dnsmasq subnet config, NAT, ip_forward (idempotent)")
    baseline.add_argument("--config", type=Path, default=None,
                          help=f"agent config whose [slice] gives bridge, subnet, gateway, ovsdb and dnsmasq hosts file "
                               f"(default {DEFAULT_CONFIG} when it exists, else built-in defaults); flags override it")
    baseline.add_argument("--bridge", default=None, help="OVS bridge of the slice subnet (default ovsbr0)")
    baseline.add_argument("--gateway", default=None, help="bridge address and subnet (default 10.100.0.1/24)")
    baseline.add_argument("--dnsmasq-conf", type=Path, default=Path("/etc/dnsmasq.d/gpuaas-slice-network.conf"),
                          help="dnsmasq subnet config file to write")
    baseline.add_argument("--dhcp-hostsfile", type=Path, default=None,
                          help="the agent's reservations file (default [slice].dnsmasq_hosts_file)")
    baseline.add_argument("--ovs-remote", default=None, help="ovsdb remote (default [slice].ovsdb_remote)")
    baseline.add_argument("--datapath-type", default=None, help="datapath of a bridge it creates (netdev without the kernel module)")
    baseline.add_argument("--no-nat", action="store_true", help="leave NAT alone (public NAT or overlay sites)")
    baseline.add_argument("--tmfifo", action="store_true", help="also converge tmfifo_net0 (BF3 RShim) when present")
    baseline.add_argument("--json", action="store_true", help="print the report as JSON")
    return parser


def _print_human(report) -> None:
    """One summary line (the seed's format), then one line per slot and per finding."""
    print(report.summary.as_line())
    for slot in report.candidate_slots:
        blockers = ",".join(b.code for b in slot.blockers) or "none"
        print(
            f"slot={slot.slot_index} gpu={slot.gpu_pci_address} nvme={slot.nvme_device or '-'} "
            f"fabric_vf={slot.fabric_vf_pci_address or '-'} mac={slot.mac} ip={slot.private_ip or '-'} "
            f"numa={slot.numa_node if slot.numa_node is not None else '-'} blockers={blockers}"
        )
    for finding in report.blockers:
        print(f"blocker code={finding.code} detail={finding.detail!r}")
    for finding in report.warnings:
        print(f"warning code={finding.code} path={finding.path or '-'} detail={finding.detail!r}")


def _cmd_discover(args: argparse.Namespace) -> int:
    from gpuaas_agent.discovery.report import discover
    from gpuaas_agent.discovery.slots import PlanConfig
    from gpuaas_agent.hostfs import HostRoot

    report = discover(HostRoot.open(args.root), PlanConfig(subnet=args.subnet, ovs_bridge=args.ovs_bridge))
    if args.json:
        print(report.model_dump_json(indent=2))
    else:
        _print_human(report)
    # Usable means at least one slot the control plane could approve now.
    return EXIT_OK if report.summary.ready_candidate_slots > 0 else EXIT_FAILED


def _cmd_parity(args: argparse.Namespace) -> int:
    """Exit 0 when no hard check FAILs, 1 when one does, 2 when the question itself is wrong."""
    from gpuaas_agent.config import SliceConfig, load_config
    from gpuaas_agent.contract.runtime import get_profile
    from gpuaas_agent.discovery.netevidence import NetTarget
    from gpuaas_agent.discovery.prereqs import SocketPaths
    from gpuaas_agent.hostfs import HostRoot
    from gpuaas_agent.tasks.preflight import build_parity_report

    sockets = SocketPaths.from_env()
    if args.ovsdb_socket:
        sockets = SocketPaths(libvirt=sockets.libvirt, ovsdb=args.ovsdb_socket)
    if args.libvirt_socket:
        sockets = SocketPaths(libvirt=tuple(args.libvirt_socket), ovsdb=sockets.ovsdb)

    target = NetTarget(subnet=args.subnet, ovs_bridge=args.ovs_bridge, netns=args.netns)
    overrides = {k: v for k, v in (("dnsmasq_hosts_file", args.dnsmasq_hosts_file), ("seed_dir", args.seed_dir)) if v}
    try:
        site = (load_config(args.config).slice if args.config else SliceConfig()).model_copy(update=overrides)
        profiles = [get_profile(name) for name in args.runtime_profile] if args.runtime_profile else None
        report = build_parity_report(HostRoot.open(args.root), target, sockets, slice_config=site, profiles=profiles)
    except AgentError as exc:
        if exc.code not in ("netns_missing", "netns_on_fixture", "unknown_profile", "root_missing",
                            "config_invalid", "config_unreadable"):
            raise
        print(f"gpuaas-agent: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    print(report.model_dump_json(indent=2) if args.json else "\n".join(report.lines))
    return EXIT_FAILED if report.failures else EXIT_OK


def _cmd_status(args: argparse.Namespace) -> int:
    """Exit 0 healthy, 1 degraded, 3 broken (state unreadable, not enrolled, a failed check); 2 a bad config."""
    from gpuaas_agent.config import load_config
    from gpuaas_agent.operator.status import collect, render

    report = collect(load_config(args.config), run_checks=not args.no_checks)
    print(report.model_dump_json(indent=2) if args.json else render(report))
    return report.exit_code


def _cmd_maintenance(args: argparse.Namespace) -> int:
    """Write the maintenance state the daemon reads (same store, its own transaction): exit 0, 2 on a bad reason."""
    import getpass
    import json
    import time

    from pydantic import ValidationError

    from gpuaas_agent.config import load_config
    from gpuaas_agent.contract.base import first_error
    from gpuaas_agent.contract.fleet import MaintenancePayload
    from gpuaas_agent.state.store import StateStore
    from gpuaas_agent.tasks.maintenance import drain_report, set_maintenance

    user = "".join(c for c in getpass.getuser() if c.isascii() and (c.isalnum() or c in "._-"))[:80] or "unknown"
    try:
        payload = MaintenancePayload.from_wire({"mode": args.mode, "reason": args.reason,
                                                "requested_by": f"local:{user}"})
    except ValidationError as exc:
        field, reason = first_error(exc)
        print(f"gpuaas-agent: error: invalid_payload: maintenance --{field}: {reason}", file=sys.stderr)
        return EXIT_USAGE
    config = load_config(args.config)
    store = StateStore.open(config.state_db)
    try:
        state, changed = set_maintenance(store, payload, f"cli-maintenance-{int(time.time())}")
        drain = drain_report(store, state)
    finally:
        store.close()
    if args.json:
        print(json.dumps({"maintenance": state.model_dump(mode="json"), "changed": changed,
                          "drain": drain.model_dump(mode="json")}, indent=2))
    elif state.on:
        left = f"{len(drain.leased_slots)} slot(s) still leased: {drain.leased_slots}" if drain.leased_slots else \
            "no slice left: drained"
        print(f"maintenance on{'' if changed else ' (already)'} since {state.since.isoformat() if state.since else '-'}:"
              f" {state.reason}; {left}")
    else:
        print(f"maintenance off{'' if changed else ' (already)'}: {state.reason}")
    return EXIT_OK


def _cmd_record_fixture(args: argparse.Namespace) -> int:
    from gpuaas_agent.discovery.record import record_fixture, record_fixture_archive
    from gpuaas_agent.hostfs import HostRoot

    record = record_fixture_archive if args.archive else record_fixture
    manifest = record(HostRoot.open(args.root), args.out)
    print(f"recorded files={manifest.files} links={manifest.links} skipped={len(manifest.skipped)} out={args.out}")
    return EXIT_OK


def _cmd_run(args: argparse.Namespace) -> int:
    from gpuaas_agent.daemon import run_main

    return run_main(args.config)


def _cmd_enroll(args: argparse.Namespace) -> int:
    from gpuaas_agent.daemon import enroll_main

    return enroll_main(args.config, args.token_file)


def _cmd_cloud_init(args: argparse.Namespace) -> int:
    from gpuaas_agent.atomicfile import write_atomic
    from gpuaas_agent.deploy.userdata import load_inputs, render_userdata

    text = render_userdata(load_inputs(args.inputs))
    if args.out is None:
        sys.stdout.write(text)
    else:
        write_atomic(args.out, text.encode(), mode=0o600)  # it carries the bootstrap token
    return EXIT_OK


def _cmd_prepare_host(args: argparse.Namespace) -> int:
    import asyncio

    from gpuaas_agent.config import load_config
    from gpuaas_agent.deploy.prepare import prepare_host

    for line in asyncio.run(prepare_host(load_config(args.config), check_only=args.check,
                                        sysfs_dropin=args.sysfs_dropin)):
        print(line)
    return EXIT_OK


def _cmd_network_baseline(args: argparse.Namespace) -> int:
    import asyncio

    from pydantic import ValidationError

    from gpuaas_agent.config import AgentConfig, load_config
    from gpuaas_agent.daemon import SdNotifier
    from gpuaas_agent.deploy.netbaseline import BaselineSpec, converge

    notifier = SdNotifier.from_env()
    try:
        try:
            # One source of truth: the agent's [slice] settings, so the dnsmasq it configures serves the
            # reservations the agent writes. A bad config fails here, with STATUS=, like a bad flag.
            path = args.config or (DEFAULT_CONFIG if DEFAULT_CONFIG.exists() else None)
            config = load_config(path) if path is not None else AgentConfig()
        except AgentError as exc:
            notifier.notify(STATUS=f"failed: {exc}")
            raise
        site = config.slice
        chosen = {
            "bridge": args.bridge or site.ovs_bridge,
            "gateway": args.gateway or f"{site.gateway}/{site.subnet.prefixlen}",
            "ovs_remote": args.ovs_remote or site.ovsdb_remote,
            "dhcp_hostsfile": args.dhcp_hostsfile or site.dnsmasq_hosts_file,
        }
        try:
            # Flags are text: validated with JSON's rules (the models are strict in Python mode).
            spec = BaselineSpec.from_wire(dict(dnsmasq_conf=args.dnsmasq_conf, datapath_type=args.datapath_type,
                                               nat=not args.no_nat, tmfifo=args.tmfifo, **chosen))
        except ValidationError as exc:
            problems = "; ".join(f"{'.'.join(map(str, e['loc'])) or 'flags'}: {e['msg']}" for e in exc.errors())
            print(f"gpuaas-agent: error: network-baseline: {problems}", file=sys.stderr)
            notifier.notify(STATUS=f"failed: bad flags: {problems}")
            return EXIT_USAGE
        try:
            report = asyncio.run(converge(spec))
        except AgentError as exc:
            # A oneshot unit does not loop: the failure is shown once, in `systemctl status` too.
            notifier.notify(STATUS=f"failed: {exc}")
            raise
        notifier.notify(STATUS=report.line())
    finally:
        notifier.close()
    print(report.model_dump_json(indent=2) if args.json else report.line())
    return EXIT_OK


COMMANDS = {
    "discover": _cmd_discover,
    "preflight": _cmd_parity,
    "parity": _cmd_parity,
    "record-fixture": _cmd_record_fixture,
    "run": _cmd_run,
    "enroll": _cmd_enroll,
    "cloud-init": _cmd_cloud_init,
    "network-baseline": _cmd_network_baseline,
    "prepare-host": _cmd_prepare_host,
    "status": _cmd_status,
    "maintenance": _cmd_maintenance,
}


def _error(code: str, message: str, debug: bool) -> None:
    if debug:
        traceback.print_exc()
    print(f"gpuaas-agent: error: {code}: {' '.join(message.split())}", file=sys.stderr)


def main(argv: list[str] | None = None) -> int:
    """Every error is one line with its code and the documented exit code; a traceback only with --debug."""
    argv = sys.argv[1:] if argv is None else argv
    debug = "--debug" in argv
    try:
        args = _parser().parse_args(argv)
        return COMMANDS[args.command](args)
    except KeyboardInterrupt:
        print("gpuaas-agent: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except AgentError as exc:
        _error(exc.code, exc.message, debug)
        return exit_code_for(exc.code)
    except OSError as exc:  # PermissionError, a directory where a file should be...
        where = f" {exc.filename}" if exc.filename else ""
        _error("os_error", f"{exc.strerror or exc}:{where}", debug)
        return EXIT_ENVIRONMENT
    except sqlite3.Error as exc:
        _error("state_unreadable", f"state DB: {exc}", debug)
        return EXIT_ENVIRONMENT
    except Exception as exc:
        _error("internal_error", f"{type(exc).__name__}: {exc} (run with --debug for the traceback)", debug)
        return EXIT_ENVIRONMENT
