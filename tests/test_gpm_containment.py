"""GPM's crash containment and the simulator's teeth (docs/nvml.md, GPM: the crash under training).

- The daemon over a scenario whose GPM call segfaults: /metrics (other families included) and /readyz keep
  answering from the same process, GPM turns off with a counted reason after the crash limit, and comes back after
  the backoff once the fault window has ended.
- The fake library fails loudly where the real one corrupts memory: a sample used or freed after it was freed, two
  GPM calls in flight at once.
- The in-process sampler (nvml.gpm_isolation: thread) serialises GPM calls across GPUs, so eight GPUs read at once
  never overlap inside the library.
"""

from __future__ import annotations

import threading
import time
import urllib.error
import urllib.request

import pynvml
import pytest

from gpuwarden.collect.readers.gpm import METRICS
from gpuwarden.nvml import gpm_sampler
from gpuwarden.nvml.gpm_sampler import ChildProcessSampler, GpmSamplerDown, GpmSamplerStarting, InProcessSampler
from gpuwarden.sim.fakecommon import SimulatedMemoryCorruption
from tests.helpers.common import parse_exposition, values, write_yaml
from tests.helpers.stack import running_cli

CRASH_FROM, CRASH_UNTIL, BACKOFF = 2.0, 9.0, 4.0


def get(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=1.0) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


@pytest.mark.slow
def test_a_segfaulting_gpm_call_costs_only_the_gpm_series_and_gpm_comes_back_after_the_backoff(tmp_path):
    scenario = write_yaml(
        tmp_path / "gpm-crash.yaml",
        {
            "name": "gpm-crash",
            "node": {"model": "h100-sxm-80gb", "count": 2},
            "faults": [{"kind": "crash", "call": "nvmlGpmMetricsGet", "at": CRASH_FROM, "until": CRASH_UNTIL}],
        },
    )
    with running_cli(
        "--sim", "--nvml.scenario", str(scenario), "--nvml.gpm-crash-limit", "3",
        "--nvml.gpm-crash-backoff", str(BACKOFF),
    ) as (url, proc):  # fmt: skip
        started = time.monotonic()
        seen_off = seen_back = False
        windows_when_off = 0.0
        while time.monotonic() - started < CRASH_UNTIL + BACKOFF + 8 and not seen_back:
            status, body = get(url + "/metrics")
            assert status == 200
            assert get(url + "/readyz")[0] == 200
            series = parse_exposition(body)
            assert values(series, "gpuwarden_gpu_up") == [1.0, 1.0]  # every other family keeps coming
            assert values(series, "gpuwarden_temperature_celsius", gpu="1")
            crashed = values(series, "gpuwarden_gpm_unavailable_info", gpu="0", reason="crashed")
            window = sum(values(series, "gpuwarden_gpm_window_seconds_total", gpu="0"))
            if crashed and not seen_off:
                seen_off, windows_when_off = True, window
            elif seen_off and not crashed and window > windows_when_off + 1.5:
                seen_back = True  # windows count again after the fault window and the backoff
            time.sleep(0.5)
        assert proc.poll() is None  # the serving process never died
        errors = values(series, "gpuwarden_collect_errors_total", call="gpm_sampler", error="crashed")
    log = proc.stderr.read()
    assert seen_off and seen_back, log
    assert errors and errors[0] >= 3  # each crash counted once, with its reason
    assert "GPM off for 4 s" in log and "in nvmlGpmMetricsGet" in log and "upgrade the NVIDIA driver" in log
    assert "Traceback" not in log


def test_a_sample_used_or_freed_after_it_was_freed_fails_loudly(sim):
    sim({"node": {"model": "h100-sxm-80gb", "count": 1}})
    pynvml.nvmlInit()
    handle = pynvml.nvmlDeviceGetHandleByIndex(0)
    sample = pynvml.nvmlGpmSampleAlloc()
    pynvml.nvmlGpmSampleGet(handle, sample)
    pynvml.nvmlGpmSampleFree(sample)
    with pytest.raises(SimulatedMemoryCorruption, match="after nvmlGpmSampleFree"):
        pynvml.nvmlGpmSampleGet(handle, sample)
    with pytest.raises(SimulatedMemoryCorruption, match="after nvmlGpmSampleFree"):
        pynvml.nvmlGpmSampleFree(sample)
    kept = pynvml.nvmlGpmSampleAlloc()  # a new buffer never reuses the freed one's identity
    request = pynvml.c_nvmlGpmMetricsGet_t()
    request.version, request.numMetrics, request.sample1, request.sample2 = 1, 1, sample, kept
    request.metrics[0].metricId = pynvml.NVML_GPM_METRIC_SM_UTIL
    with pytest.raises(SimulatedMemoryCorruption):
        pynvml.nvmlGpmMetricsGet(request)


def test_two_gpm_calls_in_flight_at_once_fail_loudly(sim):
    fake = sim({"node": {"model": "h100-sxm-80gb", "count": 2}})
    fake.gpm_call_seconds = 0.3  # a wide window, so the planted overlap is certain
    pynvml.nvmlInit()
    handles = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(2)]
    samples = [pynvml.nvmlGpmSampleAlloc() for _ in range(2)]
    barrier, caught = threading.Barrier(2), []

    def take(i: int) -> None:
        barrier.wait()
        try:
            pynvml.nvmlGpmSampleGet(handles[i], samples[i])
        except SimulatedMemoryCorruption as exc:
            caught.append(str(exc))

    threads = [threading.Thread(target=take, args=(i,)) for i in range(2)]
    [t.start() for t in threads]
    [t.join() for t in threads]
    assert len(caught) == 1 and "concurrent GPM calls" in caught[0]


def test_the_in_process_sampler_never_overlaps_gpm_calls_across_gpus(sim):
    fake = sim({"node": {"model": "h100-sxm-80gb", "count": 8}})
    fake.gpm_call_seconds = 0.005
    pynvml.nvmlInit()
    sampler = InProcessSampler()
    barrier, failures, windows = threading.Barrier(8), [], []

    def read(i: int) -> None:
        handle = pynvml.nvmlDeviceGetHandleByIndex(i)
        uuid = pynvml.nvmlDeviceGetUUID(handle)
        barrier.wait()
        for _ in range(3):
            try:
                window = sampler.advance(uuid, handle, None, list(METRICS))
            except SimulatedMemoryCorruption as exc:
                failures.append(str(exc))
                return
            if window is not None:
                windows.append(window)
            time.sleep(0.11)  # GPM windows are at least 100 ms

    threads = [threading.Thread(target=read, args=(i,)) for i in range(8)]
    [t.start() for t in threads]
    [t.join() for t in threads]
    sampler.stop()
    assert failures == []
    assert len(windows) == 16  # two windows per GPU after the first sample


@pytest.mark.slow
def test_the_child_sampler_reads_the_same_windows_and_survives_nothing_it_should_not(tmp_path):
    """The child over the simulator's timeline: windows answer, a second request needs no new child, stop ends it."""
    from gpuwarden.nvml import library
    from gpuwarden.sim import install_simulator

    fake = install_simulator("training")
    try:
        spec = library.child_spec()
        assert spec == {"backend": "sim", "scenario": "training", "start": fake.start}
        sampler = ChildProcessSampler(spec, crash_limit=3, crash_backoff=5)
        uuid = fake.uuid(0)
        answers = []
        deadline = time.monotonic() + 15
        starting = 0
        while len([a for a in answers if a is not None]) < 2 and time.monotonic() < deadline:
            try:
                answers.append(sampler.advance(uuid, None, None, list(METRICS)))
            except GpmSamplerStarting:  # never blocks a fast cycle on the child's start
                assert not answers, "the child said it was starting after it had answered"
                starting += 1
            time.sleep(0.2)
        assert starting >= 1  # the first request only starts the child
        windows = [a for a in answers if a is not None]
        assert len(windows) == 2 and sampler.starts == 1
        sm = windows[-1].values[pynvml.NVML_GPM_METRIC_SM_UTIL]
        assert 0 < sm <= 100
        pid = sampler.pid()
        sampler.stop()
        assert sampler.pid() is None and pid is not None
    finally:
        library.install(None)


def test_a_sampler_that_is_off_answers_at_once_without_a_child():
    sampler = ChildProcessSampler({"backend": "nvml"}, crash_limit=1, crash_backoff=60)
    sampler.off_until, sampler.off_reason = time.monotonic() + 60, "crashed"
    started = time.monotonic()
    with pytest.raises(GpmSamplerDown) as raised:
        sampler.advance("GPU-x", None, None, [1])
    assert raised.value.reason == "crashed" and not raised.value.counted
    assert sampler.pid() is None and time.monotonic() - started < 0.1


def test_the_sampler_is_a_child_only_where_the_library_can_be_reproduced(sim):
    from tests.helpers.common import ManualClock

    sim("healthy", clock=ManualClock())  # a hand-moved clock cannot be shared with another process
    assert isinstance(gpm_sampler.configure("process", 3, 600), InProcessSampler)
    gpm_sampler.reset()
