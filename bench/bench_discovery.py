"""Discovery speed on the 8x H200 fixture, as ratios against baselines measured in the same run.

In-process: ``discover()`` vs. a plain walk that opens and reads every file of
the fixture once (the floor for anything that reads the tree).
Whole process: ``gpuaas-agent discover --json`` vs. a bare ``python -c pass``
(interpreter start-up, the floor for any Python CLI).

Prints medians; never asserts a time (DEVELOPERS.md: speed is measured, not asserted).
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from gpuaas_agent.discovery.report import discover
from gpuaas_agent.hostfs import HostRoot
from lab.fixture_hosts import H200, fixture_host


def _median_ms(fn, runs: int) -> float:
    samples = []
    for _ in range(runs):
        start = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - start) * 1000)
    return statistics.median(samples)


def _read_every_file(root: Path) -> None:
    for dirpath, _dirs, files in os.walk(root):
        for name in files:
            path = os.path.join(dirpath, name)
            if not os.path.islink(path):
                with open(path, "rb") as fh:
                    fh.read()


def _run(argv: list[str]) -> None:
    subprocess.run(argv, check=True, stdout=subprocess.DEVNULL, timeout=60)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--root", type=Path, default=None, help=f"host root (default: the fixture host {H200})")
    parser.add_argument("--runs", type=int, default=30)
    args = parser.parse_args()

    args.root = args.root or fixture_host(H200)
    host = HostRoot.open(args.root)
    discover(HostRoot.open(args.root))  # warm imports and the page cache
    walk_ms = _median_ms(lambda: _read_every_file(args.root), args.runs)
    # A fresh HostRoot each run: its link cache must not carry over between runs.
    disc_ms = _median_ms(lambda: discover(HostRoot.open(args.root)), args.runs)
    del host

    agent = [sys.executable, "-m", "gpuaas_agent", "discover", "--json", "--root", str(args.root)]
    proc_runs = max(5, args.runs // 3)
    bare_ms = _median_ms(lambda: _run([sys.executable, "-c", "pass"]), proc_runs)
    agent_ms = _median_ms(lambda: _run(agent), proc_runs)

    print(f"fixture={args.root.name} runs={args.runs}")
    print(f"in_process discover_ms={disc_ms:.1f} read_every_file_ms={walk_ms:.1f} ratio={disc_ms / walk_ms:.2f}")
    print(f"whole_process agent_ms={agent_ms:.0f} bare_python_ms={bare_ms:.0f} ratio={agent_ms / bare_ms:.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
