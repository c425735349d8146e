"""Every shipped scenario: the exposition passes `promtool check metrics` and shows what the scenario says."""

from __future__ import annotations

import shutil
import subprocess
import time

import pytest
from prometheus_client.openmetrics.parser import text_string_to_metric_families

from gpuwarden.exposition.render import Renderer
from gpuwarden.sim.scenario import shipped_scenarios
from tests.helpers.common import NVLINK_ERRORS_EVERY_POLL, ManualClock, series_of, sweep, values

SCENARIOS = sorted(shipped_scenarios())
PROMTOOL = shutil.which("promtool")


def run_scenario(sim, make_pipeline, name: str, seconds: float = 12.0, **sections):
    """A pipeline that polled a scenario over `seconds` of simulated time."""
    clock = ManualClock()
    sim(name, clock=clock)
    pipeline = make_pipeline(**sections)
    pipeline.poll_once()
    for _ in range(int(seconds)):
        clock.advance(1.0)
        pipeline.poll_once()
    return pipeline


def test_all_required_scenarios_ship():
    required = {
        "healthy",
        "training",
        "data-starvation",
        "thermal-throttling",
        "power-capping",
        "memory-nearly-full",
        "ecc-uncorrectable",
        "row-remap",
        "nvlink-down",
        "gpu-lost",
        "persistence-off",
        "driver-not-loaded",
        "legacy-pcie",
    }
    assert required <= set(SCENARIOS)


@pytest.mark.skipif(PROMTOOL is None, reason="promtool not installed (the README test command installs it)")
# every shipped scenario in the whole suite; in the developer tier the two with the most label shapes
@pytest.mark.parametrize("name", sweep(SCENARIOS, lambda name: name in ("training", "mig-inference")))
def test_promtool_accepts_every_scenario(sim, make_pipeline, name):
    snapshot = run_scenario(sim, make_pipeline, name).snapshot
    renderer = Renderer(lambda n: True)
    text, openmetrics = renderer.render(snapshot).decode(), renderer.render(snapshot, openmetrics=True)
    result = subprocess.run([PROMTOOL, "check", "metrics"], input=text.encode(), capture_output=True, timeout=30)
    assert result.returncode == 0, result.stderr.decode() + result.stdout.decode()
    assert result.stdout.decode().strip() == "" and result.stderr.decode().strip() == ""
    # promtool 2.42 reads only the text format; the OpenMetrics rendering goes through the strict OM parser.
    families = list(text_string_to_metric_families(openmetrics.decode()))
    assert {f.name for f in families} >= {"gpuwarden_nvml_up", "gpuwarden_build_info"}


def _series(sim, make_pipeline, name, seconds=12.0, **sections):
    pipeline = run_scenario(sim, make_pipeline, name, seconds, **sections)
    return pipeline, series_of(pipeline.snapshot)


def busy_ratio(sim, make_pipeline, name, gpu="0"):
    clock = ManualClock()
    sim(name, clock=clock)
    pipeline = make_pipeline()
    clock.advance(1)
    pipeline.poll_once()
    first = series_of(pipeline.snapshot)
    for _ in range(30):
        clock.advance(0.7)
        pipeline.poll_once()
    last = series_of(pipeline.snapshot)
    busy = (
        values(last, "gpuwarden_busy_seconds_total", gpu=gpu)[0]
        - values(first, "gpuwarden_busy_seconds_total", gpu=gpu)[0]
    )
    sampled = (
        values(last, "gpuwarden_utilization_sampled_seconds_total", gpu=gpu)[0]
        - values(first, "gpuwarden_utilization_sampled_seconds_total", gpu=gpu)[0]
    )
    return busy / sampled


def test_healthy_matches_the_real_h100_idle_readings(sim, make_pipeline):
    _, s = _series(sim, make_pipeline, "healthy")
    assert len(values(s, "gpuwarden_gpu_up")) == 8 and set(values(s, "gpuwarden_gpu_up")) == {1}
    assert set(values(s, "gpuwarden_performance_state")) == {0}
    assert set(values(s, "gpuwarden_clock_event_active", reason="gpu_idle")) == {1}
    assert set(values(s, "gpuwarden_clock_hertz", clock="sm")) == {345e6}
    assert set(values(s, "gpuwarden_topology_info", gpu="0", peer_gpu="1")) == {1}
    assert (
        "gpuwarden_topology_info",
        frozenset(
            {
                ("gpu", "0"),
                (
                    "uuid",
                    dict(next(lbls for (n, lbls) in s if n == "gpuwarden_gpu_up" and ("gpu", "0") in lbls))["uuid"],
                ),
                ("peer_gpu", "1"),
                ("level", "NV18"),
            }
        ),
    ) in s
    assert set(values(s, "gpuwarden_nvlink_peer_links")) == {18}
    assert values(s, "gpuwarden_fan_speed_ratio") == []  # NotSupported on SXM, as measured


def test_training_is_busy(sim, make_pipeline):
    assert busy_ratio(sim, make_pipeline, "training") > 0.85


def test_data_starvation_is_idle_while_memory_is_full(sim, make_pipeline):
    assert busy_ratio(sim, make_pipeline, "data-starvation") == pytest.approx(0.30, abs=0.03)
    _, s = _series(sim, make_pipeline, "data-starvation")
    used, total = (
        values(s, "gpuwarden_memory_used_bytes", gpu="0")[0],
        values(s, "gpuwarden_memory_total_bytes", gpu="0")[0],
    )
    assert used / total > 0.85
    assert set(values(s, "gpuwarden_processes")) == {1}


def test_thermal_throttling(sim, make_pipeline):
    _, s = _series(sim, make_pipeline, "thermal-throttling")
    assert values(s, "gpuwarden_temperature_celsius", gpu="2")[0] >= 90
    assert values(s, "gpuwarden_clock_event_active", gpu="2", reason="hw_thermal_slowdown") == [1]
    assert values(s, "gpuwarden_clock_event_active", gpu="0", reason="hw_thermal_slowdown") == [0]
    assert values(s, "gpuwarden_clock_hertz", gpu="5", clock="sm")[0] < 1.3e9
    assert values(s, "gpuwarden_throttle_seconds_total", gpu="2", reason="hw_thermal_slowdown")[0] > 10
    assert values(s, "gpuwarden_throttle_seconds_total", gpu="0", reason="hw_thermal_slowdown") == [0]


def test_power_capping(sim, make_pipeline):
    _, s = _series(sim, make_pipeline, "power-capping")
    assert set(values(s, "gpuwarden_power_limit_watts")) == {400}
    assert set(values(s, "gpuwarden_power_default_limit_watts")) == {700}
    assert min(values(s, "gpuwarden_power_usage_watts")) >= 390
    assert set(values(s, "gpuwarden_clock_event_active", reason="sw_power_cap")) == {1}


def test_memory_nearly_full(sim, make_pipeline):
    _, s = _series(sim, make_pipeline, "memory-nearly-full")
    used = values(s, "gpuwarden_memory_used_bytes", gpu="3")[0]
    total = values(s, "gpuwarden_memory_total_bytes", gpu="3")[0]
    assert used / total > 0.98
    assert values(s, "gpuwarden_memory_used_bytes", gpu="0")[0] / total < 0.9


def test_ecc_uncorrectable(sim, make_pipeline):
    _, s = _series(sim, make_pipeline, "ecc-uncorrectable")
    assert values(s, "gpuwarden_ecc_errors_total", gpu="1", type="uncorrected") == [2]
    assert values(s, "gpuwarden_ecc_errors_total", gpu="1", type="corrected")[0] >= 3
    assert values(s, "gpuwarden_ecc_errors_total", gpu="0", type="uncorrected") == [0]
    assert values(s, "gpuwarden_remapped_rows", gpu="1", cause="uncorrectable") == [1]
    assert values(s, "gpuwarden_remapped_rows_pending", gpu="1") == [1]
    assert values(s, "gpuwarden_recovery_action", gpu="1") == [1]
    assert values(s, "gpuwarden_recovery_action", gpu="0") == [0]


def test_row_remap_pending_and_failed(sim, make_pipeline):
    _, s = _series(sim, make_pipeline, "row-remap", seconds=2)
    assert values(s, "gpuwarden_remapped_rows_pending", gpu="2") == [1]
    assert values(s, "gpuwarden_remapped_rows_failed", gpu="2") == [0]
    assert values(s, "gpuwarden_remapped_rows_failed", gpu="5") == [1]
    assert values(s, "gpuwarden_remapped_rows", gpu="5", cause="correctable") == [9]


def test_nvlink_down(sim, make_pipeline):
    pipeline, s = _series(sim, make_pipeline, "nvlink-down", poll=NVLINK_ERRORS_EVERY_POLL)
    assert values(s, "gpuwarden_nvlink_up", gpu="4", link="7") == [0]
    assert sum(values(s, "gpuwarden_nvlink_up", gpu="4")) == 17
    assert values(s, "gpuwarden_nvlink_errors_total", gpu="4", link="3", type="crc_flit")[0] >= 12 * 10
    assert set(values(s, "gpuwarden_nvlink_peer_links", gpu="4")) == {17}
    assert set(values(s, "gpuwarden_nvlink_peer_links", gpu="0", peer_gpu="4")) == {17}
    assert set(values(s, "gpuwarden_nvlink_peer_links", gpu="0", peer_gpu="1")) == {18}
    assert values(s, "gpuwarden_topology_info", gpu="4", peer_gpu="0", level="NV17") == [1]


def test_gpu_lost(sim, make_pipeline):
    _, s = _series(sim, make_pipeline, "gpu-lost")
    assert values(s, "gpuwarden_gpu_up", gpu="6") == [0]
    assert values(s, "gpuwarden_temperature_celsius", gpu="6") == []
    assert len(values(s, "gpuwarden_gpu_info", gpu="6")) == 1  # identity stays for the alert text
    assert len(values(s, "gpuwarden_temperature_celsius")) == 7
    assert values(s, "gpuwarden_gpus") == [7]


def test_gpu_lost_xid_79_reaches_the_event_thread(sim, make_pipeline):
    clock = ManualClock(0.0)
    sim("gpu-lost", clock=clock)
    pipeline = make_pipeline(poll={"fast_interval": 0.2})
    pipeline.start()
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline and len(pipeline.poller._watcher.registered) < 8:
        time.sleep(0.02)
    clock.advance(7.6)  # XID 79 fires at 7.5 s, the GPU falls off the bus at 8 s
    while time.monotonic() < deadline and not pipeline.snapshot.xid:
        time.sleep(0.05)
    assert [xid for (_, xid) in pipeline.snapshot.xid] == [79]


def test_persistence_off(sim, make_pipeline):
    _, s = _series(sim, make_pipeline, "persistence-off", seconds=1)
    assert set(values(s, "gpuwarden_persistence_mode_enabled")) == {0}


def test_driver_not_loaded(sim, make_pipeline):
    pipeline, s = _series(sim, make_pipeline, "driver-not-loaded", seconds=1)
    assert values(s, "gpuwarden_nvml_up") == [0]
    assert values(s, "gpuwarden_nvml_error_info", error="driver_not_loaded") == [1]
    assert values(s, "gpuwarden_gpu_up") == []
    assert pipeline.fatal is None


def test_legacy_pcie(sim, make_pipeline):
    _, s = _series(sim, make_pipeline, "legacy-pcie")
    assert len(values(s, "gpuwarden_gpu_up")) == 2
    assert values(s, "gpuwarden_retired_pages", gpu="1", cause="single_bit") == [2]
    assert values(s, "gpuwarden_retired_pages", gpu="1", cause="double_bit") == [1]
    assert values(s, "gpuwarden_retired_pages_pending", gpu="1") == [1]
    assert values(s, "gpuwarden_remapped_rows") == []
    assert 0.4 < values(s, "gpuwarden_fan_speed_ratio", gpu="0")[0] < 0.6
    assert values(s, "gpuwarden_topology_info", gpu="0", peer_gpu="1", level="PHB") == [1]
    assert values(s, "gpuwarden_nvlink_peer_links") == [] and values(s, "gpuwarden_nvlink_up") == []
    assert values(s, "gpuwarden_memory_temperature_celsius") == []
    assert values(s, "gpuwarden_pcie_link_generation", gpu="0", kind="max") == [3]


def test_gpu_uuids_follow_the_node_identity_not_the_file_name(sim):
    """UUIDs derive from node.identity, default the scenario's name: a copy renamed with the original identity keeps
    its GPUs (a renamed copy without it shows new GPUs, as documented in docs/simulator.md)."""
    import pynvml

    def uuids(scenario: dict) -> list[str]:
        sim(scenario)
        pynvml.nvmlInit()
        try:
            return [pynvml.nvmlDeviceGetUUID(pynvml.nvmlDeviceGetHandleByIndex(i)) for i in range(2)]
        finally:
            pynvml.nvmlShutdown()

    original = uuids({"name": "rack-a", "node": {"count": 2}})
    assert uuids({"name": "rack-a-copy", "node": {"count": 2, "identity": "rack-a"}}) == original
    renamed = uuids({"name": "rack-a-copy", "node": {"count": 2}})
    assert set(renamed).isdisjoint(original) and len(set(original)) == 2
