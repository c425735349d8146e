"""Health verdicts per scenario, with the thresholds' durations shortened (the same checks as shipped)."""

from __future__ import annotations

import dataclasses

import pytest

from gpuwarden.config.settings import ConfigError
from gpuwarden.health.thresholds import load_thresholds
from gpuwarden.runtime.pipeline import Pipeline
from tests.helpers.common import NVLINK_ERRORS_EVERY_POLL, ManualClock, series_of, settings, values, write_yaml
from tests.helpers.thresholds import SHORT


@pytest.fixture
def health_run(sim, tmp_path):
    pipelines: list[Pipeline] = []

    def run(scenario, seconds: int = 15, step: int = 1, poll: dict | None = None, **overrides):
        """Poll every `step` s of a manual clock for `seconds` (`poll`: poll settings, `overrides`: thresholds); the
        exposition after one more poll."""
        clock = ManualClock()
        sim(scenario, clock=clock)
        path = write_yaml(tmp_path / "thresholds.yaml", {**SHORT, **overrides})
        pipeline = Pipeline(settings(health={"thresholds_file": str(path)}, poll=poll or {}), wall_clock=clock)
        pipelines.append(pipeline)
        for _ in range(seconds // step):
            pipeline.poll_once()
            clock.advance(step)
        pipeline.poll_once()
        return series_of(pipeline.snapshot)

    yield run
    for pipeline in pipelines:
        pipeline.stop(timeout=0.2)


def health(series, gpu: str, check: str) -> float:
    found = values(series, "gpuwarden_health", gpu=gpu, check=check)
    assert len(found) == 1, (gpu, check, found)
    return found[0]


def test_healthy_node_is_all_ok(health_run):
    series = health_run("healthy", seconds=20)
    assert set(values(series, "gpuwarden_health")) == {0}
    assert set(values(series, "gpuwarden_health_status")) == {0}
    assert len(values(series, "gpuwarden_health_status")) == 8


def test_training_load_is_ok(health_run):
    series = health_run("training", seconds=20)
    assert set(values(series, "gpuwarden_health_status")) == {0}


def test_idle_gpu_in_p0_and_idle_gpu_in_p8_do_not_count_as_degraded(health_run):
    series = health_run({"node": {"count": 2}, "gpus": {1: {"pstate": 8}}}, seconds=15)
    assert health(series, "0", "performance_state") == 0
    assert health(series, "1", "performance_state") == 0


def test_busy_gpu_held_in_a_low_pstate_is_degraded(health_run):
    series = health_run(
        {"node": {"count": 2}, "values": {"utilization": 95, "processes": 1}, "gpus": {1: {"pstate": 8}}}, seconds=25
    )
    assert health(series, "0", "performance_state") == 0
    assert health(series, "1", "performance_state") == 1


def test_data_starvation_warns_only_with_a_job_running(health_run):
    series = health_run("data-starvation", seconds=15)
    assert set(values(series, "gpuwarden_health", check="utilization")) == {1}
    idle = health_run("healthy", seconds=15)  # idle and no process: not starvation
    assert set(values(idle, "gpuwarden_health", check="utilization")) == {0}


def test_thermal_throttling(health_run):
    series = health_run("thermal-throttling", seconds=15)
    assert health(series, "2", "temperature") == 2
    assert health(series, "2", "thermal_throttling") == 1
    assert health(series, "0", "temperature") == 0 and health(series, "0", "thermal_throttling") == 0
    assert values(series, "gpuwarden_health_status", gpu="5") == [2]


def test_power_capping(health_run):
    series = health_run("power-capping", seconds=12)
    assert set(values(series, "gpuwarden_health", check="power")) == {1}


def test_memory_nearly_full(health_run):
    series = health_run("memory-nearly-full", seconds=6)
    assert health(series, "3", "memory_pressure") == 1  # 99 %: a warning at once, as the alert (it said critical)
    assert health(series, "6", "memory_pressure") == 1
    assert health(series, "0", "memory_pressure") == 0


def test_uncorrectable_ecc_and_pending_remap(health_run):
    series = health_run("ecc-uncorrectable", seconds=8)
    assert health(series, "1", "ecc") == 2
    assert health(series, "1", "row_remap") == 1
    assert health(series, "0", "ecc") == 0


def test_row_remap_pending_and_failed(health_run):
    series = health_run("row-remap", seconds=2)
    assert health(series, "2", "row_remap") == 1
    assert health(series, "5", "row_remap") == 2


def test_nvlink_down_after_being_up(health_run):
    series = health_run("nvlink-down", seconds=12)
    assert health(series, "4", "nvlink") == 2
    assert health(series, "0", "nvlink") == 0


def test_gpu_lost(health_run):
    series = health_run("gpu-lost", seconds=10)
    assert health(series, "6", "gpu_lost") == 2
    assert values(series, "gpuwarden_health_status", gpu="6") == [2]
    assert health(series, "0", "gpu_lost") == 0


def test_persistence_off(health_run):
    series = health_run("persistence-off", seconds=8)
    assert set(values(series, "gpuwarden_health", check="persistence_mode")) == {1}


def test_retired_pages_pending_on_a_legacy_board(health_run):
    series = health_run("legacy-pcie", seconds=3)
    assert health(series, "1", "row_remap") == 1
    assert health(series, "0", "row_remap") == 0


def test_critical_xid_within_the_window(sim, tmp_path):
    clock = ManualClock()
    sim({"node": {"count": 2}}, clock=clock)
    pipeline = Pipeline(settings(), wall_clock=clock)
    pipeline.poll_once()
    uuid = pipeline.snapshot.gpus[1].uuid
    pipeline.poller.xid.record(uuid, 79, clock())
    pipeline.poller.xid.record(pipeline.snapshot.gpus[0].uuid, 13, clock())  # application XID: never a verdict
    pipeline.poll_once()
    series = series_of(pipeline.snapshot)
    assert health(series, "1", "xid") == 2 and health(series, "0", "xid") == 0
    clock.advance(601)
    pipeline.poll_once()
    series = series_of(pipeline.snapshot)
    assert health(series, "1", "xid") == 0


def test_bad_thresholds_file_is_one_line(tmp_path):
    with pytest.raises(ConfigError, match="unknown key 'temprature_warning_celsius'"):
        load_thresholds(write_yaml(tmp_path / "t.yaml", {"temprature_warning_celsius": 80}))
    with pytest.raises(ConfigError, match="must not share an XID"):
        load_thresholds(write_yaml(tmp_path / "t.yaml", {"xid_warning": [79]}))
    with pytest.raises(ConfigError, match="temperature_critical_celsius must be above"):
        load_thresholds(write_yaml(tmp_path / "t.yaml", {"temperature_critical_celsius": 80}))


def test_each_threshold_is_declared_with_its_type_bounds_and_words(tmp_path):
    """The fields come from health/thresholds.toml: a file's value out of the declared bounds is refused in one
    line, a string of the declared type is converted, and every field says what it means (its help text)."""
    import tomllib

    from gpuwarden.health.thresholds import FIELDS_FILE, Thresholds

    declared = tomllib.loads(FIELDS_FILE.read_text(encoding="utf-8"))
    assert [field.name for field in dataclasses.fields(Thresholds)] == list(declared)
    assert all(field.metadata["description"].endswith(".") for field in dataclasses.fields(Thresholds))
    path = write_yaml(tmp_path / "t.yaml", {"collective_window_s": 601})
    line = f"thresholds file {path}: collective_window_s: Input should be less than or equal to 600 (got 601)"
    with pytest.raises(ConfigError) as refused:
        load_thresholds(path)
    assert str(refused.value) == line
    loaded = load_thresholds(write_yaml(tmp_path / "t.yaml", {"xid_info": ["63", 92], "pcie_replays_per_minute": "9"}))
    assert loaded.xid_info == (63, 92) and loaded.pcie_replays_per_minute == 9.0
    with pytest.raises(dataclasses.FrozenInstanceError):
        loaded.xid_info = ()


def test_history_stays_bounded_at_fast_polling():
    """0.1 s polls keep one point per spacing, not one per poll (found by the soak run over an hour at the defaults;
    here the windows are capped at 2 minutes and the run is 1,500 polls, more than the bound, instead of 36,000)."""
    from gpuwarden.health.evaluator import HealthEvaluator
    from gpuwarden.health.thresholds import DEFAULT
    from gpuwarden.model.snapshot import GpuInfo, GpuSnapshot, Sample

    windows = {
        field.name: min(getattr(DEFAULT, field.name), 120)
        for field in dataclasses.fields(DEFAULT)
        if field.name.endswith(("_for_s", "_window_s"))
    }
    thresholds = dataclasses.replace(DEFAULT, **windows)
    evaluator = HealthEvaluator(thresholds)
    spacing, keep = evaluator.history_shape()
    polls = 1_500
    assert polls > keep / spacing + 2, "one point per poll would fit the bound: the run would not catch it"
    for step in range(polls):
        now = 1000.0 + step * 0.1
        samples = (
            Sample("gpuwarden_busy_seconds_total", (), step * 0.05),
            Sample("gpuwarden_utilization_sampled_seconds_total", (), step * 0.1),
            Sample("gpuwarden_temperature_celsius", (), 60.0),
        )
        gpu = GpuSnapshot(0, "G0", True, False, None, None, GpuInfo(name="NVIDIA H100 80GB HBM3"), samples, {})
        evaluator.evaluate([gpu], {}, now)
    history = evaluator._history["G0"]
    assert len(history.points) <= history.keep / history.spacing + 2
    assert all(key[0] != "gpuwarden_temperature_celsius" for key in history.latest)
    busy = history.ratio(
        ("gpuwarden_busy_seconds_total", ()),
        ("gpuwarden_utilization_sampled_seconds_total", ()),
        now,
        thresholds.utilization_for_s,
    )
    assert busy == pytest.approx(0.5)


@pytest.mark.slow  # a long fault run
def test_nvlink_replay_errors_warn_naming_the_link(health_run):
    series = health_run(
        {
            "node": {"count": 2},
            "faults": [
                {"kind": "nvlink_errors", "gpu": 1, "link": 9, "type": "replay", "at": 20, "every": 1, "count": 2}
            ],
        },
        seconds=930,
        poll=NVLINK_ERRORS_EVERY_POLL,  # the counters must grow between polls
        step=5,  # the replay rate is judged over 15 minutes of the history: a point every 5 s is plenty
    )
    assert health(series, "1", "nvlink") == 1 and health(series, "0", "nvlink") == 0


def test_health_since_marks_when_the_verdict_began_and_holds(sim, tmp_path):
    clock = ManualClock()
    sim("nvlink-down", clock=clock)
    path = write_yaml(tmp_path / "thresholds.yaml", SHORT)
    pipeline = Pipeline(settings(health={"thresholds_file": str(path)}), wall_clock=clock)
    first_bad = None
    for _ in range(20):
        pipeline.poll_once()
        if first_bad is None and any(
            v.level for v in pipeline.snapshot.health[pipeline.snapshot.gpus[4].uuid] if v.check == "nvlink"
        ):
            first_bad = clock()
        clock.advance(1)
    pipeline.poll_once()
    series = series_of(pipeline.snapshot)
    assert first_bad is not None
    assert values(series, "gpuwarden_health_since_timestamp_seconds", gpu="4", check="nvlink") == [first_bad]
    assert not values(series, "gpuwarden_health_since_timestamp_seconds", gpu="0")  # ok checks carry none
    pipeline.stop(timeout=0.2)


def test_health_since_restarts_when_the_level_changes():
    from gpuwarden.health.evaluator import HealthEvaluator
    from gpuwarden.health.thresholds import DEFAULT
    from gpuwarden.model.snapshot import Verdict

    evaluator = HealthEvaluator(DEFAULT)
    warn, crit, ok = (Verdict("temperature", level, "", "", "") for level in (1, 2, 0))
    assert evaluator._stamp({"GPU-a": (warn,)}, 100.0)["GPU-a"][0].since == 100.0
    assert evaluator._stamp({"GPU-a": (warn,)}, 160.0)["GPU-a"][0].since == 100.0
    assert evaluator._stamp({"GPU-a": (crit,)}, 220.0)["GPU-a"][0].since == 220.0
    assert evaluator._stamp({"GPU-a": (ok,)}, 280.0)["GPU-a"][0].since == 0.0
    assert evaluator._stamp({"GPU-a": (warn,)}, 340.0)["GPU-a"][0].since == 340.0
    evaluator._stamp({}, 400.0)
    assert evaluator._began == {}  # forgotten with the GPU
