"""Real monitoring parts on loopback ports for end-to-end tests: simulated exporters (one process per scenario:
pynvml's library is process-wide), Debian's Prometheus and Alertmanager binaries (no Docker engine here)."""

from __future__ import annotations

import shutil
import subprocess
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import yaml

from tests.helpers.daemon import Daemon, free_port, spawn_daemon, wait_ready
from tests.helpers.daemon import running_cli as running_cli  # imported from here by older tests

PROMETHEUS = shutil.which("prometheus")
ALERTMANAGER = shutil.which("prometheus-alertmanager") or shutil.which("alertmanager")

# The fast tier at its default (Prometheus scrapes every second here), the slow tier every second instead of 15 s so
# that slow-tier faults reach the rules within a test; NVLink's error counters (the slow tier's costliest reads, which
# no end-to-end test waits on) every 5 s. A dozen exporters poll through every end-to-end test: these rates are most
# of the suite's CPU there.
FAST_EXPORTER_FLAGS = [
    "--poll.fast-interval",
    "1",
    "--poll.slow-interval",
    "1",
    "--poll.samples-interval",
    "1",
    "--poll.nvlink-errors-interval",
    "5",
]


def late_nvlink_down(tmp: Path, at: float = 15) -> str:
    """The shipped nvlink-down scenario with its link dropping at `at` s instead of 5 s. The NvlinkDown rule needs
    Prometheus to have seen the link up; a dozen exporters starting at once on a loaded 2-core machine can take
    longer than 5 s to answer their first scrape."""
    from gpuwarden.sim.scenario import shipped_scenarios

    data = yaml.safe_load(shipped_scenarios()["nvlink-down"].read_text())
    for fault in data["faults"]:
        if fault["kind"] == "nvlink_down":
            fault["at"] = at
    path = tmp / "nvlink-down-late.yaml"
    path.write_text(yaml.safe_dump(data))
    return str(path)


class Stack:
    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.procs: list[subprocess.Popen] = []
        self.exporters: dict[int, str] = {}  # port → scenario
        self._pending: list[tuple[int, list[str]]] = []  # (port, arguments), started with Prometheus
        self.prometheus = ""
        self.dead_targets: list[str] = []  # scraped, never answering: an exporter that is down

    def _spawn(self, args: list[str]) -> None:
        """Start a process with its output in tmp/logs/N.log: what a failed start said is in the failure."""
        logs = self.tmp / "logs"
        logs.mkdir(exist_ok=True)
        with (logs / f"{len(self.procs)}.log").open("wb") as sink:
            self.procs.append(subprocess.Popen(args, stdout=sink, stderr=subprocess.STDOUT))

    def exporter(self, scenario: str, *flags: str, name: str | None = None) -> int:
        """Plan an exporter; it starts once Prometheus runs, so the first scrapes see a scenario's first seconds.
        `name` is what scenario_of/instance_of call it (default: the scenario itself, a name or a path)."""
        port = free_port()
        self.exporters[port] = name or scenario
        self._pending.append((port, ["--sim", "--nvml.scenario", scenario, *FAST_EXPORTER_FLAGS, *flags]))
        return port

    def alertmanager(self, config: dict[str, Any]) -> int:
        port = free_port()
        (self.tmp / "am.yml").write_text(yaml.safe_dump(config))
        self._spawn(
            [
                ALERTMANAGER or "alertmanager",
                f"--config.file={self.tmp / 'am.yml'}",
                f"--storage.path={self.tmp / 'am-data'}",
                f"--web.listen-address=127.0.0.1:{port}",
                "--cluster.listen-address=",
            ]
        )
        wait_ready(f"http://127.0.0.1:{port}/-/ready")
        return port

    def start_prometheus(
        self, rules_text: str | None = None, alertmanager_port: int | None = None, node_labels: bool = False
    ) -> str:
        """Prometheus scraping the exporters. `node_labels`: each target gets its own `node` label (node-PORT), as
        the chart's relabeling gives each pod its node's name."""
        port = free_port()
        targets = [f"127.0.0.1:{p}" for p in self.exporters] + self.dead_targets
        if node_labels:
            static = [
                {"targets": [t], "labels": {"cluster": "test", "node": f"node-{t.rsplit(':', 1)[1]}"}} for t in targets
            ]
        else:
            static = [{"targets": targets, "labels": {"cluster": "test"}}]
        config: dict[str, Any] = {
            "global": {"scrape_interval": "1s", "evaluation_interval": "1s", "scrape_timeout": "900ms"},
            "scrape_configs": [{"job_name": "gpuwarden", "static_configs": static}],
        }
        if rules_text is not None:
            (self.tmp / "rules.yaml").write_text(rules_text)
            config["rule_files"] = [str(self.tmp / "rules.yaml")]
        if alertmanager_port is not None:
            config["alerting"] = {
                "alertmanagers": [{"static_configs": [{"targets": [f"127.0.0.1:{alertmanager_port}"]}]}]
            }
        (self.tmp / "prometheus.yml").write_text(yaml.safe_dump(config))
        self._spawn(
            [
                PROMETHEUS or "prometheus",
                f"--config.file={self.tmp / 'prometheus.yml'}",
                f"--storage.tsdb.path={self.tmp / 'prom-data'}",
                f"--web.listen-address=127.0.0.1:{port}",
            ]
        )
        self.prometheus = f"http://127.0.0.1:{port}"
        wait_ready(self.prometheus + "/-/ready")
        started: list[Daemon] = []  # all at once, then each waited for: a dozen starts overlap on 2 cores
        for exporter_port, args in self._pending:
            log = self.tmp / "logs" / f"{len(self.procs)}.log"
            started.append(spawn_daemon(*args, port=exporter_port, log=log))
            self.procs.append(started[-1].proc)
        self._pending = []
        for daemon in started:
            daemon.wait()  # a failed start: its exit code and the tail of its log
        return self.prometheus

    def scenario_of(self, instance: str) -> str:
        return self.exporters[int(instance.rsplit(":", 1)[1])]

    def instance_of(self, scenario: str) -> str:
        return next(f"127.0.0.1:{port}" for port, name in self.exporters.items() if name == scenario)

    def query(self, expr: str) -> list[dict[str, Any]]:
        body = httpx.get(self.prometheus + "/api/v1/query", params={"query": expr}, timeout=10).json()
        assert body["status"] == "success", (expr, body)
        return body["data"]["result"]

    def stop(self) -> None:
        for proc in self.procs:
            proc.terminate()
        for proc in self.procs:
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()


@contextmanager
def stack(tmp: Path):
    running = Stack(tmp)
    try:
        yield running
    finally:
        running.stop()
