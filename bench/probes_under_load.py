"""Probes on the main port and on the probe listener, side by side, while the main port is under load.

Starts `gpuwarden --sim` (TLS with --tls, a certificate made here) with `--web.probe-listen-address`, runs one
load against the main port, and sends a kubelet-style probe (fresh connection, GET /healthz, 1 s) every 0.2 s to
each port. Loads: `wrk` (Debian's wrk, `-t2 -cN`, on /metrics) or `flood` (N connections that stop inside their
ClientHello, reopened as the server drops them: the handshake flood of docs/reliability.md).

    python bench/probes_under_load.py wrk --connections 1000 --tls --seconds 10
    python bench/probes_under_load.py flood --connections 4000 --tls --seconds 10
"""

from __future__ import annotations

import argparse
import contextlib
import os
import resource
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("load", choices=["wrk", "flood"])
    parser.add_argument("--connections", type=int, default=1000)
    parser.add_argument("--seconds", type=float, default=10)
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
        import trustme

        ca = trustme.CA()
        cert = ca.issue_cert("127.0.0.1")
        cert.cert_chain_pems[0].write_to_path(str(tmp / "cert.pem"))
        cert.private_key_pem.write_to_path(str(tmp / "key.pem"))
        (tmp / "web.yml").write_text(
            f"tls_server_config:\n  cert_file: {tmp / 'cert.pem'}\n  key_file: {tmp / 'key.pem'}\n"
        )
        flags += ["--web.config.file", str(tmp / "web.yml")]
        client = ssl.create_default_context()
        ca.configure_trust(client)
    server = subprocess.Popen([sys.executable, "-m", "gpuwarden", *flags], stderr=subprocess.DEVNULL)
    try:
        while probe(probe_port, None) is None:
            time.sleep(0.1)
        stop = threading.Event()
        if args.load == "flood":
            load = threading.Thread(target=flood, args=(port, args.connections, stop), daemon=True)
            load.start()
        else:
            url = f"{'https' if args.tls else 'http'}://127.0.0.1:{port}/metrics"
            wrk = ["wrk", "-t2", f"-c{args.connections}", f"-d{args.seconds:g}s", url]
            load = subprocess.Popen(wrk, stdout=subprocess.PIPE, text=True)
        main_port: list[float | None] = []
        probe_listener: list[float | None] = []
        end = time.monotonic() + args.seconds
        while time.monotonic() < end:
            main_port.append(probe(port, client))
            probe_listener.append(probe(probe_port, None))
            time.sleep(0.2)
        stop.set()
        served = ""
        if isinstance(load, subprocess.Popen):
            out = load.communicate()[0]
            served = " ".join(
                line.strip() for line in out.splitlines() if "requests in" in line or "Requests/sec" in line
            )
    finally:
        server.terminate()
        server.wait(10)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    for name, results in (("main port", main_port), ("probe listener", probe_listener)):
        answered = [t for t in results if t is not None]
        slowest = f", slowest {max(answered) * 1000:.0f} ms" if answered else ""
        print(f"{name}: {len(answered)} of {len(results)} probes answered within 1 s{slowest}")
    if served:
        print(f"wrk: {served}")


if __name__ == "__main__":
    main()
