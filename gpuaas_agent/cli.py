"""``gpuaas-agent`` command line: one subcommand per job, heavy imports only where needed.

Exit codes: 0 answered, 1 the job ran and failed, 2 bad invocation or input
(``--root`` that does not exist, an unknown flag).
"""

from __future__ import annotations

import argparse
import ipaddress
import sys
from pathlib import Path

from gpuaas_agent import __version__
from gpuaas_agent.errors import AgentError

EXIT_OK, EXIT_FAILED, EXIT_USAGE = 0, 1, 2
DEFAULT_CONFIG = Path("/etc/gpuaas-agent/agent.toml")


def _subnet(value: str) -> ipaddress.IPv4Network:
    try:
        return ipaddress.IPv4Network(value, strict=True)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"not an IPv4 subnet: {exc}") from exc


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="gpuaas-agent", description=__doc__.splitlines()[0])
    parser.add_argument("--version", action="version", version=f"gpuaas-agent {__version__}")
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

    record = sub.add_parser("record-fixture", help="snapshot what discovery reads into a fixture directory")
    record.add_argument("out", type=Path, help="new, empty output directory")
    record.add_argument("--root", default="/", help="host root to record (default: the live host)")
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
    return EXIT_OK


def _cmd_record_fixture(args: argparse.Namespace) -> int:
    from gpuaas_agent.hostfs import HostRoot
    from gpuaas_agent.recorder import record_fixture

    manifest = record_fixture(HostRoot.open(args.root), args.out)
    print(f"recorded files={manifest.files} links={manifest.links} skipped={len(manifest.skipped)} out={args.out}")
    return EXIT_OK


def _cmd_run(args: argparse.Namespace) -> int:
    from gpuaas_agent.daemon import run_main

    return run_main(args.config)


def _cmd_enroll(args: argparse.Namespace) -> int:
    from gpuaas_agent.daemon import enroll_main

    return enroll_main(args.config, args.token_file)


COMMANDS = {
    "discover": _cmd_discover,
    "record-fixture": _cmd_record_fixture,
    "run": _cmd_run,
    "enroll": _cmd_enroll,
}


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        return COMMANDS[args.command](args)
    except AgentError as exc:
        # Refusals with a code are for people: one line, no traceback.
        print(f"gpuaas-agent: error: {exc}", file=sys.stderr)
        return EXIT_USAGE if exc.code == "root_missing" else EXIT_FAILED
