"""The one-client memory attacks against two checkouts of the exporter, in turn, in the same run.

Usage: python3 bench/attacks_side_by_side.py BEFORE_ROOT AFTER_ROOT [--seconds 3]
Each attack runs for `--seconds` against `python -m gpuwarden --sim` started from each root (loopback); RSS is
sampled every 0.1 s and the exporter is killed if it passes 1.5 GiB (the old server got there in seconds). Prints a
Markdown table: peak RSS growth, probe (/readyz) worst latency and failures, and whether the exporter survived.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

CAP_MIB = 1536


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def attack(name: str, port: int, stop: threading.Event) -> None:
    def conn() -> socket.socket:
        sock = socket.create_connection(("127.0.0.1", port))
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        sock.settimeout(0.5)
        return sock

    def flood(sock: socket.socket, data: bytes) -> None:
        while not stop.is_set():
            try:
                sock.sendall(data)
            except TimeoutError:
                continue
            except OSError:
                return

    if name == "pipelined GET /metrics x50 per send, never read":
        with conn() as sock:
            flood(sock, b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n" * 50)
    elif name == "chunked request whose trailers never end":
        with conn() as sock:
            sock.sendall(b"POST /metrics HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n")
            flood(sock, b"a: b\r\n" * 1000)
    else:  # 20 connections, 7,281 tiny pipelined requests each in one write
        socks = [conn() for _ in range(20)]
        for sock in socks:
            with contextlib.suppress(OSError):
                sock.settimeout(2)
                sock.sendall(b"GET /readyz HTTP/1.1\r\nHost: x\r\n\r\n" * 7281)
        stop.wait()
        for sock in socks:
            sock.close()


ATTACKS = [
    "pipelined GET /metrics x50 per send, never read",
    "chunked request whose trailers never end",
    "20 connections x 7,281 pipelined /readyz in one write",
]


def run(root: str, name: str, seconds: float) -> dict:
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("GPUWARDEN_")}
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "gpuwarden",
            "--sim",
            "--nvml.scenario",
            "healthy",
            "--web.listen-address",
            f"127.0.0.1:{port}",
        ],
        cwd=root,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    url = f"http://127.0.0.1:{port}"
    for _ in range(100):
        with contextlib.suppress(OSError):
            urllib.request.urlopen(url + "/metrics", timeout=1).read()
            break
        time.sleep(0.1)
    before = peak = rss_mib(proc.pid)
    stop = threading.Event()
    thread = threading.Thread(target=attack, args=(name, port, stop), daemon=True)
    thread.start()
    worst, failures, probes = 0.0, 0, 0
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline and proc.poll() is None:
        peak = max(peak, rss_mib(proc.pid))
        if peak > CAP_MIB:
            break
        started = time.monotonic()
        probes += 1
        try:
            urllib.request.urlopen(url + "/readyz", timeout=1).read()
        except Exception:  # noqa: BLE001 - a failed probe is what is counted
            failures += 1
        worst = max(worst, time.monotonic() - started)
        time.sleep(0.1)
    stop.set()
    thread.join(5)
    alive = proc.poll() is None
    proc.kill()
    proc.wait()
    return {
        "growth": peak - before,
        "capped": peak > CAP_MIB,
        "worst": worst,
        "failures": failures,
        "probes": probes,
        "alive": alive,
    }


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("before")
    parser.add_argument("after")
    parser.add_argument("--seconds", type=float, default=3.0)
    args = parser.parse_args()
    print("| attack | server | peak RSS growth | worst /readyz | failed probes |")
    print("|---|---|---|---|---|")
    for name in ATTACKS:
        for label, root in (("before", args.before), ("after", args.after)):
            r = run(root, name, args.seconds)
            growth = f"+{r['growth']:.0f} MiB" + (" (killed at the 1.5 GiB cap)" if r["capped"] else "")
            print(f"| {name} | {label} | {growth} | {r['worst'] * 1000:.0f} ms | {r['failures']} of {r['probes']} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
