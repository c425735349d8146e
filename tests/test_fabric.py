"""The NVSwitch fabric (issue 39): Fabric Manager down, a fabric still being set up, degraded or unhealthy, and a
node without NVSwitch, through the real pynvml over the simulator; the fake's fabric call as strict as the driver."""

from __future__ import annotations

import ctypes
from typing import Any

import pynvml
import pytest

from gpuwarden.exposition.render import Renderer
from gpuwarden.health.diagnosis import diagnose
from gpuwarden.runtime.pipeline import Pipeline
from gpuwarden.sim.fakecommon import SimulatedMemoryCorruption
from tests.helpers.common import ManualClock, parse_exposition, settings, values

pytestmark = pytest.mark.slow  # minutes of a node on the manual clock


def run(sim, scenario: dict[str, Any], seconds: int, **sections: Any) -> tuple[Pipeline, dict[int, list]]:
    """Poll every second of a manual clock; each GPU's fabric verdict at every second."""
    clock = ManualClock()
    sim(scenario, clock=clock)
    pipeline = Pipeline(settings(poll={"slow_interval": 5}, **sections), wall_clock=clock)
    verdicts: dict[int, list] = {}
    try:
        for second in range(seconds):
            pipeline.poll_once()
            for gpu in pipeline.snapshot.gpus:
                fabric = next(v for v in pipeline.snapshot.health[gpu.uuid] if v.check == "fabric")
                verdicts.setdefault(gpu.index, []).append((second, fabric))
            clock.advance(1.0)
    finally:
        pipeline.stop(0.5)
    return pipeline, verdicts


def node(count: int, nvlink: str = "nvswitch", faults: list | None = None) -> dict[str, Any]:
    return {"name": f"fabric-{nvlink}", "node": {"count": count, "nvlink": nvlink}, "faults": faults or []}


def scrape(pipeline: Pipeline, groups: tuple[str, ...] = ()) -> dict:
    selection = settings(metrics={"enable_groups": list(groups)}).metrics.selection()
    return parse_exposition(Renderer(selection).render(pipeline.snapshot).decode())


def test_fabric_manager_down_is_critical_after_the_setup_window_not_at_boot(sim) -> None:
    """Every GPU's fabric not_started: pending for fabric_setup_for_s (Fabric Manager sets it up within a minute
    or two of boot), then critical, with a finding that names Fabric Manager; the scrape shows the state."""
    pipeline, verdicts = run(sim, node(2, faults=[{"kind": "fabric_not_started"}]), 310)
    levels = {second: (v.level, v.severity) for second, v in verdicts[1]}
    assert levels[60] == (0, "pending") and levels[290] == (0, "pending")
    assert levels[305] == (2, "critical")
    assert "fabric not_started: CUDA cannot start" in verdicts[1][-1][1].observed
    findings = [f for f in diagnose(pipeline.snapshot) if f.check == "fabric"]
    assert {f.gpu for f in findings} == {0, 1} and all("fabricmanager" in f.recommended_action for f in findings)
    series = scrape(pipeline)
    assert values(series, "gpuwarden_fabric_state", gpu="1", state="not_started") == [1]
    assert not values(series, "gpuwarden_fabric_state", state="completed")  # the other states: fabric_detail


def test_a_healthy_fabric_costs_no_series_at_defaults_and_shows_in_its_group(sim) -> None:
    pipeline, verdicts = run(sim, node(2), 3)
    assert verdicts[0][-1][1].observed == "fabric completed, healthy"
    assert not [key for key in scrape(pipeline) if key[0].startswith("gpuwarden_fabric_")]
    detail = scrape(pipeline, ("fabric_detail",))
    assert values(detail, "gpuwarden_fabric_state", gpu="0", state="completed") == [1]
    assert values(detail, "gpuwarden_fabric_health", gpu="0", condition="degraded_bandwidth") == [0]
    (info,) = [
        dict(labels)
        for (name, labels), _ in detail.items()
        if name == "gpuwarden_fabric_info" and ("gpu", "0") in labels
    ]
    assert info["summary"] == "healthy" and info["clique_id"] == "0" and len(info["cluster_uuid"]) == 36
    assert pipeline.snapshot.gpus[0].info.fabric["state"] == "completed"


def test_an_unhealthy_route_is_critical_at_once_and_degraded_bandwidth_a_warning_after_its_window(sim) -> None:
    faults = [{"kind": "fabric_unhealthy", "gpu": 0, "at": 10}, {"kind": "fabric_degraded", "gpu": 1, "at": 10}]
    pipeline, verdicts = run(sim, node(2, faults=faults), 330)
    unhealthy = {second: v.level for second, v in verdicts[0]}
    assert unhealthy[5] == 0 and unhealthy[20] == 2
    assert "fabric route_unhealthy" in verdicts[0][-1][1].observed
    degraded = {second: (v.level, v.severity) for second, v in verdicts[1]}
    assert degraded[20] == (0, "pending") and degraded[329] == (1, "warning")
    series = scrape(pipeline)
    assert values(series, "gpuwarden_fabric_health", gpu="0", condition="route_unhealthy") == [1]
    assert values(series, "gpuwarden_fabric_health", gpu="1", condition="degraded_bandwidth") == [1]
    assert not values(series, "gpuwarden_fabric_health", condition="route_recovery")  # false: not at defaults


def test_a_node_without_nvswitch_has_no_fabric_and_never_a_verdict(sim) -> None:
    pipeline, verdicts = run(sim, node(2, nvlink="none"), 3)
    assert {v.observed for _, v in verdicts[0]} == {"no NVSwitch fabric"}
    assert pipeline.snapshot.gpus[0].info.fabric == {"state": "not_supported"}
    assert not [key for key in scrape(pipeline, ("fabric_detail",)) if key[0].startswith("gpuwarden_fabric_")]


def test_the_fabric_call_is_as_strict_as_the_driver(sim) -> None:
    """By value the real library crashed a process on a lent H200 (issue 39); an unknown version is refused."""
    sim(node(1))
    pynvml.nvmlInit()
    try:
        handle = pynvml.nvmlDeviceGetHandleByIndex(0)
        with pytest.raises(SimulatedMemoryCorruption):
            pynvml.nvmlDeviceGetGpuFabricInfoV(handle, pynvml.c_nvmlGpuFabricInfo_v3_t())
        wrong = pynvml.c_nvmlGpuFabricInfo_v3_t()
        wrong.version = 0
        with pytest.raises(pynvml.NVMLError_ArgumentVersionMismatch):
            pynvml.nvmlDeviceGetGpuFabricInfoV(handle, ctypes.byref(wrong))
        info = pynvml.c_nvmlGpuFabricInfo_v3_t()
        pynvml.nvmlDeviceGetGpuFabricInfoV(handle, ctypes.byref(info))
        assert info.state == pynvml.NVML_GPU_FABRIC_STATE_COMPLETED
    finally:
        pynvml.nvmlShutdown()


def test_an_sxid_the_kernel_logged_before_the_start_warns_every_gpu_for_the_xid_window(sim) -> None:
    """SXid 20034 on NVSwitch 3, logged 120 s before the simulator started: read from the kernel log (not from NVML),
    it makes every GPU's fabric verdict a warning naming the switch and the SXid, with the record's wall time, until
    xid_window_s (600 s) after the record; the scrape has its count and time. A node without NVSwitch cannot log one."""
    from tests.helpers.common import read_kernel_log

    clock = ManualClock()
    sim({**node(2), "kernel_log": [{"kind": "sxid", "switch": 3, "sxid": 20034, "at": -120}]}, clock=clock)
    pipeline = Pipeline(settings(poll={"slow_interval": 5}), wall_clock=clock)
    started = clock()
    try:
        read_kernel_log(pipeline)
        seen = {}
        for second in range(0, 490, 5):
            pipeline.poll_once()
            seen[second] = {
                gpu.index: next(v for v in pipeline.snapshot.health[gpu.uuid] if v.check == "fabric")
                for gpu in pipeline.snapshot.gpus
            }
            if second == 0:
                series = scrape(pipeline)
            clock.advance(5.0)
    finally:
        pipeline.stop(0.5)
    switch = "00000000:89:00.0"
    assert all(v.severity == "warning" and f"SXid 20034 on NVSwitch {switch}" in v.observed for v in seen[0].values())
    assert {v.severity for v in seen[475].values()} == {"warning"}  # 595 s after the record
    assert {v.severity for v in seen[485].values()} == {"ok"}  # 605 s after
    assert values(series, "gpuwarden_kernel_sxid_errors_total", switch=switch, sxid="20034") == [1]
    assert values(series, "gpuwarden_kernel_sxid_last_timestamp_seconds", switch=switch) == [started - 120]
    with pytest.raises(Exception, match="an SXid needs an NVSwitch node"):
        sim({**node(2, nvlink="none"), "kernel_log": [{"kind": "sxid", "switch": 0, "sxid": 1, "at": 0}]})
