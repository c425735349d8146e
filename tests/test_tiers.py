"""Each tier reads what it should, through the real pynvml over the fake libnvidia-ml."""

from __future__ import annotations

import time

import pytest

from gpuwarden.exposition.render import Renderer
from gpuwarden.runtime.pipeline import Pipeline
from gpuwarden.sim.models import H100_SXM_80GB
from tests.helpers.common import ManualClock, series_of, values


def exposition(pipeline: Pipeline) -> dict:
    return series_of(pipeline.snapshot)


def test_static_tier_reads_identity_and_limits(sim, make_pipeline):
    fake = sim("healthy")
    pipeline = make_pipeline()
    pipeline.poll_once()
    series = exposition(pipeline)
    info = [lbls for (name, lbls) in series if name == "gpuwarden_gpu_info"]
    assert len(info) == 8
    first = dict(next(lbls for lbls in info if ("gpu", "0") in lbls))
    assert first["name"] == "NVIDIA H100 80GB HBM3"
    assert first["uuid"] == fake.uuid(0)
    assert first["pci_bus_id"] == fake.bus_id(0)
    assert first["compute_capability"] == "9.0"
    assert first["vbios_version"] == H100_SXM_80GB.vbios
    assert values(series, "gpuwarden_temperature_threshold_celsius", gpu="0", threshold="slowdown") == [89]
    assert values(series, "gpuwarden_temperature_threshold_celsius", gpu="0", threshold="gpu_max") == [87]
    assert values(series, "gpuwarden_clock_max_hertz", gpu="0", clock="sm") == [1980e6]
    assert values(series, "gpuwarden_power_default_limit_watts", gpu="0") == [700]
    assert values(series, "gpuwarden_pcie_link_generation", gpu="0", kind="max") == [5]
    # static reads happen once, not per poll
    calls = fake.calls["nvmlDeviceGetVbiosVersion"]
    pipeline.poll_once()
    assert fake.calls["nvmlDeviceGetVbiosVersion"] == calls


def test_fast_tier_memory_v2_matches_nvidia_smi_semantics(sim, make_pipeline):
    sim("healthy")
    pipeline = make_pipeline()
    pipeline.poll_once()
    series = exposition(pipeline)
    # As measured on H100: v2 used = 0 while 480 MiB are reserved; used + reserved + free = total.
    used = values(series, "gpuwarden_memory_used_bytes", gpu="0")[0]
    reserved = values(series, "gpuwarden_memory_reserved_bytes", gpu="0")[0]
    free = values(series, "gpuwarden_memory_free_bytes", gpu="0")[0]
    total = values(series, "gpuwarden_memory_total_bytes", gpu="0")[0]
    assert used == 0 and reserved == 503_316_480
    assert used + reserved + free == total == 85_520_809_984


def test_memory_falls_back_to_v1_on_old_driver(sim, make_pipeline):
    sim({"driver": {"missing_symbols": ["nvmlDeviceGetMemoryInfo_v2"]}, "node": {"count": 1}})
    pipeline = make_pipeline()
    pipeline.poll_once()
    series = exposition(pipeline)
    assert values(series, "gpuwarden_memory_used_bytes", gpu="0") == [503_316_480]  # v1 counts the reserve
    assert values(series, "gpuwarden_memory_reserved_bytes") == []
    assert pipeline.snapshot.gpus[0].info.memory_used_includes_reserved is True


def test_fallbacks_for_renamed_symbols(sim, make_pipeline):
    fake = sim(
        {
            "node": {"count": 1},
            "driver": {
                "missing_symbols": [
                    "nvmlDeviceGetTemperatureV",
                    "nvmlDeviceGetCurrentClocksEventReasons",
                    "nvmlDeviceGetComputeRunningProcesses_v3",
                ]
            },
            "values": {"processes": 2, "clock_event_reasons": 0x40},
        }
    )
    pipeline = make_pipeline()
    pipeline.poll_once()
    pipeline.poll_once()
    series = exposition(pipeline)
    assert values(series, "gpuwarden_temperature_celsius", gpu="0") == [38]
    assert values(series, "gpuwarden_clock_event_active", reason="hw_thermal_slowdown") == [1]
    assert values(series, "gpuwarden_processes") == [2]
    # the newest symbol is tried once, then the working one is remembered
    assert fake.missing_lookups["nvmlDeviceGetTemperatureV"] == 1
    assert fake.calls["nvmlDeviceGetTemperature"] == 2


def test_fast_tier_clock_events_pstate_power(sim, make_pipeline):
    sim("healthy")
    pipeline = make_pipeline()
    pipeline.poll_once()
    series = exposition(pipeline)
    assert values(series, "gpuwarden_performance_state", gpu="0") == [0]
    assert values(series, "gpuwarden_clock_hertz", gpu="0", clock="sm") == [345e6]
    assert values(series, "gpuwarden_clock_event_active", gpu="0", reason="gpu_idle") == [1]
    assert values(series, "gpuwarden_clock_event_active", gpu="0", reason="other") == [0]
    assert 70 <= values(series, "gpuwarden_power_usage_watts", gpu="0")[0] <= 76
    assert values(series, "gpuwarden_power_limit_watts", gpu="0") == [700]
    assert values(series, "gpuwarden_persistence_mode_enabled", gpu="0") == [1]


def test_unknown_clock_event_bits_are_reported_as_other(sim, make_pipeline):
    sim({"node": {"count": 1}, "values": {"clock_event_reasons": 0x401}})
    pipeline = make_pipeline()
    pipeline.poll_once()
    series = exposition(pipeline)
    assert values(series, "gpuwarden_clock_event_active", reason="other") == [1]
    assert values(series, "gpuwarden_clock_event_active", reason="gpu_idle") == [1]


def test_slow_tier_energy_throttle_pcie_nvlink(sim, make_pipeline):
    clock = ManualClock()
    sim(
        {
            "node": {"count": 2},
            "values": {"power_watts": 500, "clock_event_reasons": 0x40, "pcie_tx_bytes_per_second": 1e6},
        },
        clock=clock,
    )
    pipeline = make_pipeline()
    pipeline.poll_once()
    clock.advance(1)  # PCIe bytes come from GPM on this GPU: they need a first window
    pipeline.poll_once()
    first = exposition(pipeline)
    clock.advance(10)
    pipeline.poll_once()
    second = exposition(pipeline)
    energy = [values(s, "gpuwarden_energy_joules_total", gpu="0")[0] for s in (first, second)]
    assert energy[1] - energy[0] == pytest.approx(5000, rel=0.02)  # 500 W × 10 s
    throttle = [
        values(s, "gpuwarden_throttle_seconds_total", gpu="0", reason="hw_thermal_slowdown")[0] for s in (first, second)
    ]
    assert throttle[1] - throttle[0] == pytest.approx(10, abs=0.2)
    tx = [values(s, "gpuwarden_pcie_bytes_total", gpu="0", direction="tx")[0] for s in (first, second)]
    assert tx[1] - tx[0] == pytest.approx(1e7, rel=0.02)
    assert len(values(second, "gpuwarden_nvlink_up", gpu="0")) == 18
    assert set(values(second, "gpuwarden_nvlink_up")) == {1}
    # per link: crc_flit, replay, recovery (scoped fields); the legacy crc_data/ecc fields are NotSupported on H100
    assert len(values(second, "gpuwarden_nvlink_errors_total", gpu="0")) == 18 * 3


def test_slow_reads_are_batched_and_blocking_calls_are_never_made(sim, make_pipeline):
    fake = sim("nvlink-down")
    pipeline = make_pipeline()
    for _ in range(3):
        pipeline.poll_once()
    forbidden = {
        "nvmlDeviceGetPcieThroughput",
        "nvmlDeviceGetNvLinkErrorCounter",
        "nvmlDeviceGetNvLinkState",
        "nvmlDeviceGetViolationStatus",
    }
    assert not forbidden & (set(fake.calls) | set(fake.missing_lookups))
    # a handful of field batches per GPU per poll (thermal, throttle, PCIe, NVLink state, NVLink errors) plus
    # two at discovery: not one call per link (18 links)
    assert fake.calls["nvmlDeviceGetFieldValues"] <= 8 * (3 * 5 + 2)


def test_utilization_counters_match_the_duty_cycle(sim, make_pipeline):
    """A 30%-duty 1 s square wave: one read per poll aliases, the busy counters do not."""
    clock = ManualClock()
    sim(
        {
            "node": {"count": 1},
            "values": {"utilization": {"square": {"low": 0, "high": 100, "period": 1.0, "duty": 0.3}}},
        },
        clock=clock,
    )
    pipeline = make_pipeline()
    clock.advance(0.9)  # the newest sample window is then (0.6, 0.8] of a period: idle
    pipeline.poll_once()
    start = exposition(pipeline)
    single_reads = []
    for _ in range(20):
        clock.advance(1.0)  # polls land at the same phase of every period
        pipeline.poll_once()
        single_reads.append(values(exposition(pipeline), "gpuwarden_utilization_ratio")[0])
    end = exposition(pipeline)
    busy = values(end, "gpuwarden_busy_seconds_total")[0] - values(start, "gpuwarden_busy_seconds_total")[0]
    sampled = (
        values(end, "gpuwarden_utilization_sampled_seconds_total")[0]
        - values(start, "gpuwarden_utilization_sampled_seconds_total")[0]
    )
    assert sampled == pytest.approx(20, abs=0.01)
    assert busy / sampled == pytest.approx(0.30, abs=0.02)
    assert set(single_reads) == {0.0}  # one read per poll would report an idle GPU
    assert values(end, "gpuwarden_utilization_source_info", source="samples") == [1]


def test_utilization_gap_longer_than_the_buffer_counts_one_period(sim, make_pipeline):
    clock = ManualClock()
    sim({"node": {"count": 1}, "values": {"utilization": 50}}, clock=clock)
    pipeline = make_pipeline()
    clock.advance(1)
    pipeline.poll_once()
    before = values(exposition(pipeline), "gpuwarden_utilization_sampled_seconds_total")[0]
    clock.advance(60)  # exporter stalled longer than the driver's ~14 s buffer
    pipeline.poll_once()
    after = values(exposition(pipeline), "gpuwarden_utilization_sampled_seconds_total")[0]
    assert after - before == pytest.approx(71 * 0.2, abs=0.01)  # only what the buffer still held


def test_utilization_falls_back_to_single_reads_and_says_so(sim, make_pipeline):
    clock = ManualClock()
    sim(
        {
            "node": {"count": 1},
            "values": {"utilization": 60},
            "faults": [{"kind": "not_supported", "call": "nvmlDeviceGetSamples"}],
        },
        clock=clock,
    )
    pipeline = make_pipeline()
    clock.advance(1)
    pipeline.poll_once()
    clock.advance(1)
    pipeline.poll_once()
    series = exposition(pipeline)
    assert values(series, "gpuwarden_utilization_source_info", source="single_read") == [1]
    assert values(series, "gpuwarden_utilization_ratio") == [0.6]
    assert values(series, "gpuwarden_busy_seconds_total")[0] > 0


def test_include_exclude_skip_readers_and_series(sim, make_pipeline):
    fake = sim({"node": {"count": 1}})
    pipeline = make_pipeline(metrics={"exclude": ["gpuwarden_nvlink_*", "gpuwarden_energy_joules_total"]})
    pipeline.poll_once()
    assert fake.calls["nvmlDeviceGetTotalEnergyConsumption"] == 0
    renderer = Renderer(lambda n: not n.startswith("gpuwarden_nvlink_"))
    text = renderer.render(pipeline.snapshot).decode()
    assert "gpuwarden_nvlink_up" not in text and "gpuwarden_temperature_celsius" in text


def test_sample_buffer_is_drained_every_samples_interval_not_every_poll(sim, make_pipeline):
    fake = sim({"node": {"count": 1}, "values": {"utilization": 40}})
    pipeline = make_pipeline(poll={"samples_interval": 5})
    time.sleep(0.5)
    pipeline.poll_once()
    after_first = fake.calls["nvmlDeviceGetSamples"]  # pynvml probes the size, then fills: 2 C calls a type
    for _ in range(3):
        pipeline.poll_once()
    # one drain per sample type in the first 5 s, while the point value is read on every poll
    assert after_first == 4 and fake.calls["nvmlDeviceGetSamples"] == after_first
    assert fake.calls["nvmlDeviceGetUtilizationRates"] == 4
    series = exposition(pipeline)
    assert values(series, "gpuwarden_utilization_ratio") == [0.4]
    assert values(series, "gpuwarden_utilization_sampled_seconds_total")[0] > 0


def test_nvlink_error_counters_run_on_their_own_slower_interval(sim, make_pipeline):
    clock = ManualClock()
    fake = sim(
        {
            "node": {"count": 1},
            "faults": [{"kind": "nvlink_errors", "gpu": 0, "link": 2, "type": "replay", "every": 1, "count": 1}],
        },
        clock=clock,
    )
    pipeline = make_pipeline(poll={"nvlink_errors_interval": 60})
    pipeline.poll_once()
    first = values(exposition(pipeline), "gpuwarden_nvlink_errors_total", link="2", type="replay")
    batches = fake.calls["nvmlDeviceGetFieldValues"]
    clock.advance(5)
    pipeline.poll_once()
    series = exposition(pipeline)
    # counters are served from the last read (not dropped, not re-read); link state is read every slow poll
    assert values(series, "gpuwarden_nvlink_errors_total", link="2", type="replay") == first
    assert len(values(series, "gpuwarden_nvlink_up")) == 18
    # thermal, throttle, NVLink state (PCIe bytes come from GPM on this GPU: no PCIe field batch)
    assert fake.calls["nvmlDeviceGetFieldValues"] - batches == 3
