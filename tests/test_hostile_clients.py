"""The exporter under hostile clients, each attack bounded in time, against the real server (the CLI process with
its guarded HTTP protocol) over loopback: idle and slowloris connections, an oversized header, a wrong-password
flood beside an authorised scraper, undecodable files at start and on reload, quality values in content
negotiation. The heavier versions (1,500 connections for 60 s, 400 flooders) are bench/hostile_clients.py, with
their figures in docs/reliability.md."""

from __future__ import annotations

import signal
import socket
import ssl
import subprocess
import sys
import threading
import time
from contextlib import AbstractContextManager, suppress
from pathlib import Path

import bcrypt
import httpx
import pytest

from gpuwarden.web.basic_auth import BasicAuth
from gpuwarden.web.front import negotiate
from tests.helpers.common import free_port, parse_exposition, rss_mib, tls_web_config, values, write_yaml
from tests.helpers.daemon import running_cli
from tests.helpers.hostile import never_reading_request, shrink_send_buffer, sockets_on

pytestmark = [pytest.mark.slow, pytest.mark.serial]  # end-to-end, and measured under load or against real clocks


def exporter(
    tmp_path: Path, *flags: str, config: dict | None = None
) -> AbstractContextManager[tuple[str, subprocess.Popen]]:
    if config is not None:
        flags = (*flags, "--config", str(write_yaml(tmp_path / "gpuwarden.yaml", config)))
    return running_cli("--sim", *flags)


def test_idle_and_slowloris_connections_never_starve_the_probes_or_a_scrape(tmp_path):
    header_timeout = 1.0
    with exporter(tmp_path, "--web.header-timeout", str(header_timeout), "--web.max-connections", "200") as (url, _):
        port = int(url.rsplit(":", 1)[1])
        idle = [socket.create_connection(("127.0.0.1", port)) for _ in range(300)]
        slow = [socket.create_connection(("127.0.0.1", port)) for _ in range(100)]
        stop = threading.Event()

        def trickle() -> None:  # slowloris: a header byte now and then, never the end of the headers
            for sock in slow:
                with suppress(OSError):
                    sock.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\n")
            while not stop.wait(0.3):
                for sock in slow:
                    with suppress(OSError):
                        sock.sendall(b"X")

        threading.Thread(target=trickle, daemon=True).start()
        failures = []
        started = time.monotonic()
        with httpx.Client(timeout=10) as client:
            while time.monotonic() - started < 6:
                for path in ("/healthz", "/metrics"):
                    try:
                        answer = client.get(url + path, headers={"connection": "close"})
                        if answer.status_code != 200:
                            failures.append((path, answer.status_code))
                    except httpx.HTTPError as exc:
                        failures.append((path, repr(exc)))
                time.sleep(0.1)
        stop.set()
        closed = 0
        for sock in idle:
            sock.settimeout(0.1)
            try:
                closed += sock.recv(1) == b""
            except (TimeoutError, OSError):
                closed += isinstance(sys.exc_info()[1], ConnectionResetError)
            sock.close()
        for sock in slow:
            sock.close()
        series = parse_exposition(httpx.get(url + "/metrics").text)
    assert failures == [], failures  # every probe and scrape answered 200 (how fast: bench/hostile_clients.py)
    assert closed == len(idle)  # every idle connection was closed (evicted at the limit, or by the deadline)
    rejected = {r: values(series, "gpuwarden_http_rejected_total", reason=r)[0] for r in ("evicted", "header_timeout")}
    assert rejected["evicted"] + rejected["header_timeout"] >= len(idle), rejected


def test_an_oversized_header_is_refused_as_it_arrives(tmp_path):
    with exporter(tmp_path) as (url, proc):
        port = int(url.rsplit(":", 1)[1])
        httpx.get(url + "/metrics")
        before = rss_mib(proc.pid)
        sock = socket.create_connection(("127.0.0.1", port))
        sock.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\nX-Big: ")
        chunk, sent, started = b"a" * 65536, 0, time.monotonic()
        try:
            while sent < 250 * 1024 * 1024 and time.monotonic() - started < 10:
                sock.sendall(chunk)
                sent += len(chunk)
        except OSError:
            pass  # the server answered and closed: the rest of the 250 MB is never read
        sock.settimeout(2)
        try:
            answer = sock.recv(200)
        except OSError:
            answer = b""
        sock.close()
        growth_mib = rss_mib(proc.pid) - before
    assert sent < 16 * 1024 * 1024, sent  # refused as it arrived, not after the 250 MB
    assert answer == b"" or answer.startswith(b"HTTP/1.1 431"), answer
    assert growth_mib < 16, growth_mib


def test_a_wrong_password_flood_does_not_starve_an_authorised_scraper(tmp_path):
    hashed = bcrypt.hashpw(b"right", bcrypt.gensalt(rounds=10)).decode()
    web = write_yaml(tmp_path / "web.yaml", {"basic_auth_users": {"prometheus": hashed}})
    with exporter(tmp_path, "--web.config.file", str(web)) as (url, proc):
        httpx.get(url + "/metrics", auth=("prometheus", "right"))  # verified once, then cached
        before = rss_mib(proc.pid)
        stop = threading.Event()

        def flood() -> None:
            with httpx.Client(timeout=10) as client:
                while not stop.is_set():
                    with suppress(httpx.HTTPError):
                        client.get(url + "/metrics", auth=("prometheus", f"wrong-{time.monotonic()}"))

        flooders = [threading.Thread(target=flood, daemon=True) for _ in range(60)]
        for thread in flooders:
            thread.start()
        latencies = []
        with httpx.Client(timeout=10, auth=("prometheus", "right")) as scraper:
            started = time.monotonic()
            while time.monotonic() - started < 8:
                t0 = time.monotonic()
                assert scraper.get(url + "/metrics").status_code == 200
                latencies.append(time.monotonic() - t0)
                time.sleep(0.05)
        stop.set()
        for thread in flooders:
            thread.join(15)
        growth_mib = rss_mib(proc.pid) - before
        series = parse_exposition(httpx.get(url + "/metrics", auth=("prometheus", "right")).text)
    assert len(latencies) >= 8  # every scrape of the authorised scraper answered 200 throughout (its p99: bench/)
    assert growth_mib < 32, growth_mib
    assert values(series, "gpuwarden_http_rejected_total", reason="auth_failed")[0] > 0


def test_unknown_user_costs_what_a_wrong_password_costs(monkeypatch):
    """Timing must not tell whether a user exists: an unknown user is checked against a hash of the users' own
    cost, once, as a wrong password is (counted, not timed: the cost is bcrypt's rounds)."""
    import base64

    auth = BasicAuth(None, {"prometheus": bcrypt.hashpw(b"right", bcrypt.gensalt(rounds=10)).decode()})
    checked: list[int] = []
    real_checkpw = bcrypt.checkpw

    def counting_checkpw(secret: bytes, hashed: bytes) -> bool:
        checked.append(int(hashed.split(b"$")[2]))  # the hash's cost (rounds)
        return real_checkpw(secret, hashed)

    monkeypatch.setattr(bcrypt, "checkpw", counting_checkpw)
    for user in ("nobody", "prometheus"):
        checked.clear()
        assert auth._check(b"Basic " + base64.b64encode(f"{user}:wrong".encode())) is False
        assert checked == [10], (user, checked)


@pytest.mark.parametrize("kind", ["config", "web", "thresholds", "scenario"])
def test_an_undecodable_file_is_one_line_and_exit_2(tmp_path, kind):
    bad = tmp_path / "bad.yaml"
    bad.write_bytes(b"poll:\n  fast_interval: \xff\xfe1\n")
    flag = {"config": "--config", "web": "--web.config.file", "thresholds": "--health.thresholds-file"}.get(
        kind, "--nvml.scenario"
    )
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "gpuwarden",
            "--sim",
            flag,
            str(bad),
            "--web.listen-address",
            f"127.0.0.1:{free_port()}",
        ],
        capture_output=True,
        text=True,
        timeout=30,
    )
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2, result.stderr
    assert len(lines) == 1 and "not UTF-8" in lines[0] and "Traceback" not in result.stderr, lines


@pytest.mark.skipif(not hasattr(signal, "SIGHUP"), reason="SIGHUP is POSIX")
def test_a_rejected_reload_never_stops_later_reloads(tmp_path):
    config = {"nvml": {"backend": "sim"}, "poll": {"fast_interval": 0.5}}
    with exporter(tmp_path, config=config) as (url, proc):
        path = tmp_path / "gpuwarden.yaml"
        path.write_bytes(b"poll: {fast_interval: \xff}\n")
        proc.send_signal(signal.SIGHUP)
        time.sleep(1.5)
        write_yaml(path, {**config, "metrics": {"exclude": ["gpuwarden_temperature_celsius"]}})
        proc.send_signal(signal.SIGHUP)
        deadline = time.monotonic() + 10
        while "gpuwarden_temperature_celsius{" in httpx.get(url + "/metrics").text:
            assert time.monotonic() < deadline, "the valid reload after a rejected one was not applied"
            time.sleep(0.2)
        time.sleep(1.2)  # the counters are rendered with the next snapshot
        series = parse_exposition(httpx.get(url + "/metrics").text)
        proc.terminate()
        logs = proc.communicate(timeout=10)[1]
    assert values(series, "gpuwarden_config_reloads_total", result="rejected") == [1]
    assert values(series, "gpuwarden_config_reloads_total", result="applied") == [1]
    assert "not UTF-8" in logs and "Traceback" not in logs


def test_quality_values_are_honoured(tmp_path):
    assert negotiate("application/openmetrics-text;q=0, text/plain", "") == (False, False)
    assert negotiate("application/openmetrics-text;version=1.0.0,text/plain;version=0.0.4;q=0.5", "") == (True, False)
    assert negotiate("text/plain;q=0.9, application/openmetrics-text;q=0.5", "gzip;q=0") == (False, False)
    assert negotiate("", "gzip, deflate") == (False, True)
    with exporter(tmp_path) as (url, _):
        answer = httpx.get(
            url + "/metrics",
            headers={"accept": "application/openmetrics-text;q=0, text/plain", "accept-encoding": "gzip;q=0"},
        )
        head = httpx.head(url + "/healthz")
        ready = httpx.head(url + "/readyz")
    assert answer.headers["content-type"].startswith("text/plain") and "content-encoding" not in answer.headers
    assert head.status_code == 200 and ready.status_code == 200


def test_tls_costs_are_bounded_through_asyncio_settings_that_still_exist():
    """bound_tls_costs relies on two process-wide asyncio settings; a Python release that drops them fails here."""
    import asyncio.constants
    import asyncio.sslproto

    from gpuwarden.web.limits import bound_tls_costs

    saved = asyncio.sslproto.SSLProtocol.max_size, asyncio.constants.SSL_HANDSHAKE_TIMEOUT
    try:
        bound_tls_costs(3.0)
        protocol = asyncio.sslproto.SSLProtocol(
            asyncio.new_event_loop(), asyncio.Protocol(), ssl.create_default_context(), None, server_side=False
        )
        assert len(protocol._ssl_buffer) == 16 * 1024
        assert protocol._ssl_handshake_timeout == 3.0
    finally:
        asyncio.sslproto.SSLProtocol.max_size, asyncio.constants.SSL_HANDSHAKE_TIMEOUT = saved


EXPORTER_MEMORY_LIMIT_MIB = 256  # the Helm chart's limit for the exporter


def _probe_while(url: str, stop: threading.Event, verify: object = True) -> list:
    """/healthz and /readyz every 0.2 s until `stop`: the ones refused or unanswered (how fast they are answered is
    bench/probes_under_load.py's: a loaded test machine says nothing about it)."""
    misses = []
    with httpx.Client(timeout=10.0, verify=verify) as client:
        while not stop.wait(0.2):
            for path in ("/healthz", "/readyz"):
                try:
                    status = client.get(url + path, headers={"connection": "close"}).status_code
                    if status not in (200, 503):
                        misses.append((path, status))
                except httpx.HTTPError as exc:
                    misses.append((path, type(exc).__name__))
    return misses


CLOSE_REQUEST = b"GET /api/v1/gpus HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"


HTTP10_REQUEST = b"GET /api/v1/gpus HTTP/1.0\r\n\r\n"


@pytest.mark.parametrize(
    ("request_line", "tls"), [(CLOSE_REQUEST, False), (HTTP10_REQUEST, False), (CLOSE_REQUEST, True)]
)
def test_responses_never_read_after_connection_close_are_dropped_and_probes_answered(tmp_path, request_line, tls):
    """1,100 clients each ask /api/v1/gpus (~100 KB) with Connection: close (or HTTP/1.0) and never read. Before:
    1,032 connections held for good, 121 of 134 probes refused, TLS OOM-killed at 256 MiB. Now every connection
    is aborted once it has been closing for the header timeout, at most, and every probe is answered within 1 s;
    the server runs in a memory cgroup at the chart's limit."""
    from tests.helpers.cgroup import memory_cgroup

    with memory_cgroup(EXPORTER_MEMORY_LIMIT_MIB) as cgroup:
        flags, client_tls = ["--sim", "--web.header-timeout", "2"], None
        if tls:
            import trustme

            ca = trustme.CA()
            server = ca.issue_cert("127.0.0.1", "localhost")
            server.cert_chain_pems[0].write_to_path(str(tmp_path / "server.crt"))
            server.private_key_pem.write_to_path(str(tmp_path / "server.key"))
            web = {
                "tls_server_config": {
                    "cert_file": str(tmp_path / "server.crt"),
                    "key_file": str(tmp_path / "server.key"),
                }
            }
            flags += ["--web.config.file", str(write_yaml(tmp_path / "web.yml", web))]
            client_tls = ssl.create_default_context()
            client_tls.check_hostname, client_tls.verify_mode = False, ssl.CERT_NONE
        with running_cli(*flags, cgroup=cgroup, tls=tls) as (url, proc):
            port = int(url.rsplit(":", 1)[1])
            httpx.get(url + "/api/v1/gpus", timeout=30, verify=False)  # the JSON API built once, as after any use
            # answers larger than the kernel's buffer (loopback's autotuned one swallows 107 KB whole, and the
            # server would close every connection at once, testing nothing): the server holds them, and must abort
            shrink_send_buffer(proc.pid, port, 16384)
            stop = threading.Event()
            probes: list = []
            prober = threading.Thread(target=lambda: probes.extend(_probe_while(url, stop, verify=False)), daemon=True)
            prober.start()
            baseline = _sockets_held(proc.pid)
            clients = [c for c in (never_reading_request(port, request_line, client_tls) for _ in range(1100)) if c]
            held = len(clients)

            from tests.helpers.common import wait_for

            # the header timeout (2 s) and a sweep (1 s) after each response was closed; slow on a loaded machine
            wait_for(lambda: _sockets_held(proc.pid) <= baseline + 2, timeout=60, step=0.5)
            stop.set()
            prober.join()
            for sock in clients:
                sock.close()
            assert proc.poll() is None and cgroup.oom_kills() == 0, f"peak {cgroup.peak_mib():.0f} MiB"
            assert httpx.get(url + "/healthz", timeout=5, verify=False).status_code == 200
            series = parse_exposition(httpx.get(url + "/metrics", timeout=5, verify=False).text)
    assert held >= 1000
    # the premise: answers waited unread in the server's buffer until their deadline aborted them
    assert values(series, "gpuwarden_http_rejected_total", reason="write_timeout")[0] >= 1
    assert probes == [], probes[:20]


def test_a_probe_accepted_at_the_limit_keeps_its_connection_while_its_request_is_on_its_way(tmp_path):
    """At the connection limit, with every slot held by a client that asked with Connection: close and never reads,
    a probe's connection is accepted before its request arrives. The next newcomer closed "the oldest connection
    waiting for a request": that probe (a ReadError under load, CI 2026-11-28). A closer goes first now.

    The closers hold their slots only while their answers wait in the server's own buffer. Loopback's autotuned
    send buffer swallowed each 107 KB answer whole, the server closed every closer at once, and no slot was held:
    the test read 0 evictions (build machine and CI, Linux 6.18). The server's send buffer is set small, as an
    answer larger than the kernel's buffer leaves it, and the test checks that the closers hold every slot first."""
    from tests.helpers.common import wait_for

    limit = 16
    with exporter(tmp_path, "--web.max-connections", str(limit), "--web.header-timeout", "60") as (url, proc):
        port = int(url.rsplit(":", 1)[1])
        httpx.get(url + "/api/v1/gpus", timeout=30)
        shrink_send_buffer(proc.pid, port, 16384)
        closers = [never_reading_request(port, CLOSE_REQUEST) for _ in range(limit)]
        assert all(closers)

        def answered(sock: socket.socket) -> bool:  # the server has written (and so closed) its response
            sock.setblocking(False)
            try:
                return bool(sock.recv(1, socket.MSG_PEEK))
            except BlockingIOError:
                return False

        def dropped(socks: tuple[socket.socket, ...]) -> int:  # the server's end closed: no descriptor holds it
            held = sockets_on(port)
            return sum(held.get(sock.getsockname()[1], 0) == 0 for sock in socks)

        wait_for(lambda: all(answered(sock) for sock in closers), timeout=30)
        assert dropped(tuple(closers)) == 0, "the closers' answers left the server's buffer: no slot is held"
        probe = socket.create_connection(("127.0.0.1", port))  # its request not yet sent
        # accepted: a closer made room for it (under load the server's write deadline may also have closed a closer
        # whose unread answer stalled: at least one, not exactly one; the full suite under load, 2026-11-28)
        wait_for(lambda: dropped(closers) >= 1, timeout=30)
        before = dropped((*closers, probe))
        newcomer = socket.create_connection(("127.0.0.1", port))
        wait_for(lambda: dropped((*closers, probe)) > before or before == len(closers), timeout=30)
        assert sockets_on(port).get(probe.getsockname()[1], 0) != 0  # the probe's connection is held
        probe.setblocking(True)
        probe.settimeout(30)
        probe.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        answer = b""
        with suppress(ConnectionResetError):
            while chunk := probe.recv(65536):
                answer += chunk
        for sock in (*closers, probe, newcomer):
            sock.close()
        series = parse_exposition(httpx.get(url + "/metrics").text)
    assert answer.startswith(b"HTTP/1.1 200"), answer[:200]
    assert values(series, "gpuwarden_http_rejected_total", reason="evicted")[0] >= 2  # two closers made room


def test_a_probe_accepted_in_one_burst_with_idle_connections_is_answered(tmp_path):
    """At the limit, a burst accepted in one turn of the loop (the server stopped while clients connected, as a
    loaded node delays it) holds a probe whose request is already sent but not yet read. Before: each newcomer of
    the burst evicted the oldest connection waiting for a request, and the probe was one (CI, 2026-11-28: a reset
    /healthz under 1,100 clients); and every newcomer after the first "evicted" the same connection again, aborted
    but not yet reported lost, so the counter said 22 where one connection was closed. Now a connection is
    evictable only with nothing in its socket, the burst past the probe reserve is refused, and the counter
    counts connections closed."""
    from gpuwarden.web.protocol import PROBE_RESERVE
    from tests.helpers.common import wait_for

    limit, past_reserve = 16, 9
    with exporter(tmp_path, "--web.max-connections", str(limit), "--web.header-timeout", "30") as (url, proc):
        port = int(url.rsplit(":", 1)[1])
        httpx.get(url + "/healthz", timeout=30)
        proc.send_signal(signal.SIGSTOP)
        try:
            before = [socket.create_connection(("127.0.0.1", port)) for _ in range(limit)]
            probe = socket.create_connection(("127.0.0.1", port))
            probe.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
            after = [socket.create_connection(("127.0.0.1", port)) for _ in range(PROBE_RESERVE + past_reserve)]
        finally:
            proc.send_signal(signal.SIGCONT)
        probe.settimeout(30)
        answer = b""
        with suppress(ConnectionResetError):
            while chunk := probe.recv(65536):
                answer += chunk
        idle = (*before, *after)

        def closed() -> int:
            count = 0
            for sock in idle:
                try:
                    count += sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) == b""
                except BlockingIOError:
                    pass
                except ConnectionResetError:
                    count += 1
            return count

        with httpx.Client(timeout=30) as scraper:  # one connection: it may evict one idle connection, no more

            def evicted() -> float:
                return values(
                    parse_exposition(scraper.get(url + "/metrics").text),
                    "gpuwarden_http_rejected_total",
                    reason="evicted",
                )[0]

            wait_for(lambda: closed() >= past_reserve and closed() == evicted(), timeout=30, step=0.2)
        for sock in (*idle, probe):
            sock.close()
    assert answer.startswith(b"HTTP/1.1 200"), answer[:200]


def _status(sock: socket.socket) -> bytes:
    """The status line of the one response a connection gets ('' where it was reset or closed unanswered)."""
    sock.settimeout(30)
    answer = b""
    with suppress(ConnectionResetError):
        while b"\r\n" not in answer and (chunk := sock.recv(65536)):
            answer += chunk
    return answer.split(b"\r\n", 1)[0]


def test_past_the_reserve_a_burst_of_requests_is_refused_except_the_probe_among_them(tmp_path):
    """Every connection of a burst past the limit and the probe reserve has sent its request, none is idle, so no
    one can be evicted: the loop had to refuse a connection before reading it, and the probe in the burst was reset
    (CI, 2026-11-28: the same failure as above, under load, after the burst's fix). Now each newcomer past the
    reserve is read: the probe is answered 200, the others 503, and those within limit and reserve 200."""
    from gpuwarden.web.protocol import PROBE_RESERVE

    limit, past = 16, 6
    request = b"GET /api/v1/gpus HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"
    with exporter(tmp_path, "--web.max-connections", str(limit), "--web.header-timeout", "30") as (url, proc):
        port = int(url.rsplit(":", 1)[1])
        httpx.get(url + "/healthz", timeout=30)
        proc.send_signal(signal.SIGSTOP)
        try:
            within = [socket.create_connection(("127.0.0.1", port)) for _ in range(limit + PROBE_RESERVE)]
            beyond = [socket.create_connection(("127.0.0.1", port)) for _ in range(past)]
            probe = socket.create_connection(("127.0.0.1", port))
            for sock in (*within, *beyond):
                sock.sendall(request)
            probe.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        finally:
            proc.send_signal(signal.SIGCONT)
        statuses = [_status(sock) for sock in within], [_status(sock) for sock in beyond], _status(probe)
        for sock in (*within, *beyond, probe):
            sock.close()
    assert statuses[2] == b"HTTP/1.1 200 OK", statuses[2]
    assert statuses[1] == [b"HTTP/1.1 503 Service Unavailable"] * past, statuses[1]
    assert statuses[0] == [b"HTTP/1.1 200 OK"] * (limit + PROBE_RESERVE), statuses[0]


def test_clients_aborted_at_the_pipeline_limit_over_tls_log_no_traceback(tmp_path):
    """Over TLS, a client aborted at the pipeline limit while its queued responses were being made logged a
    traceback per connection (asyncio's TLS transport raises on a write after abort): 1.69 MB of log in 20 s."""
    web, _ca = tls_web_config(tmp_path)
    client = ssl.create_default_context()
    client.check_hostname, client.verify_mode = False, ssl.CERT_NONE
    with running_cli("--sim", "--web.config.file", str(web), tls=True) as (url, proc):
        port = int(url.rsplit(":", 1)[1])
        for _ in range(20):
            with suppress(OSError), client.wrap_socket(socket.create_connection(("127.0.0.1", port))) as sock:
                sock.sendall(b"GET /api/v1/gpus HTTP/1.1\r\nHost: x\r\n\r\n" * 40)  # past MAX_PIPELINE (16)
                sock.recv(1)
        series = parse_exposition(httpx.get(url + "/metrics", verify=False).text)
    log = proc.stderr.read()
    assert values(series, "gpuwarden_http_rejected_total", reason="pipeline")[0] >= 1  # the limit was reached
    assert "Traceback" not in log, log[-2000:]


def _sockets_held(pid: int) -> int:
    """The process's own socket descriptors (its listener, its open connections): a connection it holds open,
    whatever the client's side shows (an unread response sits in the client's kernel buffer either way)."""
    count = 0
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        with suppress(OSError):
            count += fd.readlink().as_posix().startswith("socket:")
    return count


def _slow_reader(port: int, tls: ssl.SSLContext | None, stop_after: int, requests: int) -> socket.socket | None:
    """Pipelines `requests` GET /api/v1/gpus, reads `stop_after` bytes of the answers, then never reads again."""
    sock = never_reading_request(port, b"GET /api/v1/gpus HTTP/1.1\r\nHost: x\r\n\r\n" * requests, tls)
    if sock is None:
        return None
    read = 0
    with suppress(OSError):
        while read < stop_after:
            chunk = sock.recv(min(65536, stop_after - read))
            if not chunk:
                break
            read += len(chunk)
    return sock


@pytest.mark.parametrize("tls", [False, True])
def test_slow_readers_of_pipelined_answers_stay_within_the_charts_memory(tmp_path, tls):
    """300 connections each pipeline 16 GET /api/v1/gpus (~100 KB each), read 128 KiB and stop. Before: over TLS
    the exporter was OOM-killed at 256 MiB; over plain HTTP +70-105 MiB, not returned. In a memory cgroup at the
    chart's limit: no OOM kill, every probe answered within 1 s, and an authorised scrape answered."""
    from tests.helpers.cgroup import memory_cgroup
    from tests.helpers.common import wait_for

    with memory_cgroup(EXPORTER_MEMORY_LIMIT_MIB) as cgroup:
        flags, client_tls = ["--sim", "--web.header-timeout", "2"], None
        if tls:
            flags += ["--web.config.file", str(tls_web_config(tmp_path)[0])]
            client_tls = ssl.create_default_context()
            client_tls.check_hostname, client_tls.verify_mode = False, ssl.CERT_NONE
        with running_cli(*flags, cgroup=cgroup, tls=tls) as (url, proc):
            port = int(url.rsplit(":", 1)[1])
            httpx.get(url + "/api/v1/gpus", timeout=30, verify=False)
            stop = threading.Event()
            probes: list = []
            prober = threading.Thread(target=lambda: probes.extend(_probe_while(url, stop, verify=False)), daemon=True)
            prober.start()
            baseline = _sockets_held(proc.pid)
            clients = [c for c in (_slow_reader(port, client_tls, 128 * 1024, 16) for _ in range(300)) if c]
            scrape = httpx.get(url + "/metrics", timeout=5, verify=False)
            # each slow reader is aborted by the write timeout (2 s here): the server lets every one of them go
            wait_for(lambda: proc.poll() is not None or _sockets_held(proc.pid) <= baseline + 2, timeout=90, step=0.5)
            stop.set()
            prober.join()
            alive = proc.poll() is None and cgroup.oom_kills() == 0
            peak = cgroup.peak_mib()
            for sock in clients:
                sock.close()
    assert alive, f"OOM-killed: peak {peak:.0f} MiB"
    assert scrape.status_code == 200
    assert probes == [], probes[:20]


def _pace_never_read(port: int, clients: int, stop: threading.Event) -> int:
    """`clients` connections that each send `GET /api/v1/gpus` every 0.5 s and never read (reopened when the
    server drops them, at most 80 new ones a round: 400 answers computed at once would be load, shed by design,
    which is not what this measures); returns the requests sent."""
    request, sent = b"GET /api/v1/gpus HTTP/1.1\r\nHost: x\r\n\r\n", 0
    socks: list[socket.socket | None] = [None] * clients
    while not stop.wait(0.5):
        opened = 0
        for number, sock in enumerate(socks):
            try:
                if sock is None:
                    if opened >= 80:
                        continue
                    opened += 1
                    sock = socks[number] = never_reading_request(port, request)
                    sent += sock is not None
                    continue
                sock.setblocking(False)
                sent += sock.send(request) > 0
            except BlockingIOError:
                pass
            except OSError:
                sock.close()
                socks[number] = None
    for sock in socks:
        if sock is not None:
            sock.close()
    return sent


def test_clients_that_never_read_their_answers_do_not_shed_a_scrape(tmp_path):
    """400 clients each ask for `GET /api/v1/gpus` every 0.5 s and never read (a small receive buffer, MSS 1,400).
    Each connection's next request then waits in uvicorn's send() for a drain that never comes, until the write
    timeout: before, it held a place under the request limit (256) meanwhile, and scrapes got 503 (the review: 54
    of 153 under 300 such clients). Now such a request is parked, not load. In a memory cgroup at the chart's limit:
    every scrape answered 200, every probe within 1 s, no OOM kill."""
    from tests.helpers.cgroup import memory_cgroup

    with (
        memory_cgroup(EXPORTER_MEMORY_LIMIT_MIB) as cgroup,
        running_cli("--sim", "--web.header-timeout", "3", cgroup=cgroup) as (url, proc),
    ):
        port = int(url.rsplit(":", 1)[1])
        httpx.get(url + "/api/v1/gpus", timeout=30)  # the API built before the attack, as on a used node
        stop = threading.Event()
        probes: list = []
        sent: list[int] = []
        prober = threading.Thread(target=lambda: probes.extend(_probe_while(url, stop)), daemon=True)
        attacker = threading.Thread(target=lambda: sent.append(_pace_never_read(port, 400, stop)), daemon=True)
        prober.start()
        attacker.start()
        scrapes = []
        with httpx.Client(timeout=5) as client:
            while len(scrapes) < 40:
                time.sleep(0.2)
                try:
                    scrapes.append(client.get(url + "/metrics").status_code)
                except httpx.HTTPError as exc:
                    scrapes.append(type(exc).__name__)
        stop.set()
        prober.join()
        attacker.join()
        exposition = parse_exposition(httpx.get(url + "/metrics", timeout=5).text)
        write_timeouts = values(exposition, "gpuwarden_http_rejected_total", reason="write_timeout")
        alive = proc.poll() is None and cgroup.oom_kills() == 0
    assert alive
    assert sent and sent[0] > 1000  # the attack ran: hundreds of clients asking again and again
    assert write_timeouts and write_timeouts[0] > 0  # their answers sat unread until the write timeout
    assert [s for s in scrapes if s != 200] == [], scrapes
    assert probes == [], probes[:20]
