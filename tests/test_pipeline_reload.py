"""Reload is owned by the composition root (gpuwarden/runtime/pipeline.py): the stages that depend on the settings
are rebuilt from the new ones, so no reload leaves a stage sized for the old settings.

The bug this guards against: a SIGHUP that lengthened a health window past the history kept (each GPU's history was
sized once, at start) left that check unjudged until a restart."""

from __future__ import annotations

import pytest

from gpuwarden.exposition.render import Renderer
from gpuwarden.health.evaluator import HealthEvaluator
from gpuwarden.health.thresholds import load_thresholds
from gpuwarden.runtime.pipeline import Pipeline
from tests.helpers.common import ManualClock, settings, wait_for, write_yaml
from tests.helpers.thresholds import SHORT

# Every window a GPU's history serves, each set longer than the history the SHORT thresholds keep (900 s + slots).
WINDOWS = (
    "utilization_for_s",
    "thermal_slowdown_for_s",
    "power_cap_for_s",
    "pstate_for_s",
    "nvlink_crc_for_s",
    "pcie_replays_for_s",
    "bottleneck_window_s",
)
LONG = {**SHORT, **dict.fromkeys(WINDOWS, 1000)}
STEP_S = 10.0  # simulated seconds between polls
RELOAD_AT_S = 200.0

# Three GPUs whose faults are judged over those windows: thermal slowdown, the power cap, and a GPU held in a low
# P-state while busy; the windows' ratios differ between GPUs, so a verdict judged on the wrong span shows.
SCENARIO = {
    "node": {"model": "h100-sxm-80gb", "count": 3, "nvlink": "nvswitch"},
    "values": {"utilization": {"constant": 90, "noise": 8}, "processes": 1, "clock_event_reasons": 0},
    "gpus": {
        0: {"temperature": 92, "clock_event_reasons": 0x60, "sm_clock_mhz": {"constant": 1110, "noise": 30}},
        1: {"power_limit_watts": 400, "power_watts": 398, "clock_event_reasons": 0x4},
        2: {"pstate": 8, "utilization": {"constant": 60, "noise": 30}},
    },
}


def verdicts(pipeline: Pipeline) -> dict[tuple[int, str], tuple[int, str, str, str]]:
    """Each GPU's verdicts as (level, observed, threshold, detail): what was measured over which window and the
    judgement; `since` differs where the two runs judged a fault at different times."""
    snapshot = pipeline.snapshot
    return {
        (gpu.index, verdict.check): (verdict.level, verdict.observed, verdict.threshold, verdict.detail)
        for gpu in snapshot.gpus
        for verdict in snapshot.health[gpu.uuid]
    }


def run(sim, tmp_path, name: str, first: dict, final: dict | None, until_s: float) -> dict[float, dict]:
    """Poll the scenario every STEP_S with `first` thresholds, reloading into `final` at RELOAD_AT_S (None: never);
    the verdicts at each poll from RELOAD_AT_S on."""
    clock = ManualClock()
    sim(SCENARIO, clock=clock)
    first_file = write_yaml(tmp_path / f"{name}-first.yaml", first)
    pipeline = Pipeline(settings(health={"thresholds_file": str(first_file)}, nvml={"xid_events": False}), clock)
    start, seen = clock(), {}
    try:
        while clock() - start <= until_s:
            elapsed = clock() - start
            if final is not None and elapsed == RELOAD_AT_S:
                final_file = write_yaml(tmp_path / f"{name}-final.yaml", final)
                pipeline.reload(settings(health={"thresholds_file": str(final_file)}, nvml={"xid_events": False}))
            pipeline.poll_once()
            if elapsed >= RELOAD_AT_S:
                seen[elapsed] = verdicts(pipeline)
            clock.advance(STEP_S)
    finally:
        pipeline.stop(0.5)
    return seen


@pytest.mark.slow  # ~260 polls of three GPUs, twice
def test_a_reload_into_windows_longer_than_the_history_judges_as_a_fresh_start_would(sim, tmp_path):
    """Reload from SHORT into every window longer than the history kept; from the moment a fresh start with the
    final settings judges those windows, the reloaded pipeline gives the same verdict on every GPU and check."""
    kept = HealthEvaluator(load_thresholds(write_yaml(tmp_path / "short.yaml", SHORT))).history_shape()[1]
    assert all(LONG[name] > kept for name in WINDOWS)
    until = RELOAD_AT_S + 1000 + 200
    reloaded = run(sim, tmp_path, "reloaded", SHORT, LONG, until)
    fresh = run(sim, tmp_path, "fresh", LONG, None, until)
    judged_from = 1000 + 2 * STEP_S  # the fresh start's windows are watched (and its history holds points that old)
    compared = [t for t in fresh if t >= judged_from]
    assert len(compared) >= 10
    for t in compared:
        assert reloaded[t] == fresh[t], t
    # the windows were judged, not left "n/a": the faults show at the end in both
    final = fresh[compared[-1]]
    assert final[(0, "thermal_throttling")][0] > 0 and final[(1, "power")][0] > 0, final


def test_a_reload_that_changes_no_health_setting_keeps_what_health_has_watched(sim, tmp_path):
    """A reload that keeps the thresholds (another setting changed, or none) keeps the history and the pending
    conditions: verdicts go on exactly as without the reload."""
    until = RELOAD_AT_S + 60
    reloaded = run(sim, tmp_path, "same", SHORT, SHORT, until)
    untouched = run(sim, tmp_path, "untouched", SHORT, None, until)
    assert reloaded == untouched
    assert any(verdict[0] > 0 for verdict in reloaded[max(reloaded)].values())


def test_a_reload_rebuilds_the_stages_and_swaps_them_into_the_poller(sim, tmp_path):
    """The root builds new stage objects and the poller runs them from the next publication; the old evaluator is
    no longer called."""
    sim(SCENARIO)
    pipeline = Pipeline(settings(nvml={"xid_events": False}))
    try:
        pipeline.poll_once()
        before = pipeline.health
        pipeline.reload(settings(nvml={"xid_events": False}, health={"thresholds_file": None}))
        assert pipeline.health is not before
        assert any(getattr(step, "evaluator", None) is pipeline.health for step in pipeline.poller.assembler.steps)
        assert not any(getattr(step, "evaluator", None) is before for step in pipeline.poller.assembler.steps)
        assert Renderer(lambda n: True).render(pipeline.poll_once())
    finally:
        pipeline.stop(0.5)


def test_a_reload_that_changes_the_kernel_log_reads_the_new_one_from_its_start_or_none(sim, tmp_path):
    """`nvml.kernel_log` changed by a reload: the reader of the old log stops, the new log is read from its start
    into a fresh tally (its XIDs only), and `off` leaves no reader and no kernel-log XIDs."""
    sim(SCENARIO)
    first, second = tmp_path / "first.kmsg", tmp_path / "second.kmsg"
    first.write_bytes(b"3,1,1000000,-;NVRM: Xid (PCI:0000:18:00): 13, pid=1, name=python, Graphics Exception\n")
    second.write_bytes(b"3,1,2000000,-;NVRM: Xid (PCI:0000:18:00): 31, pid=2, name=python, MMU Fault\n")
    pipeline = Pipeline(settings(nvml={"xid_events": False, "kernel_log": str(first)}))

    def kernel_xids() -> set[int]:
        return {xid for _, xid in pipeline.poll_once().xid}

    try:
        pipeline.start()
        wait_for(lambda: kernel_xids() == {13}, timeout=30)
        reader = pipeline.poller.kernel_reader
        pipeline.reload(settings(nvml={"xid_events": False, "kernel_log": str(second)}))
        wait_for(lambda: kernel_xids() == {31}, timeout=30)
        assert pipeline.poller.kernel_reader is not reader and reader._stop.is_set()  # the old one was told to stop
        pipeline.reload(settings(nvml={"xid_events": False, "kernel_log": "off"}))
        assert pipeline.poller.kernel_reader is None and kernel_xids() == set()
    finally:
        pipeline.stop(0.5)
