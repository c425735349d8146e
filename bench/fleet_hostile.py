"""`gpuwarden fleet` in its chart's memory limit under clients that never read and a backend at the fleet's caps
(issue 48, acceptance 6). Figures for docs/benchmarks.md.

    python bench/fleet_hostile.py                     # every shape below, one fleet process each
    python bench/fleet_hostile.py --shape never-read  # 1,100 `Connection: close` clients of a ~730 KB view, unread
    python bench/fleet_hostile.py --shape caps        # every query answered at max_answer_series/max_answer_bytes
    python bench/fleet_hostile.py --shape both        # the two at once, the clients spread over every endpoint

The fleet service is the real CLI process, started inside a memory cgroup at the chart's limit (384 MiB; cgroup v1
here: its TCP buffers are accounted too and reported beside it, as cgroup v2 counts them in the pod's memory). The
upstream is a fake Prometheus on loopback (tests/helpers/fake_prometheus.py): a real Prometheus cannot be made to
answer every query with 50,000 series of 8 MB. The clients are as on a real network: MSS 1,400 (TCP_MAXSEG) and a
4 KiB receive buffer, one request each, never read. Probes as the kubelet sends them (a fresh connection, 1 s
timeout), every second rather than every 10 s. Prints one JSON line per shape.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

import httpx

from tests.helpers.cgroup import memory_cgroup
from tests.helpers.common import free_port
from tests.helpers.fake_prometheus import FakePrometheus, capped_answer, everyday_answer, reply
from tests.helpers.hostile import FLEET_CLIENTS as CLIENTS
from tests.helpers.hostile import FLEET_ENDPOINTS as ENDPOINTS
from tests.helpers.hostile import FLEET_LIMIT_MIB as LIMIT_MIB
from tests.helpers.hostile import never_reading_client

ROOT = Path(__file__).resolve().parent.parent

MAX_ANSWER_SERIES = 50_000  # the fleet's defaults (exporter/gpuwarden/fleet/settings.py)
MAX_ANSWER_BYTES = 8 * 1024 * 1024


class Prober(threading.Thread):
    """/healthz and /readyz as the kubelet asks them (a new connection; the chart's timeouts: 1 s for liveness, 8 s
    for readiness), every second."""

    def __init__(self, url: str) -> None:
        super().__init__(daemon=True)
        self.url, self.stop = url, threading.Event()
        self.results: dict[str, list[bool]] = {"/healthz": [], "/readyz": []}
        self.timeouts = {"/healthz": 1.0, "/readyz": 8.0}  # deploy/helm/gpuwarden/templates/fleet.yaml
        self.times: list[float] = []

    def run(self) -> None:
        while not self.stop.wait(1.0):
            for path, outcomes in self.results.items():
                started = time.monotonic()
                try:
                    answer = httpx.get(self.url + path, timeout=self.timeouts[path], headers={"connection": "close"})
                    status = answer.status_code
                    outcomes.append(200 <= status < 400)  # the kubelet's success
                except httpx.HTTPError:
                    outcomes.append(False)
                self.times.append(time.monotonic() - started)

    def summary(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for path, outcomes in self.results.items():
            worst = run = 0
            for ok in outcomes:
                run = 0 if ok else run + 1
                worst = max(worst, run)
            out[path] = {"n": len(outcomes), "failed": outcomes.count(False), "most_in_a_row": worst}
        if len(self.times) >= 2:
            out["p50_ms"] = round(statistics.median(self.times) * 1000, 1)
            out["max_ms"] = round(max(self.times) * 1000, 1)
        return out


class Readers(threading.Thread):
    """Ordinary readers: every endpoint in turn, answers counted by status."""

    def __init__(self, url: str) -> None:
        super().__init__(daemon=True)
        self.url, self.stop, self.statuses = url, threading.Event(), Counter()

    def run(self) -> None:
        with httpx.Client(timeout=60) as client:
            while not self.stop.is_set():
                for path in ENDPOINTS:
                    try:
                        self.statuses[f"{path} {client.get(self.url + path).status_code}"] += 1
                    except httpx.HTTPError as exc:
                        self.statuses[f"{path} {type(exc).__name__}"] += 1


def memory_mib(pid: int) -> dict[str, float]:
    """RSS and PSS of the process (smaps_rollup), MiB."""
    out = {}
    with contextlib.suppress(OSError):
        for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
            key, _, rest = line.partition(":")
            if key in ("Rss", "Pss"):
                out[key.lower()] = round(int(rest.split()[0]) / 1024, 1)
    return out


def run_shape(shape: str, hold_s: float, series: int | None = None) -> dict[str, Any]:
    prometheus = FakePrometheus()
    if series is not None:
        body = capped_answer(series)
    elif shape == "never-read":
        body = capped_answer(2000)  # /api/v1/fleet ≈ 730 KB: 2,000 nodes
    else:
        body = capped_answer(MAX_ANSWER_SERIES - 1, MAX_ANSWER_BYTES - 64 * 1024)
    prometheus.answer = lambda query, handler: reply(handler, everyday_answer(query) or body)
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("GPUWARDEN_")}
    result: dict[str, Any] = {"shape": shape, "answer_bytes": len(body), "answer_series": body.count(b'"metric"')}
    log_path = Path(tempfile.mkdtemp()) / "fleet.log"  # a file: a pipe nobody reads stalls the service once full
    with memory_cgroup(LIMIT_MIB, tcp=True) as cgroup, log_path.open("w") as log_file:
        proc = subprocess.Popen(
            [sys.executable, "-m", "gpuwarden", "fleet", "--prometheus-url", prometheus.url, "--node-label", "node",
             "--web.listen-address", f"127.0.0.1:{port}"],
            cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=log_file, text=True,
            preexec_fn=cgroup.enter,  # noqa: PLW1509 - joins the cgroup before exec
        )  # fmt: skip
        url = f"http://127.0.0.1:{port}"
        try:
            _wait(url)
            result["started"] = memory_mib(proc.pid)
            first = httpx.get(url + "/api/v1/fleet", timeout=120)  # the view computed once, as after any use
            result["view_bytes"] = len(first.content) if first.status_code == 200 else first.status_code
            result["before"] = memory_mib(proc.pid)
            prober, readers = Prober(url), Readers(url)
            prober.start()
            if shape != "never-read":
                readers.start()
            paths = ["/api/v1/fleet"] if shape != "both" else list(ENDPOINTS)
            started = time.monotonic()
            clients = []
            if shape != "caps":
                clients = [never_reading_client(port, paths[i % len(paths)]) for i in range(CLIENTS)]
            result["clients_connected"] = sum(c is not None for c in clients)
            result["clients_connect_s"] = round(time.monotonic() - started, 1)
            time.sleep(hold_s)  # the attack lasts this long: a bench, not a test
            for sock in clients:
                if sock is not None:
                    sock.close()
            readers.stop.set()
            prober.stop.set()
            prober.join()
            if readers.is_alive():
                readers.join(120)
            result["during"] = memory_mib(proc.pid)
            time.sleep(60)
            result["a_minute_after"] = memory_mib(proc.pid)
            result["alive"] = proc.poll() is None
            with contextlib.suppress(httpx.HTTPError):
                result["healthz_after"] = httpx.get(url + "/healthz", timeout=5).status_code
            result["probes"] = prober.summary()
            result["answers"] = dict(sorted(readers.statuses.items()))
            result["fleet_metrics"] = _own_metrics(url)
            result["traceback_in_log"] = "Traceback" in log_path.read_text()
        finally:
            result["cgroup_peak_mib"] = round(cgroup.peak_mib(), 1)
            result["cgroup_tcp_peak_mib"] = round(cgroup.tcp_peak_mib(), 1)
            result["oom_kills"] = cgroup.oom_kills()
            proc.terminate()
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(10)
            # uvicorn logs a traceback per request it cancels past its graceful shutdown (views still waiting)
            result["tracebacks_at_stop"] = log_path.read_text().count("Traceback")
            prometheus.close()
    return result


def _own_metrics(url: str) -> dict[str, float]:
    """The fleet's own counters that say what it refused."""
    wanted = ("gpuwarden_fleet_prometheus_queries_total", "gpuwarden_fleet_answers_held_bytes")
    out = {}
    with contextlib.suppress(httpx.HTTPError):
        for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
            if line.startswith(wanted):
                name, _, value = line.rpartition(" ")
                out[name] = float(value)
    return out


def _wait(url: str) -> None:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(url + "/healthz", timeout=1).status_code == 200:
                return
        time.sleep(0.2)
    raise RuntimeError("the fleet service did not start")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", choices=("never-read", "caps", "both", "all"), default="all")
    parser.add_argument("--hold", type=float, default=30.0, help="seconds each attack lasts")
    parser.add_argument("--series", type=int, help="answer every query with this many series instead")
    args = parser.parse_args()
    for shape in ("never-read", "caps", "both") if args.shape == "all" else (args.shape,):
        print(json.dumps(run_shape(shape, args.hold, args.series)), flush=True)


if __name__ == "__main__":
    main()
