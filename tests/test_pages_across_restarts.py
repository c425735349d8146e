"""Pages for lasting faults survive an exporter restart, in real Prometheus and real Alertmanager (issue 36 point 2,
issue 48): every one of them, through a 90-second gap, in both ways an exporter comes back.

Two nodes per restart style page at once: one with a fault on each of its eight GPUs (lost, uncorrectable ECC,
recovery action and an unhealthy fabric route, failed row remap, critical XID, critical temperature, thermal
throttling, NVLink down) and one whose Fabric Manager never started. Every exporter then stops for 90 seconds, all
at once:
- the same instance: the target stays (its scrapes fail, its series go stale) and a new process answers on the same
  address, as after a systemd or container restart;
- a new instance: the target leaves service discovery and the successor answers on a new port with a new `pod`, as
  a Kubernetes rollout does.
The successor has no memory of the XID (NVML reports an event once). No page may resolve or open again: each alert
keeps its `activeAt` in Prometheus, stays firing through the gap, and PagerDuty gets one trigger per fault and no
resolve. A fifth node, repaired during its restart, resolves page_hold_s after its last faulty reading.

Test-time transforms only: `for:` divided by 240 as in test_alerting_e2e.py, Alertmanager's group waits shortened,
and through the thresholds (the documented knob) page_hold_s 150 s and thermal_page_window_s 60 s (its minimum).
alert_rules/tests/gpuwarden.restarts.test.yaml proves the same at the shipped windows with a 2-minute gap.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
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
THRESHOLDS = replace(DEFAULT, page_hold_s=150, thermal_page_window_s=60)
GAP_S = 90

pytestmark = [
    pytest.mark.serial,  # real Prometheus and Alertmanager on their own clocks
    pytest.mark.slow,
    pytest.mark.skipif(
        PROMETHEUS is None or ALERTMANAGER is None,
        reason="Debian's prometheus and prometheus-alertmanager (the README test command installs them)",
    ),
]

HOT = {"temperature": 93}
THROTTLED = {"clock_event_reasons": 0x60}  # HW and SW thermal slowdown: their counters run all the time
EIGHT_FAULTS = {
    "node": {"count": 8, "nvlink": "nvswitch"},
    "gpus": {2: {"recovery_action": 1}, 5: HOT, 6: THROTTLED},
    "faults": [
        {"kind": "gpu_lost", "gpu": 0, "at": 0},
        {"kind": "ecc", "gpu": 1, "type": "uncorrected", "at": 0, "count": 2},
        {"kind": "fabric_unhealthy", "gpu": 2},
        {"kind": "remapped_rows", "gpu": 3, "cause": "uncorrectable", "count": 1},
        {"kind": "remap_failed", "gpu": 3},
        # NVML reports an XID only to a process already listening: again every 10 s, so a start slowed by the
        # load of five exporters starting at once still sees one
        {"kind": "xid", "gpu": 4, "xid": 48, "at": 5, "every": 10},
        {"kind": "nvlink_down", "gpu": 7, "link": 3},
    ],
}
EIGHT_PAGES = {
    ("GpuwardenGpuLost", "0"),
    ("GpuwardenEccUncorrectable", "1"),
    ("GpuwardenRecoveryActionNeeded", "2"),
    ("GpuwardenFabricUnhealthy", "2"),
    ("GpuwardenRowRemapFailure", "3"),
    ("GpuwardenXidCritical", "4"),
    ("GpuwardenTemperatureCritical", "5"),
    ("GpuwardenThermalThrottling", "6"),
    ("GpuwardenNvlinkDown", "7"),
}
FABRIC_DOWN = {"node": {"count": 2, "nvlink": "nvswitch"}, "faults": [{"kind": "fabric_not_started"}]}
# node → (its scenario, the pages it must raise as (alert, GPU), whether it comes back on the same instance)
NODES = {
    "same-gpus": (EIGHT_FAULTS, EIGHT_PAGES, True),
    "same-fabric": (FABRIC_DOWN, {("GpuwardenFabricNotReady", "")}, True),
    "new-gpus": (EIGHT_FAULTS, EIGHT_PAGES, False),
    "new-fabric": (FABRIC_DOWN, {("GpuwardenFabricNotReady", "")}, False),
}
REPAIRED = "new-repaired"  # a GPU lost, back healthy after the restart
LOST = {"node": {"count": 2}, "faults": [{"kind": "gpu_lost", "gpu": 1, "at": 0}]}


def without_xids(scenario: dict) -> dict:
    """The scenario as the successor sees it: NVML reported the XID to the old process only."""
    return {**scenario, "faults": [f for f in scenario.get("faults", []) if f["kind"] != "xid"]}


class Fleet:
    """Exporters behind a file_sd target list that a test rewrites, as Kubernetes replaces a DaemonSet's pods."""

    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.targets = tmp / "targets.json"
        self.running: dict[str, tuple[subprocess.Popen | None, int, str]] = {}  # node → (process, port, pod)
        self.generation = 0

    def scenario_file(self, node: str, scenario: dict) -> str:
        path = self.tmp / f"{node}-{len(list(self.tmp.glob(node + '-*.yaml')))}.yaml"
        path.write_text(yaml.safe_dump({"name": node, **scenario}))  # the same name: the same GPU UUIDs
        return str(path)

    def spawn(self, node: str, scenario: dict, xid_events: bool = False, same_instance: bool = False) -> None:
        """Start the node's exporter (on its old address and pod where `same_instance`), without waiting."""
        self.generation += 1
        fresh = (None, free_port(), f"gpuwarden-{node}-{self.generation}")
        _, port, pod = self.running[node] if same_instance else fresh
        args = [sys.executable, "-m", "gpuwarden", "--sim", "--nvml.scenario", self.scenario_file(node, scenario)]
        args += ["--web.listen-address", f"127.0.0.1:{port}", *FAST_EXPORTER_FLAGS]
        args += [] if xid_events else ["--no-nvml.xid-events"]
        log = (self.tmp / f"{node}-{self.generation}.log").open("wb")
        self.running[node] = (subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT), port, pod)

    def start(self, node: str, scenario: dict, xid_events: bool = False, same_instance: bool = False) -> None:
        self.spawn(node, scenario, xid_events, same_instance)
        wait_ready(f"http://127.0.0.1:{self.running[node][1]}/healthz")
        self.write_targets()

    def ready(self, nodes: list[str]) -> None:
        for node in nodes:
            wait_ready(f"http://127.0.0.1:{self.running[node][1]}/healthz")
        self.write_targets()

    def stop(self, node: str, same_instance: bool = False) -> None:
        """The process ends. A pod deleted leaves service discovery first; a restart in place keeps its target."""
        proc, port, pod = self.running[node]
        if same_instance:
            self.running[node] = (None, port, pod)
        else:
            del self.running[node]
            self.write_targets()
        assert proc is not None
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
            if proc is not None:
                proc.terminate()
                proc.wait(timeout=10)


def shortened_rules(for_scale: float) -> str:
    return alert_rules_yaml(rules.build(THRESHOLDS), for_scale=for_scale)


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


def events(receiver: Receiver, node: str, alert: str, gpu: str | None = None) -> list[str]:
    """The PagerDuty actions (trigger, resolve) sent for `alert` on `node` (on GPU `gpu`: "" for a node's page), in
    order."""
    return [
        e["event_action"]
        for e in receiver.pages()
        if e["payload"]["source"] == node
        and e["payload"]["class"] == alert
        and (gpu is None or e["payload"]["component"].split(" ")[1] == gpu)  # component: "gpu GPU UUID"
    ]


def firing(prometheus: str) -> dict[tuple[str, str, str], str]:
    """Prometheus' firing alerts: (node, alert, GPU) → activeAt."""
    answer = httpx.get(prometheus + "/api/v1/alerts", timeout=5).json()["data"]["alerts"]
    return {
        (a["labels"].get("node", ""), a["labels"]["alertname"], a["labels"].get("gpu", "")): a["activeAt"]
        for a in answer
        if a["state"] == "firing"
    }


def expression_holds(prometheus: str, node: str, alert: str, gpu: str) -> bool:
    """The alert's own expression finds the fault in the successor's series (the hold no longer carries it)."""
    expr = next(r.expr for g in rules.build(THRESHOLDS) for r in g.rules if r.alert == alert)
    rows = httpx.get(prometheus + "/api/v1/query", params={"query": expr}, timeout=5).json()["data"]["result"]
    return any(r["metric"].get("node") == node and r["metric"].get("gpu", "") == gpu for r in rows)


def scraped(prometheus: str, node: str, pod: str) -> bool:
    """Prometheus has the new pod's series (its target is up)."""
    query = f'up{{job="gpuwarden",node="{node}",pod="{pod}"}} == 1'
    answer = httpx.get(prometheus + "/api/v1/query", params={"query": query}, timeout=5).json()
    return bool(answer["data"]["result"])


def test_every_lasting_page_is_one_incident_through_a_90s_restart_in_both_styles(monitored):
    fleet, receiver, prometheus, _ = monitored
    expected = {(node, alert, gpu) for node, (_, pages, _) in NODES.items() for alert, gpu in pages}
    for node, (scenario, _, _) in NODES.items():
        fleet.spawn(node, scenario, xid_events=True)
    fleet.spawn(REPAIRED, LOST)
    fleet.ready([*NODES, REPAIRED])
    unpaged = lambda: sorted(page for page in expected if not events(receiver, *page))  # noqa: E731
    try:
        wait_for(lambda: not unpaged(), timeout=180, step=1)
    except AssertionError:
        raise AssertionError(f"no page for {unpaged()}; Prometheus fires {sorted(firing(prometheus))}") from None
    wait_for(lambda: events(receiver, REPAIRED, "GpuwardenGpuLost", "1"), timeout=60, step=1)
    before = firing(prometheus)
    assert expected <= set(before), expected - set(before)

    # every exporter stops at once; for 90 s nothing answers, and every page keeps firing with its first activeAt
    for node, (_, _, same) in NODES.items():
        fleet.stop(node, same_instance=same)
    fleet.stop(REPAIRED)
    stopped = time.monotonic()

    def gap_over_with_every_page_held() -> bool:
        now = firing(prometheus)
        assert all(now.get(page) == before[page] for page in expected), {p: now.get(p) for p in expected}
        return time.monotonic() - stopped >= GAP_S

    wait_for(gap_over_with_every_page_held, timeout=GAP_S + 30, step=2)

    for node, (scenario, _, same) in NODES.items():
        fleet.spawn(node, without_xids(scenario), xid_events=True, same_instance=same)
    fleet.spawn(REPAIRED, {"node": {"count": 2}})
    fleet.ready([*NODES, REPAIRED])
    wait_for(lambda: all(scraped(prometheus, n, fleet.running[n][2]) for n in NODES), timeout=60, step=1)
    # every fault the successor still shows is found by the alert's own expression again (the XID only in history)
    wait_for(lambda: all(expression_holds(prometheus, *page) for page in expected), timeout=120, step=1)
    # a page raised now reaches PagerDuty only after everything Alertmanager had to send before it
    fleet.start("sentinel", LOST)
    wait_for(lambda: events(receiver, "sentinel", "GpuwardenGpuLost", "1"), timeout=60, step=1)
    after = firing(prometheus)
    for page in sorted(expected):
        assert after.get(page) == before[page], (page, before[page], after.get(page))
        assert events(receiver, *page) == ["trigger"], (page, events(receiver, *page))

    # the repaired GPU's page resolves page_hold_s after its last faulty reading, and only then
    wait_for(lambda: events(receiver, REPAIRED, "GpuwardenGpuLost", "1")[-1:] == ["resolve"], timeout=120, step=1)
    assert time.monotonic() - stopped >= THRESHOLDS.page_hold_s
    assert events(receiver, REPAIRED, "GpuwardenGpuLost", "1") == ["trigger", "resolve"]
    assert all(events(receiver, *page) == ["trigger"] for page in expected)  # the faults that last still page


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
