"""`gpuwarden fleet` in a memory cgroup at its chart's limit (384 MiB) under clients that never read and a backend
answering at the fleet's own caps (issue 48, acceptance 6). Before: 600 or 1,100 `Connection: close` clients that
never read a 730 KB answer, or answers of 25,000 or 49,000 series, OOM-killed it.

The service is the real CLI process; the clients are sockets as on a real network (MSS 1,400, a 4 KiB receive
buffer); the upstream is a fake Prometheus on loopback (tests/helpers/fake_prometheus.py), because a real one cannot
be made to answer every query with 50,000 series of 8 MB. The bench with every figure: bench/fleet_hostile.py."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from pathlib import Path

import httpx
import pytest

from tests.helpers.cgroup import memory_cgroup
from tests.helpers.common import free_port, rss_mib, wait_for
from tests.helpers.fake_prometheus import FakePrometheus, capped_answer, everyday_answer, reply
from tests.helpers.hostile import FLEET_CLIENTS as CLIENTS
from tests.helpers.hostile import FLEET_ENDPOINTS as ENDPOINTS
from tests.helpers.hostile import FLEET_LIMIT_MIB as LIMIT_MIB
from tests.helpers.hostile import never_reading_client
from tests.helpers.stack import wait_ready

pytestmark = [pytest.mark.slow, pytest.mark.serial]  # 1,100 connections against a memory limit: one at a time


def _backend(body: bytes) -> FakePrometheus:
    """Every query answered with `body`, but the readiness probe's and the latency calibration's as Prometheus does."""
    fake = FakePrometheus()
    fake.answer = lambda query, handler: reply(handler, everyday_answer(query) or body)
    return fake


@contextmanager
def _fleet(backend: FakePrometheus, cgroup, log: Path) -> Iterator[tuple[str, subprocess.Popen]]:  # noqa: ANN001
    """The fleet CLI inside `cgroup`, its log in a file (a pipe nobody reads would stall it once full)."""
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("GPUWARDEN_")}
    with log.open("w") as sink:
        proc = subprocess.Popen(
            [sys.executable, "-m", "gpuwarden", "fleet", "--prometheus-url", backend.url, "--node-label", "node",
             "--query-timeout", "30", "--web.listen-address", f"127.0.0.1:{port}"],
            stdout=subprocess.DEVNULL, stderr=sink, env=env,
            preexec_fn=cgroup.enter,  # noqa: PLW1509 - joins the cgroup before exec
        )  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    try:
        wait_ready(url + "/healthz")
        yield url, proc
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            raise


class Probes(threading.Thread):
    """/healthz and /readyz every 0.5 s on a new connection each, as the kubelet sends them: every outcome kept."""

    def __init__(self, url: str) -> None:
        super().__init__(daemon=True)
        self.url, self.stop, self.outcomes = url, threading.Event(), []

    def run(self) -> None:
        while not self.stop.wait(0.5):
            for path in ("/healthz", "/readyz"):
                try:
                    status = httpx.get(self.url + path, timeout=10, headers={"connection": "close"}).status_code
                except httpx.HTTPError as exc:
                    status = type(exc).__name__
                self.outcomes.append((path, status))

    def failures(self) -> list:
        return [outcome for outcome in self.outcomes if outcome[1] != 200]


def _sockets(pid: int) -> int:
    count = 0
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        with suppress(OSError):
            count += Path(fd).readlink().as_posix().startswith("socket:")
    return count


def test_clients_that_never_read_a_large_view_share_one_copy_of_it(tmp_path: Path) -> None:
    """1,100 clients ask /api/v1/fleet (~700 KB at 2,000 nodes) with Connection: close and never read. Each held its
    own rendering before: +225 MiB over the warm service here (an OOM kill at 600 such clients in the issue's
    cluster). Now the view's JSON is rendered once and every client is sent those bytes: the growth stays under an
    eighth of 1,100 copies, every probe is answered, and every connection is cut off at the header timeout."""
    backend, log = _backend(capped_answer(2000)), tmp_path / "fleet.log"
    try:
        with (
            memory_cgroup(LIMIT_MIB, tcp=True) as cgroup,
            _fleet(backend, cgroup, log) as (url, proc),
        ):
            view = httpx.get(url + "/api/v1/fleet", timeout=60)
            assert view.status_code == 200 and len(view.content) > 500_000, len(view.content)
            warm, baseline = rss_mib(proc.pid), _sockets(proc.pid)
            probes = Probes(url)
            probes.start()
            clients = [never_reading_client(int(url.rsplit(":", 1)[1]), "/api/v1/fleet") for _ in range(CLIENTS)]
            assert sum(c is not None for c in clients) >= 1000
            wait_for(lambda: _sockets(proc.pid) <= baseline + 2, timeout=90, step=0.5)  # all cut off
            probes.stop.set()
            probes.join()
            for sock in clients:
                if sock is not None:
                    sock.close()
            assert proc.poll() is None and cgroup.oom_kills() == 0
            growth = cgroup.peak_mib() - warm
            assert growth < CLIENTS * len(view.content) / 8 / 2**20, f"{growth:.0f} MiB over the warm service"
            assert probes.failures() == [], probes.failures()[:10]
            assert len(probes.outcomes) >= 4
            assert "Traceback" not in log.read_text()
    finally:
        backend.close()


def test_answers_at_the_caps_and_clients_that_never_read_stay_within_the_limit(tmp_path: Path) -> None:
    """Every query answered with 49,999 series in ~8.3 MB (the fleet's caps: max_answer_series 50,000, max_answer_bytes
    8 MiB), every endpoint and the page asked at once, and 1,100 never-reading clients over them all. Before: the
    page's answers alone passed 384 MiB. Now the answers held at once stay within --max-answers-bytes: a view that
    needs more is answered 503 naming it, never an OOM kill; the probes answer throughout."""
    backend, log = _backend(capped_answer(49_999, 8 * 2**20 - 64 * 1024)), tmp_path / "fleet.log"
    try:
        with (
            memory_cgroup(LIMIT_MIB, tcp=True) as cgroup,
            _fleet(backend, cgroup, log) as (url, proc),
        ):
            probes = Probes(url)
            probes.start()
            answers: list[tuple[str, int, str]] = []

            def read(path: str) -> None:
                with suppress(httpx.HTTPError):
                    answer = httpx.get(url + path, timeout=120)
                    answers.append((path, answer.status_code, answer.text[:300]))

            readers = [threading.Thread(target=read, args=(path,)) for path in ENDPOINTS * 2]
            for reader in readers:
                reader.start()
            port = int(url.rsplit(":", 1)[1])
            clients = [never_reading_client(port, ENDPOINTS[i % len(ENDPOINTS)]) for i in range(CLIENTS)]
            for reader in readers:
                reader.join()
            probes.stop.set()
            probes.join()
            for sock in clients:
                if sock is not None:
                    sock.close()
            assert proc.poll() is None and cgroup.oom_kills() == 0, f"peak {cgroup.peak_mib():.0f} MiB"
            assert cgroup.peak_mib() + cgroup.tcp_peak_mib() < LIMIT_MIB
            assert len(answers) == 2 * len(ENDPOINTS), answers
            for path, status, text in answers:
                assert status in (200, 503), (path, status, text)
                if status == 503 and path != "/":  # the answers' budget, the responses', or the server's shedding
                    assert "max_answers_bytes" in text or '"busy"' in text or text == "Service Unavailable", text
            assert probes.failures() == [], probes.failures()[:10]
            assert "Traceback" not in log.read_text()
    finally:
        backend.close()
