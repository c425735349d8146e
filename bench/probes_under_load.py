"""Probes on the main port and on the probe listener, side by side, while one of them is under load.

Starts `gpuwarden --sim` (TLS with --tls, a certificate made here) with `--web.probe-listen-address`, runs one
load, and sends a kubelet-style probe (fresh connection, GET /healthz, 1 s) every `--interval` s to each port.
Loads on the main port: `wrk` (Debian's wrk, `-t2 -cN`, on /metrics) or `flood` (N connections that stop inside
their ClientHello, reopened as the server drops them: the handshake flood of docs/reliability.md). On the probe
listener: `idle` (N connections that send nothing, or `--first` and then nothing, each reopened as soon as the
server closes it, from a process of their own, from `--source`: another loopback address stands for another pod).
Prints, per port: probes sent and failed, the longest run of failures (the kubelet restarts the pod at 3 in a row:
failureThreshold 3), p50/p99 latency of the answered ones; and the exporter's RSS (start, peak, end).

    python bench/probes_under_load.py wrk --connections 1000 --tls --seconds 10
    python bench/probes_under_load.py flood --connections 4000 --tls --seconds 10
    python bench/probes_under_load.py idle --connections 1000 --interval 10 --seconds 600   # issue 48, acceptance 7
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import resource
import signal
import socket
import ssl
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def probe(port: int, context: ssl.SSLContext | None) -> float | None:
    """Seconds to a 200 from /healthz on a fresh connection, or None (refused, reset, or past 1 s)."""
    started = time.monotonic()
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=1) as raw:
            sock = context.wrap_socket(raw, server_hostname="127.0.0.1") if context else raw
            sock.settimeout(max(0.01, 1 - (time.monotonic() - started)))
            sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: probe\r\nConnection: close\r\n\r\n")
            answer = sock.recv(64)
    except OSError:
        return None
    took = time.monotonic() - started
    return took if answer.startswith(b"HTTP/1.1 200") and took < 1 else None


def flood(port: int, connections: int, stop: threading.Event) -> None:
    """Connections that send the start of a ClientHello and nothing more, reopened when dropped."""
    hello = bytes.fromhex("16030100c8010000c40303") + os.urandom(32)
    socks: list[socket.socket] = []
    while not stop.is_set():
        while len(socks) < connections:
            sock = socket.socket()
            sock.setblocking(False)
            with contextlib.suppress(BlockingIOError, OSError):
                sock.connect(("127.0.0.1", port))
            socks.append(sock)
        stop.wait(0.2)
        for sock in list(socks):
            try:
                sock.send(hello[:16])
            except OSError:
                socks.remove(sock)
                sock.close()
    for sock in socks:
        sock.close()


async def hold_idle(port: int, connections: int, source: str | None, first: bytes = b"") -> None:
    """`connections` connections that send `first` (nothing by default) and then nothing, each reopened as soon as
    the server closes it; prints how many were opened and how many the server closed when stopped (SIGTERM)."""
    opened = closed = 0
    stop = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)

    async def one() -> None:
        nonlocal opened, closed
        while not stop.is_set():
            try:
                reader, writer = await asyncio.open_connection(
                    "127.0.0.1", port, local_addr=(source, 0) if source else None
                )
            except OSError:
                await asyncio.sleep(0.2)
                continue
            opened += 1
            if first:
                writer.write(first)
            read = asyncio.ensure_future(reader.read(1))
            stopped = asyncio.ensure_future(stop.wait())
            await asyncio.wait({read, stopped}, return_when=asyncio.FIRST_COMPLETED)
            if read.done():
                closed += 1
            read.cancel()
            stopped.cancel()
            writer.close()

    await asyncio.gather(*(one() for _ in range(connections)))
    print(json.dumps({"idle_opened": opened, "idle_closed_by_server": closed}), flush=True)


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def summary(name: str, results: list[float | None]) -> str:
    answered = sorted(t for t in results if t is not None)
    run = longest = 0
    for took in results:
        run = run + 1 if took is None else 0
        longest = max(longest, run)
    line = f"{name}: {len(results)} probes, {len(results) - len(answered)} failed, longest run of failures {longest}"
    if len(answered) >= 2:
        p99 = answered[min(len(answered) - 1, round(0.99 * (len(answered) - 1)))]
        line += f", p50 {answered[len(answered) // 2] * 1000:.1f} ms, p99 {p99 * 1000:.1f} ms"
    return line


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--hold-idle":
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
        source, first = (sys.argv[4] or None, sys.argv[5].encode()) if len(sys.argv) > 5 else (None, b"")
        asyncio.run(hold_idle(int(sys.argv[2]), int(sys.argv[3]), source, first))
        return
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("load", choices=["wrk", "flood", "idle"])
    parser.add_argument("--connections", type=int, default=1000)
    parser.add_argument("--seconds", type=float, default=10)
    parser.add_argument("--interval", type=float, default=0.2, help="seconds between probes (the kubelet: 10)")
    parser.add_argument("--source", default="", help="idle: the flood's source address (127.0.0.2: another pod)")
    parser.add_argument("--first", default="", help="idle: what each connection sends before it idles (e.g. G)")
    parser.add_argument("--tls", action="store_true")
    args = parser.parse_args()
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    tmp = Path(tempfile.mkdtemp())
    port, probe_port = free_port(), free_port()
    flags = [
        "--sim",
        "--web.listen-address",
        f"127.0.0.1:{port}",
        "--web.probe-listen-address",
        f"127.0.0.1:{probe_port}",
    ]
    client = None
    if args.tls:
        from tests.helpers.common import tls_web_config

        _, ca = tls_web_config(tmp)  # tmp/web.yml, with its certificate beside it
        flags += ["--web.config.file", str(tmp / "web.yml")]
        client = ssl.create_default_context()
        ca.configure_trust(client)
    server = subprocess.Popen([sys.executable, "-m", "gpuwarden", *flags], stderr=subprocess.DEVNULL)
    rss: list[float] = []
    try:
        while probe(probe_port, None) is None:
            time.sleep(0.1)
        rss.append(rss_mib(server.pid))
        stop = threading.Event()
        if args.load == "flood":
            load = threading.Thread(target=flood, args=(port, args.connections, stop), daemon=True)
            load.start()
        elif args.load == "idle":
            hold = [sys.executable, __file__, "--hold-idle", str(probe_port), str(args.connections), args.source]
            load = subprocess.Popen([*hold, args.first], stdout=subprocess.PIPE, text=True)
            time.sleep(min(5.0, args.interval))  # the flood up before the first probe
        else:
            url = f"{'https' if args.tls else 'http'}://127.0.0.1:{port}/metrics"
            wrk = ["wrk", "-t2", f"-c{args.connections}", f"-d{args.seconds:g}s", url]
            load = subprocess.Popen(wrk, stdout=subprocess.PIPE, text=True)
        main_port: list[float | None] = []
        probe_listener: list[float | None] = []
        end = time.monotonic() + args.seconds
        next_probe = time.monotonic()
        while time.monotonic() < end:
            main_port.append(probe(port, client))
            probe_listener.append(probe(probe_port, None))
            rss.append(rss_mib(server.pid))
            next_probe += args.interval
            time.sleep(max(0.0, next_probe - time.monotonic()))
        stop.set()
        served = ""
        if isinstance(load, subprocess.Popen):
            if args.load == "idle":
                load.terminate()
            out = load.communicate()[0]
            served = " ".join(
                line.strip()
                for line in out.splitlines()
                if "requests in" in line or "Requests/sec" in line or "idle_opened" in line
            )
        rss.append(rss_mib(server.pid))
    finally:
        server.terminate()
        server.wait(10)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    for name, results in (("main port", main_port), ("probe listener", probe_listener)):
        print(summary(name, results))
    print(f"exporter RSS: {rss[0]:.1f} MiB at start, {max(rss):.1f} MiB peak, {rss[-1]:.1f} MiB at the end")
    if served:
        print(f"{args.load}: {served}")


if __name__ == "__main__":
    main()
