"""Utilization from the driver's sample buffer, turned into busy-time counters (docs/nvml.md, Utilization).

One nvmlDeviceGetUtilizationRates read per scrape samples a single ~200 ms window and misreports bursty load.
nvmlDeviceGetSamples returns every sample since the last timestamp we saw: each sample adds value × period
to gpuwarden_busy_seconds_total and period to gpuwarden_utilization_sampled_seconds_total, so busy ÷ sampled
over any window is a true time average. Where samples are unsupported (MIG parents, old boards), one read per
poll is integrated over the poll interval instead, and gpuwarden_utilization_source_info says so.
The buffer is drained every poll.samples_interval (5 s: ~2.4 ms per GPU and type); the point value is read
every fast poll.
"""

from __future__ import annotations

import time

from gpuwarden.collect.reader import Reader
from gpuwarden.model.families import (
    BUSY_SECONDS_TOTAL,
    MEMORY_BANDWIDTH_UTILIZATION_RATIO,
    UTILIZATION_RATIO,
    UTILIZATION_SAMPLED_SECONDS_TOTAL,
    UTILIZATION_SOURCE_INFO,
    VIDEO_BUSY_SECONDS_TOTAL,
)
from gpuwarden.model.snapshot import SampleWriter, Tier
from gpuwarden.nvml import calls as nvml
from gpuwarden.nvml import library
from gpuwarden.nvml.device import GpuDevice

_GAP_FACTOR = 2.5  # a gap longer than this many periods counts as one period (data was lost)
_DEFAULT_PERIOD_S = 0.2  # measured H100 sample period, used until deltas are seen


class _Accumulator:
    """Busy and sampled seconds for one sample type, plus where we left off in the driver's buffer."""

    def __init__(self) -> None:
        self.last_timestamp_us = 0
        self.period_s = _DEFAULT_PERIOD_S
        self.busy_s = 0.0
        self.sampled_s = 0.0

    def add_samples(self, samples: list[tuple[int, float]]) -> None:
        samples = sorted(s for s in samples if s[0] > self.last_timestamp_us)
        if not samples:
            return
        previous = self.last_timestamp_us
        deltas = [(b[0] - a[0]) / 1e6 for a, b in zip(samples, samples[1:], strict=False) if b[0] > a[0]]
        if deltas:
            self.period_s = _median(deltas)
        for timestamp, value in samples:
            if previous == 0:
                period = self.period_s  # first sample ever: its own window, by the typical period
            else:
                period = (timestamp - previous) / 1e6
                if period > _GAP_FACTOR * self.period_s:
                    period = self.period_s
            self.busy_s += min(max(value, 0.0), 100.0) / 100.0 * period
            self.sampled_s += period
            previous = timestamp
        self.last_timestamp_us = samples[-1][0]


def _sample_value(sample: object, value_type: int) -> float:
    value = sample.sampleValue  # type: ignore[attr-defined]
    if value_type == nvml.NVML_VALUE_TYPE_DOUBLE:
        return float(value.dVal)
    if value_type == nvml.NVML_VALUE_TYPE_UNSIGNED_LONG_LONG:
        return float(value.ullVal)
    return float(value.uiVal)


def _read_samples(dev: GpuDevice, sample_type: int, acc: _Accumulator, key: str) -> bool:
    """Feed new samples into the accumulator; False when the GPU does not support samples."""
    result = dev.call(nvml.nvmlDeviceGetSamples, sample_type, acc.last_timestamp_us, key=key)
    if result is None:
        return dev.supports(key)  # None + supported = no new samples (NOT_FOUND)
    value_type, samples = result
    acc.add_samples([(int(s.timeStamp), _sample_value(s, value_type)) for s in samples])
    return True


def read_samples(dev: GpuDevice, out: SampleWriter) -> None:
    """Drain the sample buffer into the busy/sampled counters (every poll.samples_interval, ≤ 10 s)."""
    gpu_acc: _Accumulator = dev.state.setdefault("util_gpu", _Accumulator())
    mem_acc: _Accumulator = dev.state.setdefault("util_mem", _Accumulator())
    if not _read_samples(dev, nvml.NVML_GPU_UTILIZATION_SAMPLES, gpu_acc, "samples_gpu"):
        return  # unsupported (MIG parent, old board): read_fast integrates single reads instead
    _read_samples(dev, nvml.NVML_MEMORY_UTILIZATION_SAMPLES, mem_acc, "samples_memory")
    out.add(UTILIZATION_SOURCE_INFO, 1, "samples")
    out.add(BUSY_SECONDS_TOTAL, gpu_acc.busy_s)
    out.add(UTILIZATION_SAMPLED_SECONDS_TOTAL, gpu_acc.sampled_s)


def read_fast(dev: GpuDevice, out: SampleWriter) -> None:
    """The point value (the driver's last sample period, ~2 µs) every poll; counters from it if no samples."""
    rates = dev.call(nvml.nvmlDeviceGetUtilizationRates)
    if rates is None:
        return
    out.add(UTILIZATION_RATIO, rates.gpu / 100.0)
    out.add(MEMORY_BANDWIDTH_UTILIZATION_RATIO, rates.memory / 100.0)
    if dev.supports("samples_gpu"):
        return
    acc: _Accumulator = dev.state.setdefault("util_gpu", _Accumulator())
    now = time.monotonic()
    last = dev.state.get("util_single_read_at")
    dev.state["util_single_read_at"] = now
    if last is not None:
        acc.busy_s += rates.gpu / 100.0 * (now - last)
        acc.sampled_s += now - last
    out.add(UTILIZATION_SOURCE_INFO, 1, "single_read")
    out.add(BUSY_SECONDS_TOTAL, acc.busy_s)
    out.add(UTILIZATION_SAMPLED_SECONDS_TOTAL, acc.sampled_s)


def read_video(dev: GpuDevice, out: SampleWriter) -> None:
    """Encoder and decoder utilization, integrated into busy seconds over the time since the last poll: NVML gives
    a share of its own sampling period (100 ms on H100), so a counter keeps what a point read would drop."""
    now = library.monotonic()  # the driver's clock (the simulator's scenario time under test)
    last = dev.state.get("video_read_at")
    dev.state["video_read_at"] = now
    busy: dict[str, float] = dev.state.setdefault("video_busy", {})
    engines = (("encoder", nvml.nvmlDeviceGetEncoderUtilization), ("decoder", nvml.nvmlDeviceGetDecoderUtilization))
    for engine, call in engines:
        answer = dev.call(call, key=f"video_{engine}")
        if answer is None:
            continue
        utilization, _period_us = answer
        if last is not None:
            busy[engine] = busy.get(engine, 0.0) + min(max(utilization, 0), 100) / 100.0 * (now - last)
        out.add(VIDEO_BUSY_SECONDS_TOTAL, busy.get(engine, 0.0), engine)


VIDEO = Reader("video", Tier.FAST, (VIDEO_BUSY_SECONDS_TOTAL,), read_video)

_COUNTERS = (
    BUSY_SECONDS_TOTAL,
    UTILIZATION_SAMPLED_SECONDS_TOTAL,
    UTILIZATION_SOURCE_INFO,
)
SAMPLES = Reader("utilization_samples", Tier.FAST, _COUNTERS, read_samples, every="samples_interval")
FAST = Reader(
    "utilization",
    Tier.FAST,
    (UTILIZATION_RATIO, MEMORY_BANDWIDTH_UTILIZATION_RATIO, *_COUNTERS),
    read_fast,
)


def _median(values: list[float]) -> float:
    """The median (statistics.median without the statistics module, which costs 0.6 MiB of imports at start)."""
    ordered = sorted(values)
    middle = len(ordered) // 2
    return ordered[middle] if len(ordered) % 2 else (ordered[middle - 1] + ordered[middle]) / 2
