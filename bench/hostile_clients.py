"""Hostile clients against a running gpuwarden (the simulator), the heavier versions of tests/test_hostile_clients.py.

    python bench/hostile_clients.py idle-slowloris   # 1,000 idle + 500 slowloris connections, kept open, 60 s
    python bench/hostile_clients.py big-header       # one 250 MB header
    python bench/hostile_clients.py password-flood   # 400 wrong-password clients for 30 s beside a scraper
    python bench/hostile_clients.py all [--tls]

Attackers are asyncio sockets in this process (cheap on the client side, so the server is what is measured);
the authorised scraper and the probe run on their own threads with httpx. Prints one JSON line per attack: the
figures docs/reliability.md records. Run it on an otherwise idle machine: the exporter, the attackers and the
scraper share its cores.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import json
import os
import ssl
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import bcrypt
import httpx
import yaml

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tests.helpers.common import free_port, rss_mib  # noqa: E402

USER, PASSWORD = "prometheus", "right-password"


class Exporter:
    """gpuwarden on the simulator with basic auth (and TLS when asked), in its own process."""

    def __init__(self, tmp: Path, tls: bool) -> None:
        self.port = free_port()
        web: dict = {"basic_auth_users": {USER: bcrypt.hashpw(PASSWORD.encode(), bcrypt.gensalt(10)).decode()}}
        self.verify: ssl.SSLContext | bool = False
        if tls:
            import trustme

            ca = trustme.CA()
            cert = ca.issue_cert("127.0.0.1")
            cert.private_key_and_cert_chain_pem.write_to_path(str(tmp / "server.pem"))
            ca.cert_pem.write_to_path(str(tmp / "ca.pem"))
            web["tls_server_config"] = {"cert_file": str(tmp / "server.pem"), "key_file": str(tmp / "server.pem")}
            self.verify = ssl.create_default_context(cafile=str(tmp / "ca.pem"))
        (tmp / "web.yaml").write_text(yaml.safe_dump(web))
        scheme = "https" if tls else "http"
        self.url = f"{scheme}://127.0.0.1:{self.port}"
        env = {k: v for k, v in os.environ.items() if not k.startswith("GPUWARDEN_")}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "gpuwarden", "--sim", "--web.listen-address", f"127.0.0.1:{self.port}",
             "--web.config.file", str(tmp / "web.yaml")],
            cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )  # fmt: skip
        deadline = time.monotonic() + 30
        while True:
            try:
                if httpx.get(self.url + "/healthz", verify=self.verify, timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError("gpuwarden did not start")
            time.sleep(0.1)
        httpx.get(self.url + "/metrics", auth=(USER, PASSWORD), verify=self.verify)  # verified once, then cached

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(10)


class Watcher(threading.Thread):
    """Probes /healthz and scrapes /metrics (authorised) every 0.2 s, each on a fresh connection, timing both."""

    def __init__(self, exporter: Exporter) -> None:
        super().__init__(daemon=True)
        self.exporter = exporter
        self.stop_event = threading.Event()
        self.times: dict[str, list[float]] = {"healthz": [], "metrics": []}
        self.failures: list[str] = []

    def run(self) -> None:
        ex = self.exporter
        while not self.stop_event.is_set():
            for name, path, auth in (("healthz", "/healthz", None), ("metrics", "/metrics", (USER, PASSWORD))):
                started = time.monotonic()
                try:
                    answer = httpx.get(ex.url + path, auth=auth, verify=ex.verify, timeout=10)
                    if answer.status_code != 200:
                        self.failures.append(f"{name} {answer.status_code}")
                except httpx.HTTPError as exc:
                    self.failures.append(f"{name} {type(exc).__name__}")
                self.times[name].append(time.monotonic() - started)
            self.stop_event.wait(0.2)

    def summary(self) -> dict:
        out: dict = {"failures": len(self.failures), "failure_kinds": sorted(set(self.failures))[:5]}
        for name, times in self.times.items():
            if len(times) >= 2:
                out[name] = {
                    "n": len(times),
                    "p50_ms": round(statistics.median(times) * 1000, 1),
                    "p99_ms": round(statistics.quantiles(times, n=100)[98] * 1000, 1),
                    "max_ms": round(max(times) * 1000, 1),
                }
        return out


async def hold_connections(port: int, idle: int, slow: int, seconds: float, tls: bool) -> dict:
    """Keep `idle` silent and `slow` trickling connections open for `seconds`, reopening any the server closes."""
    context = None
    if tls:
        context = ssl.create_default_context()
        context.check_hostname, context.verify_mode = False, ssl.CERT_NONE
    closed_by_server = 0
    deadline = time.monotonic() + seconds

    async def attacker(trickle: bool) -> None:
        nonlocal closed_by_server
        while time.monotonic() < deadline:
            try:
                reader, writer = await asyncio.open_connection("127.0.0.1", port, ssl=context)
            except OSError:
                await asyncio.sleep(0.2)
                continue
            try:
                if trickle:
                    writer.write(b"GET /metrics HTTP/1.1\r\nHost: x\r\n")
                while time.monotonic() < deadline:
                    if trickle:
                        writer.write(b"X-a: b\r\n")
                        await writer.drain()
                    try:
                        if await asyncio.wait_for(reader.read(1024), timeout=1.0) == b"":
                            closed_by_server += 1
                            break
                    except TimeoutError:
                        continue
            except OSError:
                closed_by_server += 1
            finally:
                writer.close()

    await asyncio.gather(*(attacker(False) for _ in range(idle)), *(attacker(True) for _ in range(slow)))
    return {"closed_by_server": closed_by_server}


def idle_slowloris(exporter: Exporter, tls: bool) -> dict:
    watcher = Watcher(exporter)
    watcher.start()
    before = rss_mib(exporter.proc.pid)
    held = asyncio.run(hold_connections(exporter.port, 1000, 500, 60, tls))
    watcher.stop_event.set()
    watcher.join()
    return {"attack": "1000 idle + 500 slowloris, 60 s", **held, **watcher.summary(),
            "rss_growth_mib": round(rss_mib(exporter.proc.pid) - before, 1)}  # fmt: skip


def big_header(exporter: Exporter, tls: bool) -> dict:
    import socket

    before = rss_mib(exporter.proc.pid)
    sock = socket.create_connection(("127.0.0.1", exporter.port))
    if tls:
        context = ssl.create_default_context()
        context.check_hostname, context.verify_mode = False, ssl.CERT_NONE
        sock = context.wrap_socket(sock)
    sock.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\nX-Big: ")
    chunk, sent, started = b"a" * 65536, 0, time.monotonic()
    try:
        while sent < 250 * 1024 * 1024:
            sock.sendall(chunk)
            sent += len(chunk)
    except OSError:
        pass
    sock.settimeout(2)
    try:
        answer = sock.recv(64)
    except OSError:
        answer = b""
    elapsed = time.monotonic() - started
    sock.close()
    time.sleep(0.5)
    return {"attack": "one 250 MB header", "answered": answer.split(b"\r\n")[0].decode() or "connection closed",
            "seconds": round(elapsed, 3), "bytes_sent_before_refusal": sent,
            "rss_growth_mib": round(rss_mib(exporter.proc.pid) - before, 1)}  # fmt: skip


def content_length(head: bytes) -> int:
    for line in head.split(b"\r\n"):
        if line.lower().startswith(b"content-length:"):
            return int(line.split(b":", 1)[1])
    return 0


async def wrong_passwords(port: int, clients: int, seconds: float, tls: bool) -> dict:
    """`clients` keep-alive connections sending wrong passwords back to back."""
    context = None
    if tls:
        context = ssl.create_default_context()
        context.check_hostname, context.verify_mode = False, ssl.CERT_NONE
    answers: dict[str, int] = {}
    deadline = time.monotonic() + seconds

    async def client(number: int) -> None:
        while time.monotonic() < deadline:
            try:
                reader, writer = await asyncio.open_connection("127.0.0.1", port, ssl=context)
            except OSError:
                await asyncio.sleep(0.1)
                continue
            try:
                while time.monotonic() < deadline:
                    user = USER if number % 2 else f"nobody{number}"
                    token = base64.b64encode(f"{user}:wrong-{time.monotonic()}".encode()).decode()
                    writer.write(f"GET /metrics HTTP/1.1\r\nHost: x\r\nAuthorization: Basic {token}\r\n\r\n".encode())
                    await writer.drain()
                    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), timeout=30)
                    status = head.split(b" ", 2)[1].decode()
                    answers[status] = answers.get(status, 0) + 1
                    await reader.readexactly(content_length(head))
                    if b"connection: close" in head.lower():
                        break
            except (OSError, asyncio.IncompleteReadError, TimeoutError):
                pass
            finally:
                writer.close()

    await asyncio.gather(*(client(n) for n in range(clients)))
    return {"flood_answers": answers}


def password_flood(exporter: Exporter, tls: bool) -> dict:
    watcher = Watcher(exporter)
    watcher.start()
    before = rss_mib(exporter.proc.pid)
    flood = asyncio.run(wrong_passwords(exporter.port, 400, 30, tls))
    watcher.stop_event.set()
    watcher.join()
    time.sleep(2)
    return {"attack": "400 wrong-password clients, 30 s", **flood, **watcher.summary(),
            "rss_growth_mib": round(rss_mib(exporter.proc.pid) - before, 1)}  # fmt: skip


def timing_oracle(exporter: Exporter) -> dict:
    """Median rejection time of an unknown user and of a known user with a wrong password (sequential)."""
    out = {}
    for label, user in (("unknown_user_ms", "nobody"), ("wrong_password_ms", USER)):
        times = []
        for _ in range(8):
            started = time.monotonic()
            httpx.get(exporter.url + "/metrics", auth=(user, "wrong"), verify=exporter.verify, timeout=10)
            times.append(time.monotonic() - started)
        out[label] = round(statistics.median(times) * 1000, 1)
    return {"attack": "user enumeration by timing", **out, "note": "both include the 1 s refusal delay"}


ATTACKS = {"idle-slowloris": idle_slowloris, "big-header": big_header, "password-flood": password_flood}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("attack", choices=[*ATTACKS, "timing", "all"])
    parser.add_argument("--tls", action="store_true")
    args = parser.parse_args()
    names = [*ATTACKS, "timing"] if args.attack == "all" else [args.attack]
    with tempfile.TemporaryDirectory() as tmp:
        for name in names:
            exporter = Exporter(Path(tmp), args.tls)
            try:
                result = timing_oracle(exporter) if name == "timing" else ATTACKS[name](exporter, args.tls)
                result["alive_after"] = exporter.proc.poll() is None
                print(json.dumps({"tls": args.tls, **result}), flush=True)
            finally:
                exporter.stop()


if __name__ == "__main__":
    main()
