"""First provision of an uncached raw image: the one-pass stream vs ``max(curl download, dd oflag=direct)``, one run.

Goal (docs/performance.md): the provision's image work on a cache miss costs <= 1.15x
``max(time to download the file with curl, time to write it with dd oflag=direct)``,
not their sum. Everything is measured in the same run, interleaved round by round:

- ``curl``: ``curl -o /dev/null`` of the image from a local HTTPS server that serves at a
  fixed rate (``--rate-mib``, 0 = unthrottled; TLS with a throwaway CA the agent trusts through
  its CA config): by default nginx in a network namespace paced by the kernel (``tbf``), so the
  server spends little CPU and pacing does not drift; the python server when nginx is missing
  (bench/rate_server.py says why and how to install);
- ``dd``: ``dd bs=4M oflag=direct`` of the image (from the page cache) onto the target;
- ``stream``: the agent's path with an empty cache: ``ImageCache.fetch_or_open`` (open,
  head probe) then ``stream_image`` (guard, exclusive hold, one pass onto the disk and into
  the cache, hashed, fsync, full-file probe, marker) from that same server onto the target;
- ``stream_httpx`` (``--compare-httpx``): the same stream with the body read by httpx in this
  process (the reader before the curl child), for the record;
- ``read`` and ``read_hash`` (``--diagnose``): the agent's reader alone (the curl child's body
  read into the pump's 4 MiB buffers, written nowhere), then with the SHA-256: where the
  stream's time goes, each against the same run's curl;
- ``two_pass``: for the record, what a miss cost before: ``ImageCache.fetch`` into the cache,
  then ``clone_image`` (qemu-img) onto the target.

Target: a loop device (``--direct-io=on``) over a sparse file in ``--dir`` behind a
``/dev/disk/by-id/gpuaas-test-*`` link; the cache lives in ``--cache-dir`` (default the same
file system: on this VM the cache and the "slot disk" share one disk, a real host's do not).
Needs root. Prints medians and ratios; never asserts a time.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import mmap
import os
import resource
import shutil
import ssl
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from bench.httpx_reader import HttpSource
from bench.rate_server import RateServer, machine_cpu, native_missing
from gpuaas_agent.host.images import cache as images
from gpuaas_agent.host.images import curlstream
from gpuaas_agent.host.images import stream as imagestream
from gpuaas_agent.host.images.cache import ImageCache, SourcePolicy, StreamedMiss
from gpuaas_agent.host.images.clone import clone_image
from gpuaas_agent.host.images.curlstream import CurlSource
from gpuaas_agent.host.images.stream import STREAM_CHUNK_BYTES, fill
from gpuaas_agent.host.images.streamclone import stream_image
from gpuaas_agent.host.run import run
from gpuaas_agent.hostfs import HostRoot
from tests.support.realdev import MiB, RealDevices

LIVE = HostRoot.open("/")

def _write_image(path: Path, size_mib: int) -> str:
    digest = hashlib.sha256()
    with open(path, "wb") as fh:
        for _ in range(size_mib):
            block = os.urandom(MiB)
            digest.update(block)
            fh.write(block)
    return digest.hexdigest()


def _warm(path: Path) -> None:
    with open(path, "rb") as fh:
        while fh.read(16 * MiB):
            pass


def _cpu() -> float:
    """CPU seconds of this process and its waited-for children (curl, dd, qemu-img), user + system."""
    own, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime


def _open_httpx(self, url, cancel=None, bound=None):
    """The opener before the curl child: httpx reads TLS in this process (16 KiB per read)."""
    source = HttpSource(url, check_hop=self._check_redirect, verify=self.ssl_context,
                        stall_timeout_s=self.stall_timeout_s, cancel=cancel)
    source.open()
    return images._Source(source.read_into, source.length, source.close, source.describe,
                          set_cancel=lambda event: setattr(source, "cancel", event), interrupt=source.interrupt)


class _Breakdown:
    """CPU-s per part of the stream, from ``time.thread_time`` around each call in its own thread (bench only:
    ``stream.pump`` is wrapped, nothing in the agent changes): the reader's pipe reads, each sink, the children."""

    def __init__(self) -> None:
        self.parts: dict[str, list[float]] = {}
        self.current: dict[str, float] = {}
        self.waits: dict[str, float] = {}  # seconds runnable but not running (waiting for a CPU), per part
        self.waited: dict[str, list[float]] = {}

    def wrap(self, name: str, fn):
        def timed(*a):
            start, waited = time.thread_time(), _run_delay()
            try:
                return fn(*a)
            finally:
                self.current[name] = self.current.get(name, 0.0) + time.thread_time() - start
                self.waits[name] = self.waits.get(name, 0.0) + _run_delay() - waited
        return timed

    def install(self):
        original = imagestream.pump
        names = ("hash", "cache_write", "disk_write")

        def pump(read_into, sinks, **kw):
            sinks = [self.wrap(names[i] if i < len(names) else f"sink{i}", s) for i, s in enumerate(sinks)]
            return original(self.wrap("pipe_read", read_into), sinks, **kw)

        imagestream.pump = pump
        return original

    def end_run(self, children: float, total: float) -> None:
        self.current["children (curl child, qemu-img probes)"] = children
        self.current["rest (setup, threads, fsync, python)"] = total - sum(self.current.values())
        for k, v in self.current.items():
            self.parts.setdefault(k, []).append(v)
        for k, v in self.waits.items():
            self.waited.setdefault(k, []).append(v)
        self.current, self.waits = {}, {}


def _run_delay() -> float:
    """Seconds this thread has spent runnable but waiting for a CPU (schedstat's run_delay)."""
    with open("/proc/thread-self/schedstat") as fh:
        return int(fh.read().split()[1]) / 1e9


def _children_cpu() -> float:
    kids = resource.getrusage(resource.RUSAGE_CHILDREN)
    return kids.ru_utime + kids.ru_stime


def _timed(fn, cpu: dict[str, list[float]], server: RateServer) -> float:
    """Wall seconds of ``fn``; appends its CPU-s to ``cpu``: ours (this process and its children), the
    server's, and the whole VM's (every process: neighbours included) and the VM's steal."""
    start, used, served, (busy, steal) = time.perf_counter(), _cpu(), server.cpu(), machine_cpu()
    fn()
    wall = time.perf_counter() - start
    busy2, steal2 = machine_cpu()
    cpu["own"].append(_cpu() - used)
    cpu["server"].append(server.cpu() - served)
    cpu["vm"].append(busy2 - busy)
    cpu["steal"].append(steal2 - steal)
    return wall


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size-mib", type=int, default=512)
    parser.add_argument("--rate-mib", type=float, default=200.0, help="the server's fixed rate, MiB/s (0: unthrottled)")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--dir", default="/var/tmp", help="where the image and the loop backing file live")
    parser.add_argument("--cache-dir", default=None, help="the image cache's file system (default: --dir)")
    parser.add_argument("--diagnose", action="store_true", help="also time the reader alone and reader + hash")
    parser.add_argument("--compare-httpx", action="store_true", help="also time the stream read by httpx")
    parser.add_argument("--no-two-pass", action="store_true", help="skip the old fetch-then-clone timing")
    parser.add_argument("--compare-pipe-mib", type=int, default=None,
                        help="also time the stream with the curl pipe enlarged to this many MiB (root may exceed "
                             "fs.pipe-max-size): more slack when the reader is scheduled late")
    parser.add_argument("--breakdown", action="store_true",
                        help="also time a stream with each part's CPU-s measured in its thread (pipe reads, hash, "
                             "cache and disk writes, children)")
    parser.add_argument("--server", choices=("nginx", "python"), default=None,
                        help="the HTTPS server: nginx in a netns paced by tbf (default when installed), or the "
                             "python one on 127.0.0.1 (the fallback); see bench/rate_server.py")
    parser.add_argument("--server-cpus", default=None, help="pin the server with taskset -c (e.g. 1)")
    parser.add_argument("--bench-cpus", default=None, help="pin this process and its children (e.g. 0)")
    args = parser.parse_args()
    if os.geteuid() != 0:
        sys.exit("bench_stream needs root (losetup, /dev/disk/by-id)")
    kind = args.server
    if kind is None:
        why = native_missing()
        kind = "python" if why else "nginx"
        if why:
            print(f"NOTE: nginx server unavailable ({why}); falling back to the python server, whose TLS and "
                  f"pacing run in the interpreter on this machine's CPUs", flush=True)
    if args.bench_cpus:
        os.sched_setaffinity(0, {int(c) for c in args.bench_cpus.split(",")})
    with tempfile.TemporaryDirectory(dir=args.dir, prefix="gpuaas-bench-stream-") as tmp:
        tmp_path = Path(tmp)
        cache_parent = Path(tempfile.mkdtemp(dir=args.cache_dir or tmp, prefix="cache-"))
        src = tmp_path / "src"
        src.mkdir()
        image = src / "image.raw"
        digest = _write_image(image, args.size_mib)
        _warm(image)
        server = RateServer(kind, src, tmp_path, args.rate_mib * MiB, cpus=args.server_cpus).__enter__()
        base, cert = server.base, server.cert
        url = f"{base}/image.raw"
        context = ssl.create_default_context(cafile=str(cert))
        devices = RealDevices(tmp_path)
        samples: dict[str, list[float]] = {"curl": [], "dd": [], "stream": [], "stream_httpx": [], "read": [],
                                           "read_hash": [], "two_pass": [], "stream_pipe": [], "stream_parts": []}
        cpu: dict[str, dict[str, list[float]]] = {name: {"own": [], "server": [], "vm": [], "steal": []}
                                                  for name in samples}
        try:
            disk = devices.disk(args.size_mib + 16, direct_io=True)
            lease = disk.lease()

            # The caches a contender filled, deleted between runs with the clock stopped: unlinking a 512 MiB
            # file takes ~0.08 s here, which the provision itself never pays (it keeps its cache entry).
            leftovers: list[Path] = []

            def fresh_cache(i: int) -> ImageCache:
                root = cache_parent / f"c{i}-{time.monotonic_ns()}"
                return ImageCache(root, policy=SourcePolicy(https_hosts=(base.removeprefix("https://"),)),
                                  ssl_context=context)

            def curl() -> None:
                asyncio.run(run(["curl", "-sSf", "--cacert", str(cert), "-o", "/dev/null", url], timeout=3600))

            def dd() -> None:
                asyncio.run(run(["dd", f"if={image}", f"of={disk.dev}", "bs=4M", "oflag=direct", "conv=notrunc",
                                 "status=none"], timeout=3600))

            def stream() -> None:
                cache = fresh_cache(0)

                async def go():
                    miss = await cache.fetch_or_open(url, digest)
                    assert isinstance(miss, StreamedMiss)
                    result, _ = await stream_image(LIVE, miss, disk.by_id, lease=lease)
                    assert result.method == "stream"

                try:
                    asyncio.run(go())
                finally:
                    leftovers.append(cache.root)  # removed after the clock stopped: not the provision's cost

            def stream_httpx() -> None:
                original = ImageCache._open_http
                ImageCache._open_http = _open_httpx  # type: ignore[method-assign]
                try:
                    stream()
                finally:
                    ImageCache._open_http = original  # type: ignore[method-assign]

            def stream_pipe() -> None:
                original = curlstream.PIPE_BYTES
                curlstream.PIPE_BYTES = args.compare_pipe_mib * MiB
                try:
                    stream()
                finally:
                    curlstream.PIPE_BYTES = original

            breakdown = _Breakdown()

            def stream_parts() -> None:
                original = breakdown.install()
                kids, total = _children_cpu(), _cpu()
                try:
                    stream()
                finally:
                    imagestream.pump = original
                breakdown.end_run(_children_cpu() - kids, _cpu() - total)

            def read(hashing: bool) -> None:
                source = CurlSource(url, check_hop=lambda hop, first: None, verify=context, stall_timeout_s=60).open()
                buf, digest = memoryview(mmap.mmap(-1, STREAM_CHUNK_BYTES)), hashlib.sha256()
                try:
                    while got := fill(source.read_into, buf):
                        if hashing:
                            digest.update(buf[:got])
                finally:
                    source.close()

            def two_pass() -> None:
                cache = fresh_cache(1)

                async def go():
                    cached = await cache.fetch(url, digest)
                    await clone_image(LIVE, cached.path, disk.by_id, lease=lease)

                try:
                    asyncio.run(go())
                finally:
                    leftovers.append(cache.root)

            contenders = {"curl": curl, "dd": dd, "stream": stream}
            if args.diagnose:
                contenders["read"] = lambda: read(False)
                contenders["read_hash"] = lambda: read(True)
            if args.compare_httpx:
                contenders["stream_httpx"] = stream_httpx
            if args.breakdown:
                contenders["stream_parts"] = stream_parts
            if args.compare_pipe_mib:
                contenders["stream_pipe"] = stream_pipe
            if not args.no_two_pass:
                contenders["two_pass"] = two_pass
            for _ in range(args.runs):  # interleaved: a noisy neighbour slows every contender alike
                for name, fn in contenders.items():
                    samples[name].append(_timed(fn, cpu[name], server))
                    while leftovers:
                        shutil.rmtree(leftovers.pop(), ignore_errors=True)
        finally:
            devices.close()
            server.__exit__()
            shutil.rmtree(cache_parent, ignore_errors=True)

    med = {k: statistics.median(v) for k, v in samples.items() if v}
    print(f"load average at the end {os.getloadavg()[0]:.2f} (1 min), {os.cpu_count()} CPUs")
    size = args.size_mib
    print(f"image {size} MiB raw (random), server: {server.describe}; target loop "
          f"device (--direct-io=on) in {args.dir}; cache in {args.cache_dir or args.dir}; medians of {args.runs} "
          f"interleaved runs; pinning: server {args.server_cpus or '-'}, bench {args.bench_cpus or '-'}")
    print("CPU-s per run (medians): own = this process + its children (curl, dd, the stream's curl child); server "
          "= the HTTPS server process; vm = every CPU of the VM busy (neighbours and softirq included); steal")
    for name, seconds in med.items():
        c = {k: statistics.median(v) for k, v in cpu[name].items()}
        print(f"{name:12s} {seconds:7.3f} s {size / seconds:8.1f} MiB/s  cpu own {c['own']:5.2f} server "
              f"{c['server']:5.2f} vm {c['vm']:5.2f} steal {c['steal']:5.2f}  "
              f"samples {[round(s, 3) for s in samples[name]]}")
    floor = max(med["curl"], med["dd"])
    print(f"ratio stream/max(curl, dd) = {med['stream'] / floor:.2f} (goal <= 1.15); per round: "
          f"{[round(s / max(c, d), 2) for s, c, d in zip(samples['stream'], samples['curl'], samples['dd'])]}")
    for name in ("read", "read_hash"):
        if name in med:
            print(f"ratio {name}/curl = {med[name] / med['curl']:.2f} (diagnosis: the reader alone / with the hash)")
    if args.breakdown and breakdown.parts:
        print("stream_parts: CPU-s per part (medians): " + ", ".join(
            f"{k} {statistics.median(v):.2f}" for k, v in breakdown.parts.items()))
        print("stream_parts: seconds waiting for a CPU while in each part (medians): " + ", ".join(
            f"{k} {statistics.median(v):.2f}" for k, v in breakdown.waited.items()))
    if "stream_pipe" in med:
        print(f"ratio stream_pipe/max(curl, dd) = {med['stream_pipe'] / floor:.2f} (curl pipe "
              f"{args.compare_pipe_mib} MiB, same run); stream_pipe/stream = {med['stream_pipe'] / med['stream']:.2f}")
    if "stream_httpx" in med:
        print(f"ratio stream_httpx/max(curl, dd) = {med['stream_httpx'] / floor:.2f} (httpx reader, same run)")
    if "two_pass" in med:
        print(f"ratio two_pass/max(curl, dd) = {med['two_pass'] / floor:.2f} (the path before the stream); "
              f"two_pass/stream = {med['two_pass'] / med['stream']:.2f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
