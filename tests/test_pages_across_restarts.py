"""Pages for lasting faults survive an exporter restart, in real Prometheus and real Alertmanager (issue 36 point 2).

Five nodes page (a GPU lost from start, an NVLink down, Fabric Manager down, an unhealthy fabric route, a failed
row remap). Each exporter is then replaced as a Kubernetes rollout replaces it: the old target leaves service
discovery (its series go stale at once), and a new process answers a few seconds later on a new port, so a new
`instance` and a new `pod`. With the old rules the pages resolved and opened again: a new incident per restart.
Now no resolve is sent while the fault lasts, and the resolve comes once the fault is repaired (page_hold_s after
the last faulty reading). Fabric Manager down pages once per node, not once per GPU.

Test-time transforms only: `for:` divided by 240 as in test_alerting_e2e.py, page_hold_s 20 s, Alertmanager's
group waits shortened. A sentinel node whose GPU is lost 25 s after the restart bounds the observation: once its
page has arrived, Alertmanager has had every chance to send a resolve for the others.
"""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import httpx
import pytest
import yaml

from gpuwarden.health import rules
from gpuwarden.health.rules_file import alert_rules_yaml
from gpuwarden.health.thresholds import DEFAULT
from tests.helpers.common import free_port, wait_for
from tests.helpers.receiver import Receiver
from tests.helpers.stack import ALERTMANAGER, FAST_EXPORTER_FLAGS, PROMETHEUS, Stack, wait_ready
from tests.test_dashboards import panel_expr

ROOT = Path(__file__).resolve().parent.parent
FOR_SCALE = 1 / 240
PAGE_HOLD_S = 20
SENTINEL_LOST_AT = PAGE_HOLD_S + 5  # seconds after the restart: past the hold, so a late resolve would show

pytestmark = [
    pytest.mark.serial,  # real Prometheus and Alertmanager on their own clocks
    pytest.mark.slow,
    pytest.mark.skipif(
        PROMETHEUS is None or ALERTMANAGER is None,
        reason="Debian's prometheus and prometheus-alertmanager (the README test command installs them)",
    ),
]

# node → (the alert it pages with, its scenario)
FAULTS = {
    "node-lost": ("GpuwardenGpuLost", {"node": {"count": 2}, "faults": [{"kind": "gpu_lost", "gpu": 1, "at": 0}]}),
    "node-nvlink": (
        "GpuwardenNvlinkDown",
        {"node": {"count": 2, "nvlink": "nvswitch"}, "faults": [{"kind": "nvlink_down", "gpu": 0, "link": 3}]},
    ),
    # the NVSwitch fabric (issue 39): Fabric Manager never started, and a route that went unhealthy
    "node-fabric-down": (
        "GpuwardenFabricNotReady",
        {"node": {"count": 2, "nvlink": "nvswitch"}, "faults": [{"kind": "fabric_not_started"}]},
    ),
    "node-fabric-route": (
        "GpuwardenFabricUnhealthy",
        {"node": {"count": 2, "nvlink": "nvswitch"}, "faults": [{"kind": "fabric_unhealthy", "gpu": 1}]},
    ),
    "node-remap": (
        "GpuwardenRowRemapFailure",
        {
            "node": {"count": 2},
            "faults": [
                {"kind": "remapped_rows", "gpu": 1, "cause": "uncorrectable", "count": 1},
                {"kind": "remap_failed", "gpu": 1},
            ],
        },
    ),
}


class Fleet:
    """Exporters behind a file_sd target list that a test rewrites, as Kubernetes replaces a DaemonSet's pods."""

    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.targets = tmp / "targets.json"
        self.running: dict[str, tuple[subprocess.Popen, int, str]] = {}  # node → (process, port, pod)
        self.generation = 0

    def scenario_file(self, node: str, scenario: dict) -> str:
        path = self.tmp / f"{node}-{len(list(self.tmp.glob(node + '-*.yaml')))}.yaml"
        path.write_text(yaml.safe_dump({"name": node, **scenario}))  # the same name: the same GPU UUIDs
        return str(path)

    def start(self, node: str, scenario: dict, xid_events: bool = False) -> None:
        self.generation += 1
        port = free_port()
        args = [sys.executable, "-m", "gpuwarden", "--sim", "--nvml.scenario", self.scenario_file(node, scenario)]
        args += ["--web.listen-address", f"127.0.0.1:{port}", *FAST_EXPORTER_FLAGS]
        args += [] if xid_events else ["--no-nvml.xid-events"]
        log = (self.tmp / f"{node}-{self.generation}.log").open("wb")
        proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT)
        self.running[node] = (proc, port, f"gpuwarden-{node}-{self.generation}")
        wait_ready(f"http://127.0.0.1:{port}/healthz")
        self.write_targets()

    def stop(self, node: str) -> None:
        """The pod is deleted: out of service discovery first, then gone."""
        proc, _, _ = self.running.pop(node)
        self.write_targets()
        proc.terminate()
        proc.wait(timeout=10)

    def write_targets(self) -> None:
        groups = [
            {"targets": [f"127.0.0.1:{port}"], "labels": {"cluster": "test", "node": node, "pod": pod}}
            for node, (_, port, pod) in self.running.items()
        ]
        partial = self.targets.with_suffix(".tmp")
        partial.write_text(json.dumps(groups))
        partial.replace(self.targets)  # Prometheus never reads half a file

    def close(self) -> None:
        for proc, _, _ in self.running.values():
            proc.terminate()
            proc.wait(timeout=10)


def shortened_rules(for_scale: float) -> str:
    groups = rules.build(replace(DEFAULT, page_hold_s=PAGE_HOLD_S))
    return alert_rules_yaml(groups, for_scale=for_scale)


@pytest.fixture
def monitored(tmp_path: Path, request: pytest.FixtureRequest):
    """(fleet, PagerDuty capture, Prometheus URL, Alertmanager URL); `for:` scaled by the parameter (FOR_SCALE)."""
    receiver, parts, fleet = Receiver(), Stack(tmp_path), Fleet(tmp_path)
    try:
        am = receiver.alertmanager_config(tmp_path, "restart-test")
        am_port = parts.alertmanager(am)
        fleet.write_targets()
        (tmp_path / "rules.yaml").write_text(shortened_rules(getattr(request, "param", FOR_SCALE)))
        prometheus_port = free_port()
        config = {
            "global": {"scrape_interval": "1s", "evaluation_interval": "1s", "scrape_timeout": "900ms"},
            "rule_files": [str(tmp_path / "rules.yaml")],
            "alerting": {"alertmanagers": [{"static_configs": [{"targets": [f"127.0.0.1:{am_port}"]}]}]},
            "scrape_configs": [
                {
                    "job_name": "gpuwarden",
                    "file_sd_configs": [{"files": [str(fleet.targets)], "refresh_interval": "1s"}],
                }
            ],
        }
        (tmp_path / "prometheus.yml").write_text(yaml.safe_dump(config))
        parts._spawn(
            [
                PROMETHEUS or "prometheus",
                f"--config.file={tmp_path / 'prometheus.yml'}",
                f"--storage.tsdb.path={tmp_path / 'prom-data'}",
                f"--web.listen-address=127.0.0.1:{prometheus_port}",
            ]
        )
        prometheus = f"http://127.0.0.1:{prometheus_port}"
        wait_ready(prometheus + "/-/ready")
        yield fleet, receiver, prometheus, f"http://127.0.0.1:{am_port}"
    finally:
        fleet.close()
        parts.stop()
        receiver.server.shutdown()


def events(receiver: Receiver, node: str, alert: str) -> list[str]:
    """The PagerDuty actions (trigger, resolve) sent for `alert` on `node`, in order."""
    return [
        e["event_action"] for e in receiver.pages() if e["payload"]["source"] == node and e["payload"]["class"] == alert
    ]


def scraped(prometheus: str, node: str, pod: str) -> bool:
    """Prometheus has the new pod's series (its target is up)."""
    query = f'up{{job="gpuwarden",node="{node}",pod="{pod}"}} == 1'
    answer = httpx.get(prometheus + "/api/v1/query", params={"query": query}, timeout=5).json()
    return bool(answer["data"]["result"])


def test_lasting_faults_page_once_across_a_restart_with_a_new_instance_and_resolve_on_repair(monitored):
    fleet, receiver, prometheus, _ = monitored
    for node, (_, scenario) in FAULTS.items():
        fleet.start(node, scenario)
    wait_for(lambda: all(events(receiver, n, alert) for n, (alert, _) in FAULTS.items()), timeout=120)

    # the rollout: each pod deleted and its successor started on a new port (a new instance, a new pod)
    for node in FAULTS:
        fleet.stop(node)
    for node, (_, scenario) in FAULTS.items():
        fleet.start(node, scenario)
    lost_later = {"node": {"count": 1}, "faults": [{"kind": "gpu_lost", "gpu": 0, "at": SENTINEL_LOST_AT}]}
    fleet.start("node-sentinel", lost_later)
    wait_for(lambda: all(scraped(prometheus, n, fleet.running[n][2]) for n in FAULTS), timeout=60)
    wait_for(lambda: events(receiver, "node-sentinel", "GpuwardenGpuLost"), timeout=120)  # the observation window
    for node, (alert, _) in FAULTS.items():
        assert events(receiver, node, alert) == ["trigger"], (node, events(receiver, node, alert))

    # the repair: the GPU answers again after the next restart; the page resolves once the hold has passed
    fleet.stop("node-lost")
    fleet.start("node-lost", {"node": {"count": 2}})
    wait_for(lambda: events(receiver, "node-lost", "GpuwardenGpuLost")[-1:] == ["resolve"], timeout=120)
    assert events(receiver, "node-lost", "GpuwardenGpuLost") == ["trigger", "resolve"]
    assert events(receiver, "node-nvlink", "GpuwardenNvlinkDown") == ["trigger"]  # still down: still paging


@pytest.mark.parametrize("monitored", [1 / 10], indirect=True)  # GpuLost 6 s, XidCritical 12 s: their real order
def test_a_gpu_that_falls_off_the_bus_pages_once_as_lost_not_first_as_a_critical_xid(monitored):
    """XID 79, then GPU_IS_LOST: the critical-XID page went out at once and "fallen off the bus" a minute later.
    XidCritical now waits xid_critical_for_s (2 m), past GpuLost's 1 m, which inhibits it in Alertmanager."""
    fleet, receiver, prometheus, alertmanager = monitored
    falls = {
        "node": {"count": 2},
        "faults": [{"kind": "xid", "gpu": 1, "xid": 79, "at": 3}, {"kind": "gpu_lost", "gpu": 1, "at": 5}],
    }
    fleet.start("node-falls", falls, xid_events=True)

    def xid_alert_inhibited() -> bool:
        answer = httpx.get(alertmanager + "/api/v2/alerts", timeout=5).json()
        return any(a["labels"]["alertname"] == "GpuwardenXidCritical" and a["status"]["inhibitedBy"] for a in answer)

    wait_for(lambda: events(receiver, "node-falls", "GpuwardenGpuLost") and xid_alert_inhibited(), timeout=120)
    pages = [e["payload"]["class"] for e in receiver.pages() if e["event_action"] == "trigger"]
    assert pages == ["GpuwardenGpuLost"], pages

    # after a restart (the new exporter has no XID history), the fleet dashboard still lists the XID (issue 36 point 6)
    fleet.stop("node-falls")
    fleet.start("node-falls", {"node": {"count": 2}, "faults": [{"kind": "gpu_lost", "gpu": 1, "at": 0}]})
    wait_for(lambda: scraped(prometheus, "node-falls", fleet.running["node-falls"][2]), timeout=60)
    offenders = panel_expr("gpuwarden-fleet.json", "ECC and XID offenders", 1)
    rows = httpx.get(prometheus + "/api/v1/query", params={"query": offenders}, timeout=5).json()["data"]["result"]
    assert [(r["metric"]["node"], r["metric"]["gpu"], r["metric"]["xid"]) for r in rows] == [("node-falls", "1", "79")]
    fresh = f'gpuwarden_xid_errors_total{{pod="{fleet.running["node-falls"][2]}"}}'
    assert not httpx.get(prometheus + "/api/v1/query", params={"query": fresh}, timeout=5).json()["data"]["result"]
