"""`npd-plugin` and `slurm-healthcheck` against an exporter endpoint that answers anything but a health document:
every shape is Unknown (exit 2, one line, no traceback), never a fault and never a recovery. NPD reads exit 1 as
"problem" and a traceback exits 1; slurmd acts on what the health check does. Also: a redirect is never followed
(it carried the basic-auth credentials to another host), an answer trickled a byte at a time ends at the deadline,
and the chart's TLS wiring (the served certificate trusted, issued by a CA) verifies on every Python we run.
The other end is a raw TCP server on loopback that writes exactly the bytes of each shape."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests.helpers.common import sweep, write_yaml

COMMANDS = {
    "npd-plugin": ["npd-plugin", "--condition", "hardware", "--timeout", "2"],
    "slurm-healthcheck": ["slurm-healthcheck", "--node", "gpu-1", "--timeout", "2"],
}


def _http(body: bytes, *headers: str, status: str = "200 OK") -> bytes:
    head = [f"HTTP/1.1 {status}", *headers]
    if not any(h.lower().startswith(("content-length", "transfer-encoding")) for h in headers):
        head.append(f"Content-Length: {len(body)}")
    return ("\r\n".join(head) + "\r\n\r\n").encode() + body


def _doc(**change: object) -> bytes:
    document = {"taken_at": time.time(), "nvml_up": True, "nvml_error": None, "gpus_expected": None,
                "gpus_skipped": {}, "gpus": _gpu()}  # fmt: skip
    document.update(change)
    return json.dumps(document).encode()


def _gpu(**change: object) -> list:
    gpu = {"index": 0, "uuid": "GPU-0", "up": True, "stale": False, "checks": {}}
    gpu.update(change)
    return [gpu]


SHAPES: dict[str, bytes] = {
    "a JSON list": _http(b"[]"),
    "a JSON string": _http(b'"healthy"'),
    "taken_at a string": _http(_doc(taken_at="now")),
    "taken_at NaN": _http(_doc().replace(b'"taken_at": ', b'"taken_at": NaN, "x": ')),
    "gpus an object": _http(_doc(gpus={"0": {}})),
    "gpus a list of numbers": _http(_doc(gpus=[1, 2])),
    "a GPU index a string": _http(_doc(gpus=_gpu(index="0"))),
    "checks a list": _http(_doc(gpus=_gpu(checks=["ecc"]))),
    "a level a string": _http(_doc(gpus=_gpu(checks={"ecc": {"level": "2", "observed": "x"}}))),
    "a verdict a number": _http(_doc(gpus=_gpu(checks={"ecc": 2}))),
    "gpus_skipped a list": _http(_doc(gpus_skipped=[0])),
    "gpus_skipped a number reason": _http(_doc(gpus_skipped={"0": 5})),
    "gpus_expected a string": _http(_doc(gpus_expected="8")),
    "deep nesting": _http(b"[" * 200_000 + b"]" * 200_000),
    "an SSH banner": b"SSH-2.0-OpenSSH_9.2p1 Debian-2\r\n",
    "HTTP/0.9 (a body, no status line)": _doc(),
    "101 headers": _http(_doc(), *(f"X-H{i}: {i}" for i in range(101))),
    "a 64 KiB header line": _http(_doc(), "X-Long: " + "a" * 65536),
    "a bad chunked body": _http(b"zz\r\nnot a chunk\r\n", "Transfer-Encoding: chunked"),
    "a body cut short": _http(b'{"gpus": [', "Content-Length: 5000"),
    "a 5 MB body": _http(b" " * (5 * 1024 * 1024) + _doc()),
}


class RawServer:
    """Accepts connections on loopback and answers each with `respond(connection)` after reading the request."""

    def __init__(self, respond: Callable[[socket.socket], None], host: str = "127.0.0.1") -> None:
        self.respond = respond
        self.sock = socket.create_server((host, 0))
        self.url = f"http://{host}:{self.sock.getsockname()[1]}"
        self.requests: list[bytes] = []
        self._stop = threading.Event()
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        self.sock.settimeout(0.2)
        while not self._stop.is_set():
            try:
                connection, _ = self.sock.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            threading.Thread(target=self._one, args=(connection,), daemon=True).start()

    def _one(self, connection: socket.socket) -> None:
        with connection:
            connection.settimeout(5)
            request = b""
            try:
                while b"\r\n\r\n" not in request:
                    chunk = connection.recv(65536)
                    if not chunk:
                        return
                    request += chunk
                self.requests.append(request)
                self.respond(connection)
            except OSError:
                pass

    def close(self) -> None:
        self._stop.set()
        self.sock.close()


def run(command: str, url: str, *flags: str, state: Path) -> subprocess.CompletedProcess[str]:
    """One run as NPD or slurmd makes it; a command that does not end is killed by the test (and fails it)."""
    return subprocess.run(
        [sys.executable, "-m", "gpuwarden", *COMMANDS[command], "--exporter-url", url, "--state-dir", str(state),
         *flags],
        capture_output=True, text=True, timeout=30,
    )  # fmt: skip


@pytest.fixture
def answering() -> Iterator[Callable[[bytes], RawServer]]:
    servers: list[RawServer] = []

    def start(answer: bytes) -> RawServer:
        server = RawServer(lambda connection: connection.sendall(answer))
        servers.append(server)
        return server

    yield start
    for server in servers:
        server.close()


# every shape against both commands in the whole suite; in the developer tier each shape against one of them, in turn
@pytest.mark.parametrize(
    ("command", "shape"),
    sweep(
        [(command, shape) for command in sorted(COMMANDS) for shape in sorted(SHAPES)],
        lambda case: sorted(SHAPES).index(case[1]) % len(COMMANDS) == sorted(COMMANDS).index(case[0]),
    ),
)
def test_a_malformed_answer_is_unknown_never_a_fault(command: str, shape: str, answering, tmp_path: Path) -> None:  # noqa: ANN001
    done = run(command, answering(SHAPES[shape]).url, state=tmp_path)
    assert done.returncode == 2, (shape, done.stdout, done.stderr)
    assert "Traceback" not in done.stderr, done.stderr
    lines = done.stdout.strip().splitlines()
    assert len(lines) == 1 and len(lines[0].encode()) <= 250, done.stdout
    if command == "npd-plugin":
        assert len(lines[0].encode()) <= 80


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_a_redirect_to_another_host_is_not_followed_and_the_credentials_stay(command: str, tmp_path: Path) -> None:
    elsewhere = RawServer(lambda c: c.sendall(_http(_doc(gpus=_gpu(checks={"ecc": {"level": 2, "observed": "x"}})))),
                          host="127.0.0.2")  # fmt: skip
    redirecting = RawServer(lambda c: c.sendall(_http(b"", f"Location: {elsewhere.url}/api/v1/health",
                                                      status="307 Temporary Redirect")))  # fmt: skip
    password = tmp_path / "password"
    password.write_text("s3cret")
    try:
        done = run(command, redirecting.url, "--auth.username", "prometheus", "--auth.password-file", str(password),
                   state=tmp_path)  # fmt: skip
    finally:
        redirecting.close()
        elsewhere.close()
    assert done.returncode == 2 and "redirect" in done.stdout, done.stdout + done.stderr
    assert redirecting.requests and b"Authorization: Basic" in redirecting.requests[0]
    assert elsewhere.requests == []  # never asked, never sent the credentials


def _trickle(connection: socket.socket) -> None:
    connection.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 100000\r\n\r\n")
    for _ in range(120):  # a byte every half second for a minute: past any deadline but the test's own
        connection.sendall(b" ")
        time.sleep(0.5)


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_an_answer_trickled_a_byte_at_a_time_ends_at_the_deadline(command: str, tmp_path: Path) -> None:
    server = RawServer(_trickle)
    try:
        done = run(command, server.url, state=tmp_path)  # killed at 30 s if the deadline does not hold
    finally:
        server.close()
    assert done.returncode == 2 and "timed out" in done.stdout, done.stdout + done.stderr


def test_the_charts_tls_wiring_verifies_a_ca_issued_certificate(tmp_path: Path) -> None:
    """The chart hands the plugin the exporter's web-config: the served certificate (issued by a CA) is what is
    trusted. Python 3.11 and 3.12 refused that chain (no partial chains by default); the plugin answered Unknown for
    ever. Here against the real exporter with a trustme CA's certificate."""
    import trustme

    from tests.helpers.daemon import running_cli

    ca = trustme.CA()
    server = ca.issue_cert("127.0.0.1", "localhost")
    server.cert_chain_pems[0].write_to_path(str(tmp_path / "server.crt"))
    server.private_key_pem.write_to_path(str(tmp_path / "server.key"))
    tls = {"cert_file": str(tmp_path / "server.crt"), "key_file": str(tmp_path / "server.key")}
    web = write_yaml(tmp_path / "web.yml", {"tls_server_config": tls})
    with running_cli("--sim", "--nvml.scenario", "healthy", "--web.config.file", str(web), tls=True) as (url, _):
        done = subprocess.run(
            [sys.executable, "-m", "gpuwarden", "npd-plugin", "--condition", "nvlink", "--exporter-url", url,
             "--web.config.file", str(web), "--state-dir", str(tmp_path / "state")],
            capture_output=True, text=True, timeout=30,
        )  # fmt: skip
    assert done.returncode in (0, 1) and "certificate" not in done.stdout, done.stdout + done.stderr
