"""gpuwarden's HTTP server (web/server.py: uvicorn with web/protocol.py's GuardedHttpProtocol) as HTTP/1.1 over real
loopback sockets: framing (keep-alive, pipelining in order, chunked and HEAD responses, HTTP/1.0), what it refuses
(malformed requests, bodies past the limit, upgrades), an app that fails, a client that stops reading, and a
graceful stop that lets the request in flight finish. The exporter's and the fleet service's own apps run on it
throughout the rest of the suite; these apps are small ASGI callables so that each property is seen on its own."""

from __future__ import annotations

import asyncio
import re
import socket
import threading
from contextlib import contextmanager
from typing import Any

import httpx
import pytest

from gpuwarden.web.limits import PROBES, ConnectionGuard
from gpuwarden.web.protocol import MAX_BODY_BYTES
from tests.helpers.common import ServedApp, raw, wait_for

pytestmark = pytest.mark.serial  # measured under load: the serial phase, after the parallel run (.ci/test)

SLOW_STARTED = threading.Event()  # set when a /slow request is in the app


async def echo(scope: dict[str, Any], receive: Any, send: Any) -> None:
    """Answers with what it was asked: method, path, query, body length; /chunks streams three parts without a
    length; /slow waits 0.5 s; /boom raises; /half starts a response and returns; /cut sends part of a body and
    returns."""
    path = scope["path"]
    message = await receive()
    if path == "/boom":
        raise RuntimeError("the app failed")
    if path == "/slow":
        SLOW_STARTED.set()
        await asyncio.sleep(0.5)
    if path == "/chunks":
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/plain")]})
        for part in (b"one ", b"two ", b"three"):
            await send({"type": "http.response.body", "body": part, "more_body": True})
        await send({"type": "http.response.body", "body": b""})
        return
    if path == "/cut":
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"100")]})
        await send({"type": "http.response.body", "body": b"partial", "more_body": True})
        return
    if path == "/stream":
        await send({"type": "http.response.start", "status": 200, "headers": []})
        for _ in range(128):
            await send({"type": "http.response.body", "body": b"s" * 65536, "more_body": True})
        await send({"type": "http.response.body", "body": b""})
        return
    if path == "/big":
        body = b"x" * (8 * 1024 * 1024)
        headers = [(b"content-length", str(len(body)).encode())]
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        await send({"type": "http.response.body", "body": body})
        return
    answer = f"{scope['method']} {path} {scope['query_string'].decode()} {len(message['body'])}".encode()
    headers = [(b"content-type", b"text/plain"), (b"content-length", str(len(answer)).encode())]
    await send({"type": "http.response.start", "status": 200, "headers": headers})
    if path == "/half":
        return
    await send({"type": "http.response.body", "body": answer})


@contextmanager
def served(app: Any = echo, **server: Any):
    guard = server.pop("guard", None) or ConnectionGuard(header_timeout_s=2.0)
    live = ServedApp(app, guard=guard)
    live.start()
    try:
        yield live
    finally:
        live.stop()


def test_keep_alive_serves_many_requests_on_one_connection_with_query_and_body():
    with served() as live, httpx.Client(base_url=live.url) as client:
        answers = [client.get("/a", params={"n": str(i)}).text for i in range(5)]
        posted = client.post("/p", content=b"z" * 1000)
    assert answers == [f"GET /a n={i} 0" for i in range(5)]
    assert posted.text == "POST /p  1000"


def test_pipelined_requests_are_answered_in_order():
    request = b"GET /slow HTTP/1.1\r\nHost: x\r\n\r\nGET /second HTTP/1.1\r\nHost: x\r\n\r\n"
    with served() as live:
        answer = raw(live.port, request + b"GET /third HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n", wait=3)
    assert re.findall(rb"GET /\w+  0", answer) == [b"GET /slow  0", b"GET /second  0", b"GET /third  0"], answer
    assert answer.count(b"HTTP/1.1 200 OK") == 3


def test_a_response_without_a_length_is_chunked_and_head_sends_no_body():
    with served() as live:
        assert httpx.get(live.url + "/chunks").text == "one two three"
        answer = raw(live.port, b"HEAD /x HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
    head, _, body = answer.partition(b"\r\n\r\n")
    assert b"content-length: 10" in head and body == b"", answer  # the length of "HEAD /x  0", not sent


def test_http_1_0_closes_after_the_answer():
    with served() as live, socket.create_connection(("127.0.0.1", live.port), timeout=30) as sock:
        sock.sendall(b"GET /old HTTP/1.0\r\n\r\n")
        answer = b""
        while chunk := sock.recv(4096):  # ends when the server closes (a read timeout raises instead)
            answer += chunk
    assert answer.startswith(b"HTTP/1.1 200") and answer.endswith(b"GET /old  0")


def test_malformed_requests_are_refused_and_counted_upgrades_ignored_and_large_bodies_refused(caplog):
    guard = ConnectionGuard(header_timeout_s=2.0)
    with served(guard=guard) as live:
        garbage = raw(live.port, b"\x16\x03\x01 not http at all\r\n\r\n")
        upgrade = raw(
            live.port,
            b"GET /ws HTTP/1.1\r\nHost: x\r\nConnection: Upgrade\r\nUpgrade: h2c\r\nConnection: close\r\n\r\n",
        )
        big = raw(
            live.port,
            b"POST /p HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n" % (MAX_BODY_BYTES + 1)
            + b"z" * (MAX_BODY_BYTES + 1),
        )
    assert garbage.startswith(b"HTTP/1.1 400"), garbage
    assert guard.rejected["bad_request"] == 1
    assert upgrade.startswith(b"HTTP/1.1 200") and upgrade.endswith(b"GET /ws  0"), upgrade  # as uvicorn: served
    assert big.startswith(b"HTTP/1.1 413") and guard.rejected["body_too_large"] == 1, big
    assert not [r for r in caplog.records if "Invalid HTTP request" in r.getMessage() or "upgrade" in r.getMessage()]


def test_an_app_that_fails_gets_500_and_the_connection_keeps_working_for_others():
    with served() as live:
        boom = httpx.get(live.url + "/boom")
        half = raw(live.port, b"GET /half HTTP/1.1\r\nHost: x\r\n\r\n", wait=2)
        cut = raw(live.port, b"GET /cut HTTP/1.1\r\nHost: x\r\n\r\n", wait=5)
        after = httpx.get(live.url + "/fine")
    assert boom.status_code == 500
    assert half.startswith(b"HTTP/1.1 200") and half.endswith(b"\r\n\r\n")  # the head, then closed: no body
    assert cut.startswith(b"HTTP/1.1 200") and cut.endswith(b"partial")  # cut short: closed, the client sees it
    assert after.text == "GET /fine  0"


def test_a_client_that_stops_reading_is_cut_off_whole_or_streamed():
    """A response the client does not read is aborted at the write timeout (the header deadline), whole or
    streamed; both count as write_timeout, and others are served meanwhile."""
    guard = ConnectionGuard(header_timeout_s=1.0)
    with served(guard=guard) as live:
        for path, rejected in ((b"/big", 1), (b"/stream", 2)):
            sock = socket.create_connection(("127.0.0.1", live.port))
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            sock.sendall(b"GET %s HTTP/1.1\r\nHost: x\r\n\r\n" % path)
            assert httpx.get(live.url + "/fine").text == "GET /fine  0"
            wait_for(lambda n=rejected: guard.rejected["write_timeout"] == n, timeout=30)
            sock.close()
        # the aborted cycles' tasks end once the loop has run their cancellation (later on a loaded machine)
        wait_for(lambda: not live.server.server.server_state.tasks, timeout=30)


def test_a_pipelined_request_waits_while_the_client_does_not_read_the_answer_before_it():
    """Three GET /big (8 MiB each) pipelined by a client that reads nothing: the first answer fills the socket and
    the transport pauses; the second is not started (made, and held in memory) until the client reads. uvicorn made
    it at once: 300 such TLS clients took the exporter to 340 MiB. Once the client reads, all three are answered."""
    started: list[str] = []

    async def counting(scope, receive, send):  # noqa: ANN001 - ASGI
        if scope["type"] == "http":
            started.append(scope["path"])
        await echo(scope, receive, send)

    guard = ConnectionGuard(header_timeout_s=30.0)  # the write timeout does not cut this test's reader
    with served(counting, guard=guard) as live:
        sock = socket.create_connection(("127.0.0.1", live.port))
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 65536)  # far less than an answer: the socket fills
        sock.sendall(b"GET /big HTTP/1.1\r\nHost: x\r\n\r\n" * 3)
        wait_for(lambda: guard.parked == 0 and started and live.server.server.server_state.tasks == set(), timeout=30)
        assert httpx.get(live.url + "/fine").text == "GET /fine  0"  # the loop turns: the pipeline would have run
        assert started.count("/big") == 1, started
        received = 0
        sock.settimeout(30)
        while received < 3 * 8 * 1024 * 1024:
            chunk = sock.recv(1 << 20)
            assert chunk, f"closed after {received} bytes"
            received += len(chunk)
        sock.close()
    assert started.count("/big") == 3


def test_stop_lets_the_request_in_flight_finish_and_refuses_new_connections():
    live = ServedApp(echo, guard=ConnectionGuard())
    live.start()
    result: dict[str, Any] = {}

    def slow() -> None:
        result["answer"] = httpx.get(live.url + "/slow", timeout=30).text

    SLOW_STARTED.clear()
    client = threading.Thread(target=slow)
    client.start()
    assert SLOW_STARTED.wait(30)  # the request is in flight
    live.stop()
    client.join(30)
    assert result.get("answer") == "GET /slow  0"
    try:
        httpx.get(live.url + "/after", timeout=1)
        raise AssertionError("the stopped server answered")
    except httpx.TransportError:
        pass


def test_the_apps_lifespan_runs_before_the_first_connection_and_after_the_last():
    """The fleet service closes its Prometheus client in its lifespan shutdown; an app without lifespan support
    (echo raises on the scope) is served all the same, as every other test here shows."""
    events: list[str] = []

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            while True:
                message = await receive()
                phase = message["type"].removeprefix("lifespan.")
                events.append(phase)
                await send({"type": f"lifespan.{phase}.complete"})
                if phase == "shutdown":
                    return
        await echo(scope, receive, send)

    live = ServedApp(app, guard=ConnectionGuard())
    live.start()
    assert events == ["startup"]
    assert httpx.get(live.url + "/x").text == "GET /x  0"
    live.stop()
    assert events == ["startup", "shutdown"]


def test_the_scope_names_both_ends_the_scheme_and_the_decoded_path():
    seen: list[dict[str, Any]] = []

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            raise RuntimeError("no lifespan here")
        seen.append(scope)
        await send({"type": "http.response.start", "status": 204, "headers": []})
        await send({"type": "http.response.body", "body": b""})

    with served(app) as live, httpx.Client() as client:
        assert client.get(live.url + "/p%20q?x=1").status_code == 204
        assert client.get(live.url + "/again").status_code == 204  # the same connection: its ends read once
    first, second = seen
    assert (first["path"], first["raw_path"], first["query_string"]) == ("/p q", b"/p%20q", b"x=1")
    for scope in seen:
        assert scope["server"] == ("127.0.0.1", live.port) and scope["client"][0] == "127.0.0.1"
        assert scope["scheme"] == "http"
    assert first["client"] == second["client"]


def test_past_the_request_limit_the_api_is_shed_and_the_scrape_and_probes_are_not():
    """Two requests held in the app fill a limit of two: an API request gets 503, the scrape and the probes are
    answered (a flood of never-reading API clients shed a scrape under load, CI 2026-11-28)."""
    release, held = threading.Event(), threading.Semaphore(0)

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        await receive()
        if scope["path"] == "/hold":
            held.release()
            while not release.is_set():
                await asyncio.sleep(0.01)
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"2")]})
        await send({"type": "http.response.body", "body": b"ok"})

    guard = ConnectionGuard(max_requests=2, unshed_paths=PROBES | {"/metrics"})
    with served(app, guard=guard) as live:
        holders = [threading.Thread(target=httpx.get, args=(live.url + "/hold",), daemon=True) for _ in range(2)]
        for holder in holders:
            holder.start()
        for _ in holders:
            assert held.acquire(timeout=30)
        try:
            answers = {
                path: httpx.get(live.url + path).status_code for path in ("/api/v1/gpus", "/metrics", "/healthz")
            }
        finally:
            release.set()
        for holder in holders:
            holder.join(30)
    assert answers == {"/api/v1/gpus": 503, "/metrics": 200, "/healthz": 200}
    assert guard.rejected["shed"] == 1


class _PausingTransport:
    """A transport that records writes and pauses its writer once `high` bytes are unsent, as asyncio's do; one
    that `takes_all` is a socket with room for everything (nothing is ever left unsent)."""

    def __init__(self, high: int, takes_all: bool = False) -> None:
        self.high, self.takes_all, self.unsent, self.paused = high, takes_all, 0, False
        self.writes: list[bytes | memoryview] = []
        self.closed = self.aborted = self.reading_paused = False

    def write(self, data: bytes | memoryview) -> None:
        assert not self.closed, "a write after close"
        self.writes.append(data)
        if not self.takes_all:
            self.unsent += len(data)
            self.paused = self.unsent >= self.high

    def drain(self) -> None:
        """The client read everything: the writer resumes."""
        self.unsent, self.paused = 0, False

    def close(self) -> None:
        self.closed = True

    def abort(self) -> None:
        self.closed = self.aborted = True
        self.unsent = 0  # an aborted transport drops its buffer

    def pause_reading(self) -> None:
        self.reading_paused = True

    def is_closing(self) -> bool:
        return self.closed

    def get_write_buffer_size(self) -> int:
        return self.unsent


def test_an_answer_is_handed_over_a_chunk_at_a_time_while_the_client_reads_and_head_and_body_leave_together():
    """A 100 KB answer to a client that does not read: the transport gets one large chunk (a new connection's socket
    takes ~64 KiB), then small ones once it leaves some unsent, until it pauses the writer; the rest stays the
    caller's bytes (views, no copy) until it resumes. Status line and headers leave in the first send() with the
    body; a lone small write (`100 Continue`) at the end of the loop iteration; close() closes once everything is
    handed over; abort() drops what is held; a socket that takes everything gets large chunks throughout."""
    from gpuwarden.web.pacing import PACE_CHUNK_BYTES, PACE_CHUNK_MAX_BYTES, PacedWrites

    head, body = b"HTTP/1.1 200 OK\r\n\r\n", bytes(range(256)) * 400  # ~100 KB
    results: dict[str, Any] = {}

    async def scenario() -> None:
        loop = asyncio.get_running_loop()
        lone = _PausingTransport(high=2 * PACE_CHUNK_BYTES)
        lone_writes = PacedWrites(lone, loop, lambda: lone.paused)  # type: ignore[arg-type]
        lone_writes.write(b"HTTP/1.1 100 Continue\r\n\r\n")
        results["lone_before_yield"] = list(lone.writes)
        await asyncio.sleep(0)
        results["lone_after_yield"] = [bytes(w) for w in lone.writes]
        transport = _PausingTransport(high=2 * PACE_CHUNK_BYTES)
        writes = PacedWrites(transport, loop, lambda: transport.paused)  # type: ignore[arg-type]
        writes.write(head)
        writes.write(body)
        results["handed"] = [bytes(w) for w in transport.writes]
        results["held"] = writes.get_write_buffer_size()
        writes.close()
        results["closed_early"] = transport.closed
        results["reading_paused"] = transport.reading_paused
        while transport.paused:
            transport.drain()
            writes.flush()  # the protocol's resume_writing
        results["views"] = [isinstance(w, memoryview) and w.obj is body for w in transport.writes[1:]]
        results["sent"] = b"".join(bytes(w) for w in transport.writes)
        results["closed"] = transport.closed
        results["later_chunks"] = [len(w) for w in transport.writes[1:]]
        roomy = _PausingTransport(high=2 * PACE_CHUNK_BYTES, takes_all=True)
        keeping_up = PacedWrites(roomy, loop, lambda: roomy.paused)  # type: ignore[arg-type]
        keeping_up.write(body)
        results["roomy_chunks"] = [len(w) for w in roomy.writes]
        second = _PausingTransport(high=PACE_CHUNK_BYTES)
        aborted = PacedWrites(second, loop, lambda: second.paused)  # type: ignore[arg-type]
        aborted.write(body)
        aborted.abort()
        aborted.write(b"more")
        results["after_abort"] = (aborted.get_write_buffer_size(), len(second.writes), second.aborted)

    asyncio.run(scenario())
    assert results["lone_before_yield"] == [] and results["lone_after_yield"] == [b"HTTP/1.1 100 Continue\r\n\r\n"]
    (first,) = results["handed"]  # paused after it: the socket left it unsent
    assert first == (head + body)[:PACE_CHUNK_MAX_BYTES], "head and body leave in one send()"
    assert results["held"] == len(head) + len(body), "held here and in the transport, all of it"
    assert not results["closed_early"] and results["reading_paused"], "close waits for the answer to be handed over"
    assert results["sent"] == head + body and results["closed"]
    assert all(results["views"]), "the rest is handed over as views of the caller's bytes"
    assert max(results["later_chunks"]) == PACE_CHUNK_BYTES, "small chunks once the socket left some unsent"
    assert results["roomy_chunks"] == [PACE_CHUNK_MAX_BYTES, len(body) - PACE_CHUNK_MAX_BYTES]
    assert results["after_abort"] == (0, 1, True)


def tls_pair() -> tuple[Any, Any]:
    """A server context with a certificate for 127.0.0.1 and a client context that trusts it."""
    import ssl

    import trustme

    ca = trustme.CA()
    server = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ca.issue_cert("127.0.0.1").configure_cert(server)
    client = ssl.create_default_context()
    ca.configure_trust(client)
    return server, client


async def tls_get(port: int, client: Any, path: str = "/x") -> bytes:
    """One HTTPS request on a fresh connection, as a scraper makes it; what came back, or the error's name."""
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", port, ssl=client, server_hostname="127.0.0.1")
        writer.write(f"GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n".encode())
        answer = await reader.read()
        writer.close()
        return answer
    except (OSError, ssl_errors()) as exc:
        return type(exc).__name__.encode()


def ssl_errors() -> type[Exception]:
    import ssl

    return ssl.SSLError


def test_a_tls_connection_is_limited_on_both_layers_and_a_large_answer_arrives_whole():
    """asyncio's TLS transport lets a writer run until 512 KiB is encrypted and unsent, and the socket transport
    beneath it buffers 64 KiB of ciphertext more; a client that stops reading held ~210 KiB a connection for one
    100 KB answer (1,100 of them: an OOM kill at 256 MiB). Both layers get WRITE_HIGH_WATER_BYTES, and an 8 MiB
    answer read slowly arrives whole, while what the server holds beyond the caller's bytes stays within them."""
    from gpuwarden.web.internals import TLS_PROTOCOL_TRANSPORT, TLS_TRANSPORT_PROTOCOL
    from gpuwarden.web.pacing import WRITE_HIGH_WATER_BYTES, socket_transport_beneath

    server, client = tls_pair()
    live = ServedApp(echo, guard=ConnectionGuard(header_timeout_s=30.0), ssl_context=server)
    live.start()
    try:
        raw_sock = socket.create_connection(("127.0.0.1", live.port))
        raw_sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 65536)  # a fixed window: the kernel cannot take 8 MiB
        tls_sock = client.wrap_socket(raw_sock, server_hostname="127.0.0.1")
        try:
            tls_sock.sendall(b"GET /big HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
            wait_for(lambda: live.server.server.server_state.connections, timeout=10)  # TLS 1.3: the client is first
            (connection,) = live.server.server.server_state.connections
            real = connection._writes._transport
            assert real.get_extra_info("sslcontext") is not None  # the TLS transport itself
            # the live objects have the names web/internals.py lists (tests/test_web_internals.py reads the source)
            tls_protocol = getattr(real, TLS_TRANSPORT_PROTOCOL)
            assert hasattr(tls_protocol, TLS_PROTOCOL_TRANSPORT)
            beneath = socket_transport_beneath(real)
            assert beneath is not None and beneath.get_extra_info("socket") is not None
            assert real.get_write_buffer_limits()[1] == beneath.get_write_buffer_limits()[1] == WRITE_HIGH_WATER_BYTES
            wait_for(lambda: connection.flow.write_paused, timeout=10)
            buffered = real.get_write_buffer_size() + beneath.get_write_buffer_size()
            assert buffered <= 3 * WRITE_HIGH_WATER_BYTES, buffered  # each layer's limit and one chunk past it
            received = b""
            while True:
                data = tls_sock.recv(65536)
                if not data:
                    break
                received += data
        finally:
            tls_sock.close()
    finally:
        live.stop()
    head, _, body = received.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200") and body == b"x" * (8 * 1024 * 1024)


def test_a_burst_of_tls_clients_past_the_handshake_limit_waits_and_every_one_is_answered():
    """More clients connecting at once than handshakes allowed in progress (16 here, 256 by default): the ones past
    the limit wait (up to 4 × the limit), before any TLS state is made, and start as slots free. Closing the
    oldest handshake instead closed real clients in the middle of theirs: on d3a938b `wrk -c1000` over TLS
    completed 0 requests in 20 s, each client closed and back again."""
    server, client = tls_pair()
    # at most 64 wait. The clients run in this process: on a machine under a CPU load they are slow to send their
    # ClientHello and the default grace (0.15 s) judged them stalled and gave their slots away (a stress run reset
    # them). Waiting is what this test is about; stalls have their own test below, at the default grace.
    guard = ConnectionGuard(header_timeout_s=5.0, max_handshakes=16, handshake_grace_s=(5.0, 5.0))

    async def burst(port: int) -> list[bytes]:
        return await asyncio.gather(*(tls_get(port, client, f"/c{i}") for i in range(64)))

    live = ServedApp(echo, guard=guard, ssl_context=server)
    live.start()
    try:
        answers = asyncio.run(burst(live.port))
    finally:
        live.stop()
    failed = [a[:60] for a in answers if not a.startswith(b"HTTP/1.1 200")]
    assert not failed, failed
    assert [re.search(rb"GET (/c\d+)", a).group(1) for a in answers] == [f"/c{i}".encode() for i in range(64)]
    assert guard.counts()["handshake_limit"] == 0


def test_stalled_handshakes_give_their_slots_to_waiting_clients_and_waiting_sockets_are_closed():
    """Silent connections (no ClientHello) past the handshake limit: each one started stalls and is closed once a
    client waits; the ones never started are closed too, their socket included (asyncio's accept coroutine, which
    would close it, never ran); a real client that comes meanwhile is answered."""
    server, client = tls_pair()
    guard = ConnectionGuard(header_timeout_s=3.0, max_handshakes=4)
    live = ServedApp(echo, guard=guard, ssl_context=server)
    live.start()
    silent = []
    try:
        for _ in range(40):
            silent.append(socket.create_connection(("127.0.0.1", live.port)))
        answer = asyncio.run(tls_get(live.port, client))

        def closed(sock: socket.socket) -> bool:
            sock.settimeout(0.05)
            try:
                return sock.recv(1) == b""
            except TimeoutError:
                return False
            except OSError:
                return True

        # all but the last ones started, which stay until the handshake timeout (asyncio's 60 s in this process)
        wait_for(lambda: sum(closed(s) for s in silent) >= len(silent) - guard.max_handshakes, timeout=30, step=0.2)
    finally:
        for sock in silent:
            sock.close()
        live.stop()
    assert answer.startswith(b"HTTP/1.1 200"), answer
    assert guard.counts()["handshake_limit"] >= len(silent) - guard.max_handshakes
