"""Does the exporter give memory back after hostile clients? RSS and PSS before, during and after each shape.

For each shape a fresh `gpuwarden --sim` (TLS, a certificate made here, and a probe listener) is warmed up for
`--warm-up` seconds (its JSON API asked once, then scraped every second, as Prometheus would), its RSS and PSS
(`/proc/PID/smaps_rollup`) taken as the baseline, the attack run for `--seconds` from a process of its own (peak
sampled every 0.5 s), and the figures taken again every 5 s until `--after` seconds after the attack ended. Target:
within 20 MiB of the baseline a minute after each shape ends (issue 48). Shapes (the Python clients share the
machine's cores with the server: on 2 cores most TLS handshakes of the first three fail and are retried):

- tls-clients: 1,000 keep-alive TLS clients scraping /metrics every 5 s, reconnecting when dropped;
- handshake-flood: 4,000 connections that stop inside their ClientHello, reopened when dropped;
- never-read: 1,100 `Connection: close` requests for /api/v1/gpus over TLS (client receive buffer 4 KiB) that never
  read the answer, reopened when closed;
- slowloris: 500 TLS connections trickling a header byte a second, reopened when closed;
- idle: 1,000 TCP connections that send nothing, to the main port and the probe port, reopened when closed.

    python bench/memory_after_attacks.py                     # every shape, 30 s each, 60 s after
    python bench/memory_after_attacks.py tls-clients --seconds 20
    python bench/memory_after_attacks.py --root ../before     # another checkout, the same harness
Prints one JSON line per shape (MiB); run it on an otherwise idle machine.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import resource
import signal
import socket
import ssl
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
SHAPES = ("tls-clients", "handshake-flood", "never-read", "slowloris", "idle")
TARGET_MIB = 20.0


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def memory_mib(pid: int) -> tuple[float, float]:
    """(RSS, PSS) of a process in MiB, from smaps_rollup."""
    fields = {}
    for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
        name, _, rest = line.partition(":")
        if name in ("Rss", "Pss"):
            fields[name] = int(rest.split()[0]) / 1024
    return fields["Rss"], fields["Pss"]


# -- the attacks (run in a process of their own: `--attacker SHAPE PORT PROBE_PORT SECONDS`) --------------------------


def _client_context() -> ssl.SSLContext:
    context = ssl.create_default_context()
    context.check_hostname, context.verify_mode = False, ssl.CERT_NONE
    return context


async def _tls_client(port: int, end: float, start_in: float) -> int:
    """Scrapes done by one keep-alive TLS client, one every 5 s. Clients start spread over the first 10 s, and
    back off when dropped: 1,000 handshakes at once from one client process take it longer than the server's
    handshake grace, and the server closes them."""
    await asyncio.sleep(start_in)
    done = 0
    while time.monotonic() < end:
        try:
            reader, writer = await asyncio.open_connection("127.0.0.1", port, ssl=_client_context())
            while time.monotonic() < end:
                writer.write(b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n")
                head = await reader.readuntil(b"\r\n\r\n")
                length = int(head.lower().split(b"content-length: ")[1].split(b"\r\n")[0])
                await reader.readexactly(length)
                done += 1
                await asyncio.sleep(5)
        except (OSError, asyncio.IncompleteReadError, ssl.SSLError, IndexError, ValueError):
            await asyncio.sleep(1 + random.random())
    return done


async def _hold_open(port: int, end: float, first: bytes = b"", trickle: bytes = b"", tls: bool = False) -> int:
    """Connections opened one after another until `end`: each sends `first`, then `trickle` every second the server
    keeps it open, and is closed once the server has closed it; the count opened."""
    opened = 0
    while time.monotonic() < end:
        try:
            reader, writer = await asyncio.open_connection("127.0.0.1", port, ssl=_client_context() if tls else None)
            opened += 1
            if first:
                writer.write(first)
            while time.monotonic() < end and await _still_open(reader):
                if trickle:
                    writer.write(trickle)
            writer.close()
        except OSError:  # ssl.SSLError is one
            await asyncio.sleep(0.2)
    return opened


async def _handshake_staller(port: int, end: float) -> int:
    hello = bytes.fromhex("16030100c8010000c40303") + os.urandom(32)
    return await _hold_open(port, end, first=hello[:16])


async def _still_open(reader: asyncio.StreamReader) -> bool:
    """Wait up to a second for the server to close; False once it has."""
    try:
        return await asyncio.wait_for(reader.read(65536), 1.0) != b""
    except TimeoutError:
        return True
    except OSError:
        return False


async def _never_reader(port: int, end: float, start_in: float) -> int:
    """Connections opened by one client that asks for /api/v1/gpus and never reads; clients start spread over the
    first 11 s (1,100 TLS handshakes at once outlast the server's handshake grace)."""
    await asyncio.sleep(start_in)
    opened = 0
    loop = asyncio.get_running_loop()
    while time.monotonic() < end:
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        sock.setblocking(False)
        try:
            await loop.sock_connect(sock, ("127.0.0.1", port))
            _, writer = await asyncio.open_connection(sock=sock, ssl=_client_context(), server_hostname="x")
            opened += 1
            writer.write(b"GET /api/v1/gpus HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
            # never read: wait for the server to give up on us (a reset), checking the socket without reading it
            while time.monotonic() < end and sock.fileno() >= 0 and not writer.transport.is_closing():
                await asyncio.sleep(1.0)
                err = sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
                if err:
                    break
            writer.transport.abort()
        except (OSError, ssl.SSLError):
            sock.close()
            await asyncio.sleep(0.2)
    return opened


async def _slowloris(port: int, end: float) -> int:
    return await _hold_open(port, end, first=b"GET /metrics HTTP/1.1\r\nHost: x\r\n", trickle=b"X", tls=True)


async def _idle(port: int, end: float) -> int:
    return await _hold_open(port, end)


async def attack(shape: str, port: int, probe_port: int, seconds: float) -> int:
    end = time.monotonic() + seconds
    if shape == "tls-clients":
        clients = [_tls_client(port, end, n / 100) for n in range(1000)]
    elif shape == "handshake-flood":
        clients = [_handshake_staller(port, end) for _ in range(4000)]
    elif shape == "never-read":
        clients = [_never_reader(port, end, n / 100) for n in range(1100)]
    elif shape == "slowloris":
        clients = [_slowloris(port, end) for _ in range(500)]
    else:
        clients = [_idle(port, end) for _ in range(1000)] + [_idle(probe_port, end) for _ in range(1000)]
    return sum(await asyncio.gather(*clients))


# -- the measurement ---------------------------------------------------------------------------------------------------


class Exporter:
    def __init__(self, tmp: Path, root: Path = ROOT) -> None:
        from tests.helpers.common import tls_web_config

        tls_web_config(tmp)  # tmp/web.yml, with its certificate beside it
        self.port, self.probe_port = free_port(), free_port()
        env = {k: v for k, v in os.environ.items() if not k.startswith("GPUWARDEN_")}
        env["PYTHONPATH"] = str(root / "exporter")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "gpuwarden", "--sim", "--web.config.file", str(tmp / "web.yml"),
             "--web.listen-address", f"127.0.0.1:{self.port}",
             "--web.probe-listen-address", f"127.0.0.1:{self.probe_port}"],
            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )  # fmt: skip
        self.client = httpx.Client(base_url=f"https://127.0.0.1:{self.port}", verify=False, timeout=10)
        deadline = time.monotonic() + 60
        while not self.scrape():
            if time.monotonic() > deadline or self.proc.poll() is not None:
                raise RuntimeError("gpuwarden did not start")
            time.sleep(0.2)

    def scrape(self) -> bool:
        with contextlib.suppress(httpx.HTTPError):
            return self.client.get("/metrics").status_code == 200
        return False

    def stop(self) -> None:
        self.client.close()
        self.proc.terminate()
        self.proc.wait(10)


def measure(shape: str, warm_up: float, seconds: float, after: float, root: Path = ROOT) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        exporter = Exporter(Path(tmp), root)
        try:
            # the JSON API loads FastAPI and pydantic on its first request (~20 MiB, kept: docs/benchmarks.md), which
            # the never-read shape makes: the baseline is a process that has served it once
            exporter.client.get("/api/v1/gpus")
            end = time.monotonic() + warm_up
            while time.monotonic() < end:
                exporter.scrape()
                time.sleep(1)
            rss0, pss0 = memory_mib(exporter.proc.pid)
            attacker = subprocess.Popen(
                [sys.executable, __file__, "--attacker", shape, str(exporter.port), str(exporter.probe_port),
                 str(seconds)], stdout=subprocess.PIPE, text=True,
            )  # fmt: skip
            peak = rss0
            while attacker.poll() is None:
                peak = max(peak, memory_mib(exporter.proc.pid)[0])
                time.sleep(0.5)
            connections = int(attacker.stdout.read().strip() or 0)
            ended = time.monotonic()
            curve = []
            while time.monotonic() - ended < after:
                exporter.scrape()
                time.sleep(5 - (time.monotonic() - ended) % 5)
                curve.append(round(memory_mib(exporter.proc.pid)[0] - rss0, 1))
            rss1, pss1 = memory_mib(exporter.proc.pid)
            alive = exporter.proc.poll() is None
        finally:
            exporter.stop()
    return {
        "shape": shape,
        "attacker_tally": connections,  # tls-clients: scrapes answered; the others: connections opened
        "baseline_rss_mib": round(rss0, 1),
        "baseline_pss_mib": round(pss0, 1),
        "peak_rss_mib": round(peak, 1),
        f"rss_after_{after:g}s_mib": round(rss1, 1),
        f"pss_after_{after:g}s_mib": round(pss1, 1),
        "kept_rss_mib": round(rss1 - rss0, 1),
        "kept_pss_mib": round(pss1 - pss0, 1),
        "rss_above_baseline_every_5s": curve,
        "within_target": rss1 - rss0 <= TARGET_MIB and pss1 - pss0 <= TARGET_MIB,
        "alive": alive,
    }


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--attacker":
        shape, port, probe_port, seconds = sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), float(sys.argv[5])
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
        print(asyncio.run(attack(shape, port, probe_port, seconds)))
        return
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("shapes", nargs="*", help=f"some of {', '.join(SHAPES)} (all when none is named)")
    parser.add_argument("--warm-up", type=float, default=30, help="seconds scraped before the baseline")
    parser.add_argument("--seconds", type=float, default=30, help="seconds each attack lasts")
    parser.add_argument("--after", type=float, default=60, help="seconds after the attack to the last figure")
    parser.add_argument("--root", type=Path, default=ROOT, help="the checkout to run (e.g. the one before a change)")
    args = parser.parse_args()
    unknown = [shape for shape in args.shapes if shape not in SHAPES]
    if unknown:
        parser.error(f"unknown shape {unknown[0]}; known: {', '.join(SHAPES)}")
    for shape in args.shapes or SHAPES:
        print(json.dumps(measure(shape, args.warm_up, args.seconds, args.after, args.root.resolve())), flush=True)


if __name__ == "__main__":
    main()
