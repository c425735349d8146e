"""Helpers the tests share: a hand-moved clock, settings for the simulator, expositions parsed with
prometheus_client's own parser, and gpuwarden's app on its real HTTP server (no mock of gpuwarden anywhere)."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from gpuwarden.config.settings import Settings, load_settings
from gpuwarden.exposition.render import Renderer
from gpuwarden.runtime.pipeline import Pipeline
from gpuwarden.sim.scenario import Scenario
from gpuwarden.web.front import create_front
from gpuwarden.web.readiness import readiness_under
from tests.helpers.daemon import free_port


class ManualClock:
    """A clock the test moves by hand, for the fake library's notion of time."""

    def __init__(self, start: float = 1000.0) -> None:
        self.now = start

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


def scenario_from(data: dict[str, Any]) -> Scenario:
    data = {"name": "test", **data}
    return Scenario.model_validate(data)


def settings(**sections: dict[str, Any]) -> Settings:
    flags = {f"{section}.{key}": value for section, values in sections.items() for key, value in values.items()}
    flags.setdefault("nvml.backend", "sim")
    # Tests move the fake's clock by hand between polls: drain the sample buffer on every poll. NVLink's per-link
    # error counters keep their default interval (read at the first slow cycle, then every 60 s of the real clock):
    # they were most of a slow cycle's cost, and only the tests that watch them grow need them every poll
    # (NVLINK_ERRORS_EVERY_POLL).
    flags.setdefault("poll.samples_interval", 0)
    return load_settings(None, environ={}, flags=flags)


NVLINK_ERRORS_EVERY_POLL = {"nvlink_errors_interval": 0}  # settings(poll=...) for the tests that watch them grow


def raw(port: int, data: bytes, wait: float = 1.0) -> bytes:
    """Send bytes to a loopback port, read until the server closes or `wait` passes."""
    with socket.create_connection(("127.0.0.1", port)) as sock:
        sock.sendall(data)
        sock.settimeout(wait)
        chunks = []
        try:
            while chunk := sock.recv(65536):
                chunks.append(chunk)
        except OSError:
            pass
    return b"".join(chunks)


class ServedApp:
    """An ASGI app on gpuwarden's HTTP server (exporter/gpuwarden/web/server.py, uvicorn) in a thread, on a loopback
    port."""

    def __init__(self, app: Any, port: int | None = None, guard: Any = None, ssl_context: Any = None) -> None:
        from gpuwarden.web.limits import ConnectionGuard
        from gpuwarden.web.server import HttpServer

        self.port = port or free_port()
        self.url = f"{'https' if ssl_context else 'http'}://127.0.0.1:{self.port}"
        self.server = HttpServer(app, guard or ConnectionGuard(), ssl_context=ssl_context, graceful_s=1.0)
        self.sock = socket.socket()
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("127.0.0.1", self.port))
        self.thread = threading.Thread(target=self.server.run, args=(self.sock,), daemon=True)

    def start(self) -> None:
        self.thread.start()
        if not self.server.started.wait(10):
            raise RuntimeError("the HTTP server did not start")

    def stop(self) -> None:
        self.server.stop()
        self.thread.join(5)
        self.sock.close()


class LiveServer:
    """gpuwarden's app on its real HTTP server on a loopback port, with its pipeline running."""

    def __init__(self, pipeline: Pipeline) -> None:
        self.pipeline = pipeline
        self.renderer = Renderer(pipeline.settings.metrics.selection())
        app = create_front(
            lambda: pipeline.snapshot,
            readiness_under(lambda: pipeline.settings),
            self.renderer,
            pipeline.settings.web.telemetry_path,
        )
        self.served = ServedApp(app)
        self.port, self.url = self.served.port, self.served.url
        self.client = plain_client(timeout=10)

    def __enter__(self) -> LiveServer:
        self.pipeline.start()
        self.served.start()
        self.pipeline.ready_once.wait(10)
        return self

    def __exit__(self, *exc: object) -> None:
        self.client.close()
        self.served.stop()
        self.pipeline.stop(timeout=0.5)

    def get(self, path: str, **kwargs: Any) -> httpx.Response:
        return self.client.get(self.url + path, **kwargs)


def plain_client(**kwargs: Any) -> httpx.Client:
    """An HTTP client for one server's plain-HTTP URL that opens a connection per request, as `httpx.get` does, but
    builds its TLS context once: `httpx.get` loads certifi's CA bundle for every request (~25 ms of CPU each), which
    was a sixth of the developer tier's CPU in tests that poll a server until a condition holds."""
    return httpx.Client(limits=httpx.Limits(max_keepalive_connections=0), **kwargs)


def sweep(cases: Iterable[Any], quick: Callable[[Any], bool]) -> list[Any]:
    """Parameters of a test that sweeps scenarios or faults: the `quick` ones run in every tier, the others are
    marked slow (the whole suite, CI's, runs them all; the developer tier one of each kind of case)."""
    return [case if quick(case) else pytest.param(*_values(case), marks=pytest.mark.slow) for case in cases]


def _values(case: Any) -> tuple[Any, ...]:
    return case if isinstance(case, tuple) else (case,)


def write_yaml(path: Path, data: Any) -> Path:
    path.write_text(yaml.safe_dump(data))
    return path


Series = tuple[str, frozenset[tuple[str, str]]]  # (sample name, labels)


def parse_exposition(text: str) -> dict[Series, float]:
    """Exposition text → {(name, labels): value} with prometheus_client's own parser."""
    from prometheus_client.parser import text_string_to_metric_families

    series: dict[Series, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            series[(sample.name, frozenset(sample.labels.items()))] = sample.value
    return series


def series_of(snapshot: Any, wanted: Callable[[str], bool] = lambda name: True) -> dict[Series, float]:
    """What a scrape of `snapshot` exports, as parse_exposition gives it, read from the renderer's families before
    they are formatted: the tests that poll a pipeline read many snapshots, and prometheus_client's parser took most
    of their time. The formatting is tested on its own: test_exposition renders every shipped scenario with
    prometheus_client too and compares the bytes, and promtool checks them (test_scenarios)."""
    from gpuwarden.exposition.text import sample_name

    series: dict[Series, float] = {}
    for family in Renderer(wanted).families(snapshot):
        name = sample_name(family)
        for labels, value in family.samples:
            series[(name, frozenset(zip(family.labels, labels, strict=True)))] = float(value)
    return series


def values(series: dict[Series, float], name: str, **labels: str) -> list[float]:
    """Values of every series named `name` whose labels include `labels`."""
    wanted = set(labels.items())
    return [value for (n, lbls), value in series.items() if n == name and wanted <= lbls]


def rss_mib(pid: int) -> float:
    """Resident memory of a process, MiB (from /proc)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError(f"no VmRSS for process {pid}")


def wait_for(predicate: Callable[[], object], timeout: float = 10.0, step: float = 0.05) -> None:
    """Poll `predicate` until it is truthy; fail the test after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(step)


def wait_for_slow_cycles(pipeline: Pipeline, cycles: int) -> None:
    """Wait until `cycles` slow-tier cycles have been published (each publishes a new `tier_finished["slow"]`), or
    a snapshot says NVML is down (no slow cycle runs then)."""
    seen: set[float] = set()

    def enough() -> bool:
        snapshot = pipeline.snapshot
        finished = snapshot.tier_finished.get("slow")
        if finished is not None:
            seen.add(finished)
        return len(seen) >= cycles or (snapshot.id > 0 and not snapshot.nvml_up)

    wait_for(enough, timeout=15, step=0.02)


def wait_for_every_gpu_read(pipeline: Pipeline, timeout: float = 60.0) -> None:
    """Wait until every GPU that answers has had its slow tier read and none is stale (or NVML is down). Published
    slow cycles are not enough: on a starved machine a GPU's read can outlast the cycle's publish wait (no slow
    readings yet: its NVLink and fabric checks are pending) or its call deadline (stale: npd-plugin and
    slurm-healthcheck answer Unknown), and a test that asserts a definite verdict must wait for a definite one."""

    def read() -> bool:
        snapshot = pipeline.snapshot
        if snapshot.id > 0 and not snapshot.nvml_up:
            return True
        return snapshot.id > 0 and all("slow" in gpu.updated_at and not gpu.stale for gpu in snapshot.gpus if gpu.up)

    wait_for(read, timeout=timeout, step=0.05)


def polled(sim, make_pipeline, scenario, polls: int, **sections):  # noqa: ANN001, ANN201 - the fixtures, a scenario
    """A pipeline (from the make_pipeline fixture) after `polls` polls of `scenario`, one a second of a manual clock;
    and the fake library under it (close it to end the scenario before the test does)."""
    clock = ManualClock()
    fake = sim(scenario, clock=clock)
    pipeline = make_pipeline(**sections)
    read_kernel_log(pipeline)
    for _ in range(polls):
        pipeline.poll_once()
        clock.advance(1.0)
    return pipeline, fake


def read_kernel_log(pipeline) -> None:  # noqa: ANN001 - a Pipeline
    """Read the kernel log the pipeline would follow (a scenario's `kernel_log`, or nvml.kernel_log) up to its end
    before the first poll: poll_once() starts no threads, and the poller's start() would start the follower."""
    path = pipeline.poller.plan.kernel_log
    if path:
        pipeline.poller.follow_kernel_log(path)
        assert pipeline.poller.kernel_reader.caught_up.wait(30), f"the kernel log {path} was not read"


def poll_series(sim, scenario, seconds: int, **sections):  # noqa: ANN001, ANN201 - the sim fixture, a scenario
    """Run a pipeline over the simulator for `seconds` of a manual clock, one poll a second; the pipeline (stopped) and
    each second's exposition (every series: the tests check content, not the collector groups)."""
    clock = ManualClock()
    sim(scenario, clock=clock)
    pipeline = Pipeline(settings(**sections), wall_clock=clock)
    series = []
    for _ in range(seconds):
        pipeline.poll_once()
        series.append(series_of(pipeline.snapshot))
        clock.advance(1.0)
    pipeline.stop(0.5)
    return pipeline, series


def tls_web_config(tmp: Path, *names: str) -> tuple[Path, Any]:
    """A web-config file (exporter-toolkit format) serving TLS with a certificate for `names` (default 127.0.0.1)
    from a fresh trustme CA, written under `tmp`; (the file, the CA, for clients that verify)."""
    import trustme

    ca = trustme.CA()
    cert = ca.issue_cert(*(names or ("127.0.0.1",)))
    cert.cert_chain_pems[0].write_to_path(str(tmp / "cert.pem"))
    cert.private_key_pem.write_to_path(str(tmp / "key.pem"))
    web = tmp / "web.yml"
    web.write_text(f"tls_server_config:\n  cert_file: {tmp / 'cert.pem'}\n  key_file: {tmp / 'key.pem'}\n")
    return web, ca
