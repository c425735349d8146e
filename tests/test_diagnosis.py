"""The diagnosis findings per scenario: the right check with cause and action, nothing on a healthy node."""

from __future__ import annotations

import pytest

from gpuwarden.collect.poller import Poller
from gpuwarden.health.diagnosis import diagnose
from tests.helpers.common import ManualClock, settings, write_yaml
from tests.helpers.thresholds import SHORT


@pytest.fixture
def findings_for(sim, tmp_path):
    pollers: list[Poller] = []

    def run(scenario, seconds: int = 15):
        clock = ManualClock()
        sim(scenario, clock=clock)
        poller = Poller(
            settings(health={"thresholds_file": str(write_yaml(tmp_path / "t.yaml", SHORT))}), wall_clock=clock
        )
        pollers.append(poller)
        for _ in range(seconds):
            poller.poll_once()
            clock.advance(1)
        return diagnose(poller.poll_once())

    yield run
    for poller in pollers:
        poller.stop(timeout=0.2)


def by_check(findings):
    return {(f.check, f.gpu): f for f in findings}


def test_healthy_node_has_no_findings(findings_for):
    assert findings_for("healthy") == []
    assert findings_for("training") == []


@pytest.mark.parametrize(
    ("scenario", "check", "gpu", "severity", "words"),
    [
        ("memory-nearly-full", "memory_pressure", 3, "critical", ["optimizer state", "gradient checkpointing", "ZeRO"]),
        ("ecc-uncorrectable", "ecc", 1, "critical", ["cordon", "replacement"]),
        ("thermal-throttling", "temperature", 2, "critical", ["cooling"]),
        ("thermal-throttling", "thermal_throttling", 5, "warning", ["cooling"]),
        ("data-starvation", "utilization", 0, "warning", ["DataLoader", "pin_memory", "Profile first"]),
        ("nvlink-down", "nvlink", 4, "critical", ["nvidia-smi nvlink"]),
        ("gpu-lost", "gpu_lost", 6, "critical", ["fell off the bus", "RMA"]),
        ("row-remap", "row_remap", 5, "critical", ["RMA"]),
        ("persistence-off", "persistence_mode", 0, "warning", ["nvidia-persistenced"]),
        ("power-capping", "power", 0, "warning", ["nvidia-smi -pl"]),
    ],
)
def test_scenario_findings(findings_for, scenario, check, gpu, severity, words):
    found = by_check(findings_for(scenario)).get((check, gpu))
    assert found is not None, scenario
    assert found.severity == severity and found.observed and found.threshold
    text = found.likely_cause + " " + found.recommended_action
    assert all(word in text for word in words), text


def test_driver_not_loaded_is_a_node_finding(findings_for):
    findings = findings_for("driver-not-loaded", seconds=2)
    assert [(f.check, f.severity, f.observed) for f in findings] == [("driver", "critical", "driver_not_loaded")]
    assert "NVIDIA runtime" in findings[0].recommended_action


def test_pcie_only_node_reports_missing_nvlink_as_info(findings_for):
    found = by_check(findings_for("legacy-pcie", seconds=3)).get(("nvlink_topology", None))
    assert found is not None and found.severity == "info" and "PHB" in found.likely_cause


def test_diagnosis_endpoints(live_server):
    server = live_server("row-remap")
    body = server.get("/api/v1/diagnosis").json()
    assert body["nvml_up"] is True and "CUDA up to 13.0" in body["driver"]["note"]
    checks = {(f["check"], f["gpu"], f["severity"]) for f in body["findings"]}
    assert ("row_remap", 5, "critical") in checks and ("row_remap", 2, "warning") in checks
    one = server.get("/api/v1/diagnosis/5").json()
    assert [f["gpu"] for f in one["findings"]] == [5]
    assert server.get("/api/v1/diagnosis/9").status_code == 404
    assert server.get("/api/v1/diagnosis/x!").status_code == 422
    gpu = server.get("/api/v1/gpus/5").json()
    assert gpu["health"]["row_remap"]["level"] == 2
