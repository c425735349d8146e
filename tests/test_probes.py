"""The kubelet's probes on a listener of their own (exporter/gpuwarden/web/probes.py, `--web.probe-listen-address`).

On the main listener a probe is one connection among the load: under 1,000 TLS clients at once most probes missed
their second (docs/reliability.md). On the probe listener they are answered by another loop on another thread;
what /healthz says about the main listener comes from the main loop's heartbeat, so a hung main loop still fails
the liveness probe. Real HTTP throughout: the exporter's CLI over the simulator, gpuwarden's HTTP server."""

from __future__ import annotations

import contextlib
import resource
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from gpuwarden.web.limits import ConnectionGuard
from gpuwarden.web.listener import bind_listener
from gpuwarden.web.probes import LOOP_STALL_S, MAX_PER_PEER, ProbeApp, ProbeListener
from tests.helpers.common import ServedApp, free_port, tls_web_config, wait_for
from tests.helpers.daemon import running_cli

pytestmark = pytest.mark.serial  # measured under load: the serial phase, after the parallel run (.ci/test)

LOAD = r"""
import asyncio, ssl, sys, time
port, clients, seconds = int(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3])
context = ssl.create_default_context(); context.check_hostname = False; context.verify_mode = ssl.CERT_NONE
done = 0
async def client(end):
    global done
    while time.monotonic() < end:
        try:
            reader, writer = await asyncio.open_connection("127.0.0.1", port, ssl=context)
            while time.monotonic() < end:
                writer.write(b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n")
                head = await reader.readuntil(b"\r\n\r\n")
                length = int(head.lower().split(b"content-length: ")[1].split(b"\r\n")[0])
                await reader.readexactly(length)
                done += 1
        except (OSError, asyncio.IncompleteReadError, ssl.SSLError, IndexError, ValueError):
            await asyncio.sleep(0.05)
async def main():
    end = time.monotonic() + seconds
    await asyncio.gather(*(client(end) for _ in range(clients)))
asyncio.run(main())
print(done)
"""


def probe(port: int, path: str = "/healthz") -> tuple[int, float]:
    """One kubelet-style probe: a fresh connection, GET. (status, seconds); status 0 when it failed. The kubelet's
    1 s is bench/probes_under_load.py's target; here every probe must be answered, on a machine that may be loaded."""
    started = time.monotonic()
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
            sock.sendall(f"GET {path} HTTP/1.1\r\nHost: probe\r\nConnection: close\r\n\r\n".encode())
            answer = sock.recv(64)
    except OSError:
        return 0, time.monotonic() - started
    return int(answer.split(b" ")[1]) if answer.startswith(b"HTTP/1.1 ") else 0, time.monotonic() - started


@pytest.mark.slow
def test_probes_on_their_own_listener_are_answered_while_tls_clients_saturate_the_main_one(tmp_path):
    """400 TLS clients scraping as fast as they can (each reconnecting when dropped) past the 256 handshakes in
    progress, in a process of their own; a probe every 0.2 s to the probe port, each answered 200."""
    web, _ca = tls_web_config(tmp_path)
    probe_port = free_port()
    args = ("--sim", "--web.config.file", str(web), "--web.probe-listen-address", f"127.0.0.1:{probe_port}")
    with running_cli(*args, tls=True) as (url, _proc):
        port = int(url.rsplit(":", 1)[1])
        load = subprocess.Popen(
            [sys.executable, "-c", LOAD, str(port), "400", "8"], stdout=subprocess.PIPE, text=True
        )  # fmt: skip
        probes = []
        while load.poll() is None:
            probes.append(probe(probe_port, "/healthz" if len(probes) % 2 else "/readyz"))
            time.sleep(0.2)
        scraped = int(load.stdout.read().strip() or 0)
    assert scraped > 0  # the load was real: scrapes were answered on the main port meanwhile
    assert len(probes) >= 20
    missed = [(status, round(took, 2)) for status, took in probes if status != 200]
    assert not missed, (missed, len(probes))


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_healthz_on_the_probe_listener_fails_when_the_main_loop_stops_turning():
    """The answers the kubelet acts on: ok while the main loop's heartbeat is recent, 503 naming the stall once it
    is older than LOOP_STALL_S (for /readyz too), the front's readiness reason otherwise, 404 for anything else."""
    clock, turned = Clock(), [1000.0]
    state: dict[str, Any] = {"reason": None}
    seen: list[Any] = []

    def ready(snapshot: Any, now: float) -> str | None:  # the front's readiness is tested with the front
        seen.append(snapshot)
        return state["reason"]

    app = ProbeApp(lambda: "the snapshot", ready, lambda: turned[0], clock=clock)
    live = ServedApp(app, guard=ConnectionGuard(header_timeout_s=2.0))
    live.start()
    try:
        with httpx.Client(base_url=live.url) as client:
            assert client.get("/healthz").json() == {"status": "ok"}
            assert client.get("/readyz").json() == {"status": "ready"}
            assert client.get("/metrics").status_code == 404
            clock.now += LOOP_STALL_S - 1  # slow, not stopped
            assert client.get("/healthz").status_code == 200
            clock.now += 2
            stalled = client.get("/healthz")
            assert stalled.status_code == 503 and "has not turned for 11 s" in stalled.json()["error"]
            assert client.get("/readyz").status_code == 503
            assert client.head("/healthz").content == b""
            turned[0] = clock.now  # the loop turns again
            assert client.get("/healthz").status_code == 200
            state["reason"] = "the fast snapshot is older than 3 s"
            old = client.get("/readyz")
            assert old.status_code == 503 and old.json() == {"status": "not ready", "error": state["reason"]}
            assert client.get("/healthz").status_code == 200  # not ready is not dead
    finally:
        live.stop()
    assert seen and set(seen) == {"the snapshot"}


def test_the_main_servers_heartbeat_stops_while_its_loop_is_blocked():
    """HttpServer.last_turn, what the probe listener reads: it advances while the loop runs and stays behind while
    a handler blocks the loop (the hang the liveness probe is there to catch)."""
    release = threading.Event()

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        if scope["path"] == "/block":
            release.wait(30)  # blocks the loop itself, as a bug would
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"0")]})
        await send({"type": "http.response.body", "body": b""})

    live = ServedApp(app)
    live.start()
    try:
        first = live.server.last_turn()
        wait_for(lambda: live.server.last_turn() > first, timeout=10)
        blocker = threading.Thread(target=lambda: httpx.get(live.url + "/block", timeout=40))
        blocker.start()
        wait_for(lambda: time.monotonic() - live.server.last_turn() > 3, timeout=20)
        stuck_at = live.server.last_turn()
        release.set()
        blocker.join(40)
        wait_for(lambda: live.server.last_turn() > stuck_at, timeout=10)
    finally:
        release.set()
        live.stop()


def test_idle_connections_wait_in_the_kernel_while_every_probe_is_answered():
    """1,000 connections to the probe listener that send nothing, held open, then 30 probes: each is answered 200,
    and the idle connections never reach the server (none accepted, none evicted, none closed): the kernel holds
    them until their first bytes (TCP_DEFER_ACCEPT). Without that, the listener accepts them and closes all but its
    64, and an idle flood that reopens them keeps it churning (bench/probes_under_load.py idle: 12 of 65 probes
    lost before). The wait is set long here so that a slow machine cannot outlast it."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < IDLE_CONNECTIONS + 200:
        pytest.skip(f"the open-file limit ({hard}) is below {IDLE_CONNECTIONS + 200}")
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    try:
        with _serving_probes(1.0) as (probes, port, idle):
            for _ in range(IDLE_CONNECTIONS):
                idle.append(socket.create_connection(("127.0.0.1", port), timeout=10))
            answers = [probe(port, "/healthz" if n % 2 else "/readyz")[0] for n in range(30)]
            connections = probes.server.server.server_state.connections
            wait_for(lambda: not connections)  # the probes' own connections, closed after their answers
            still_open = sum(_open_and_silent(sock) for sock in idle)
            refused = probes.guard.counts()  # before the idle ones are closed: a FIN is data, and is accepted
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    assert answers == [200] * 30
    assert refused == dict.fromkeys(refused, 0)  # nothing evicted or timed out
    assert still_open == IDLE_CONNECTIONS


IDLE_CONNECTIONS = 1000


@contextlib.contextmanager
def _serving_probes(header_timeout_s: float) -> Iterator[tuple[ProbeListener, int, list[socket.socket]]]:
    """A probe listener on a free loopback port, the kernel holding a connection until its first bytes (600 s): the
    listener, its port, and a list for the test's own connections, which are closed before the listener stops."""
    port = free_port()
    listener = bind_listener("127.0.0.1", port)
    assert listener is not None
    probes = ProbeListener(ProbeApp(lambda: None, lambda _s, _now: None, time.monotonic), header_timeout_s, defer_s=600)
    opened: list[socket.socket] = []
    try:
        probes.start(listener)
        assert probes.server.started.wait(30)
        yield probes, port, opened
    finally:
        for sock in opened:
            sock.close()
        probes.stop()
        listener.close()


def test_another_address_cannot_hold_more_than_its_share_of_the_probe_listener():
    """200 connections from 127.0.0.2 (another pod) that send a byte and stop, past the kernel's wait for data: the
    first MAX_PER_PEER are kept, the rest closed at accept; every probe from the kubelet's address (127.0.0.1) is
    answered meanwhile, and so is one from 127.0.0.2 itself, for which the oldest of that address's connections
    makes room."""
    # a header deadline longer than the test: the kept connections stay kept
    with _serving_probes(600.0) as (probes, port, flood):
        for _ in range(200):
            sock = socket.create_connection(("127.0.0.1", port), timeout=10, source_address=("127.0.0.2", 0))
            sock.sendall(b"G")
            flood.append(sock)
        wait_for(lambda: sum(_open_and_silent(sock) for sock in flood) == MAX_PER_PEER, timeout=60)
        answers = [probe(port)[0] for _ in range(20)]
        assert probes.guard.peers is not None and probes.guard.peers.open["127.0.0.2"] == MAX_PER_PEER
        with socket.create_connection(("127.0.0.1", port), timeout=10, source_address=("127.0.0.2", 0)) as own:
            own.sendall(b"GET /readyz HTTP/1.1\r\nHost: probe\r\nConnection: close\r\n\r\n")
            from_the_flooding_address = own.recv(64)
        wait_for(lambda: sum(_open_and_silent(sock) for sock in flood) == MAX_PER_PEER - 1, timeout=60)
        evicted = probes.guard.counts()["evicted"]
    assert answers == [200] * 20
    assert from_the_flooding_address.startswith(b"HTTP/1.1 200")
    assert evicted == 200 - MAX_PER_PEER + 1  # refused at accept, and the one that made room


def _open_and_silent(sock: socket.socket) -> bool:
    """The connection is open and nothing has arrived on it (a close would read b"", a reset raise)."""
    sock.setblocking(False)  # with a timeout, recv would wait for data first
    try:
        sock.recv(1)
    except BlockingIOError:
        return True
    except OSError:
        return False
    return False


def test_a_bad_or_taken_probe_address_is_one_line():
    from tests.test_config import run_cli

    bad = run_cli("--sim", "--web.probe-listen-address", "nowhere")
    assert bad.returncode == 2 and "web.probe_listen_address" in bad.stderr and "Traceback" not in bad.stderr
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        taken = run_cli(
            "--sim", "--web.listen-address", f"127.0.0.1:{free_port()}", "--web.probe-listen-address",
            f"127.0.0.1:{port}",
        )  # fmt: skip
    assert taken.returncode == 4, taken.stderr
    assert taken.stderr.strip().splitlines() == [
        f"gpuwarden: cannot listen on 127.0.0.1:{port}: address already in use; "
        "choose another --web.probe-listen-address or stop what holds it"
    ]
