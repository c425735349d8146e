"""The health evaluator's state file (exporter/gpuwarden/health/state_file.py): what a restart must not forget.

In process, on the real pipeline over the simulator with a hand-moved wall clock (the thermal-throttling scenario:
GPUs 2 and 5 at 91-93 °C, critical after temperature_critical_for_s = 120 s at the default thresholds): a restart
with the file is critical at its first reading; without it, or after too long a gap, pending. Then the file itself:
corrupt, truncated, of another version, too large, writable by others, of another boot, naming a GPU that is gone,
a writer killed in the middle of a write, two writers at once, a path that cannot be written. Nothing is mocked:
the crash is a real SIGKILL of a child process inside the real write."""

from __future__ import annotations

import json
import logging
import multiprocessing
import os
import signal
from pathlib import Path

import pytest

from gpuwarden.health import state_file
from gpuwarden.health.state_file import GpuMemory, StateKeeper
from gpuwarden.runtime.pipeline import Pipeline
from tests.helpers.common import ManualClock, settings, wait_for

HOT = 2  # a GPU of the thermal-throttling scenario at 92 °C


def run_exporter(sim, clock: ManualClock, path: Path, seconds: int, **health) -> Pipeline:  # noqa: ANN001
    """A pipeline over the thermal-throttling scenario with `path` as its state file, polled every 5 s of the clock
    for `seconds`, then stopped as a process stops (its last memory written)."""
    sim("thermal-throttling", clock=clock)
    pipeline = Pipeline(settings(health={"state_file": str(path), **health}), wall_clock=clock)
    for _ in range(seconds // 5):
        pipeline.poll_once()
        clock.advance(5)
    pipeline.stop(timeout=5)
    return pipeline


def temperature_after_restart(sim, clock: ManualClock, path: Path, **health):  # noqa: ANN001, ANN201
    """The hot GPU's temperature verdict at the first reading of a new pipeline (the restart)."""
    sim("thermal-throttling", clock=clock)
    pipeline = Pipeline(settings(health={"state_file": str(path), **health}), wall_clock=clock)
    try:
        snapshot = pipeline.poll_once()
        uuid = snapshot.gpus[HOT].uuid
        return next(v for v in snapshot.health[uuid] if v.check == "temperature")
    finally:
        pipeline.stop(timeout=5)


def test_a_condition_held_before_the_restart_is_critical_at_the_first_reading_after_it(sim, tmp_path: Path) -> None:  # noqa: ANN001
    clock, path = ManualClock(), tmp_path / "state.json"
    before = run_exporter(sim, clock, path, 150)
    uuid = before.snapshot.gpus[HOT].uuid
    critical = next(v for v in before.snapshot.health[uuid] if v.check == "temperature")
    assert critical.level == 2, critical
    document = json.loads(path.read_text())
    assert document["version"] == 1 and document["written_at"] == clock.now
    assert "temp_critical" in document["gpus"][uuid]["held"], document
    assert len(path.read_bytes()) < 8 * 1024  # 8 GPUs, two of them hot: a few KB
    clock.advance(60)  # the exporter down a minute (a pod replaced)
    verdict = temperature_after_restart(sim, clock, path)
    assert (verdict.level, verdict.severity) == (2, "critical"), verdict
    assert verdict.since == critical.since  # the same incident: its start is kept


def test_without_the_file_or_after_too_long_a_gap_the_window_starts_again(sim, tmp_path: Path, caplog) -> None:  # noqa: ANN001
    clock, path = ManualClock(), tmp_path / "state.json"
    run_exporter(sim, clock, path, 150)
    clock.advance(301)  # longer than health.state_max_gap (300 s)
    with caplog.at_level(logging.INFO, logger="gpuwarden.health.state_file"):
        verdict = temperature_after_restart(sim, clock, path)
    assert (verdict.level, verdict.severity, verdict.pending_level) == (0, "pending", 2), verdict
    assert "seen for 0 s of 120 s" in verdict.observed
    assert any("state_max_gap" in r.message for r in caplog.records)
    # a shorter bound is a setting
    run_exporter(sim, clock, path, 150)
    clock.advance(20)
    assert temperature_after_restart(sim, clock, path, state_max_gap=10).severity == "pending"
    # no file at all: pending, and the start says so once
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="gpuwarden.health.state_file"):
        verdict = temperature_after_restart(sim, clock, tmp_path / "none" / "state.json")
    assert verdict.severity == "pending"
    assert len([r for r in caplog.records if "none yet" in r.message]) == 1


def valid_file(path: Path, written_at: float = 1000.0, boot: str | None = None) -> bytes:
    memory = {"GPU-1": GpuMemory({"temp_critical": 800.0}, {"temperature": (2, 920.0)}, frozenset({"0", "1"}))}
    data = state_file.encode(memory, written_at, state_file.boot_id() if boot is None else boot)
    state_file.write(path, data)
    return data


def _edited(change):  # noqa: ANN001, ANN202 - a change to the parsed document
    def damage(data: bytes) -> bytes:
        document = json.loads(data)
        change(document)
        return json.dumps(document).encode()

    return damage


BROKEN = {
    "corrupt": lambda data: b"\x00\xffnot json at all",
    "truncated": lambda data: data[: len(data) // 2],
    "empty": lambda data: b"",
    "deeply nested": lambda data: b"[" * 100_000,
    "not an object": lambda data: b"[1, 2, 3]",
    "too large": lambda data: data[:-1] + b',"pad":"' + b"x" * state_file.MAX_STATE_BYTES + b'"}',
    "another version": _edited(lambda d: d.update(version=2)),
    "version as text": _edited(lambda d: d.update(version="1")),
    "no version": _edited(lambda d: d.pop("version")),
    "gpus not a mapping": _edited(lambda d: d.update(gpus=list(d["gpus"].values()))),
    "a GPU not a mapping": _edited(lambda d: d["gpus"].update({"GPU-1": [1]})),
    "written_at not a time": _edited(lambda d: d.update(written_at="yesterday")),
    "another boot": _edited(lambda d: d.update(boot_id="another-boot")),
}


@pytest.mark.parametrize("damage", sorted(BROKEN))
def test_a_file_that_cannot_be_trusted_is_ignored_with_one_line_never_a_crash(
    damage: str, tmp_path: Path, caplog
) -> None:  # noqa: ANN001
    path = tmp_path / "state.json"
    data = valid_file(path)
    assert state_file.read(path, 1010.0, 300, state_file.boot_id())["GPU-1"].held == {"temp_critical": 800.0}
    path.write_bytes(BROKEN[damage](data))
    path.chmod(0o600)
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="gpuwarden.health.state_file"):
        assert state_file.read(path, 1010.0, 300, state_file.boot_id()) == {}
    (line,) = caplog.records
    assert str(path) in line.message and "ignored" in line.message and "\n" not in line.message


def test_a_file_others_can_write_is_ignored(tmp_path: Path, caplog) -> None:  # noqa: ANN001
    """Anyone who can write the file could make a condition skip its window: only the exporter's own counts."""
    path = tmp_path / "state.json"
    valid_file(path)
    path.chmod(0o666)
    with caplog.at_level(logging.WARNING, logger="gpuwarden.health.state_file"):
        assert state_file.read(path, 1010.0, 300, state_file.boot_id()) == {}
    assert "another user" in caplog.text


def test_entries_that_could_not_have_been_seen_are_dropped_and_links_outlive_the_gap(tmp_path: Path) -> None:
    path = tmp_path / "state.json"
    document = {
        "version": 1,
        "written_at": 1000.0,
        "boot_id": "b",
        "gpus": {
            "GPU-1": {
                "held": {"temp_critical": 999.0, "later": 1500.0, "nan": "NaN", "": 5.0},
                "levels": {"temperature": [2, 990.0], "bad": [7, 990.0], "bool": [True, 990.0], "x": [2]},
                "links_up": ["0", 1, "3"],
            },
            "GPU-2\n": {"held": {"temp_critical": 10.0}},
        },
    }
    state_file.write(path, json.dumps(document).encode())
    memory = state_file.read(path, 1100.0, 300, "b")
    assert memory == {"GPU-1": GpuMemory({"temp_critical": 999.0}, {"temperature": (2, 990.0)}, frozenset({"0", "3"}))}
    # the exporter down longer than the bound: conditions and levels forgotten, the links seen up this boot kept
    assert state_file.read(path, 1400.0, 300, "b") == {"GPU-1": GpuMemory({}, {}, frozenset({"0", "3"}))}
    assert state_file.read(path, 900.0, 300, "b") == {"GPU-1": GpuMemory({}, {}, frozenset({"0", "3"}))}  # clock


def test_a_gpu_that_is_gone_is_forgotten_at_the_next_write(sim, tmp_path: Path) -> None:  # noqa: ANN001
    clock, path = ManualClock(), tmp_path / "state.json"
    memory = {
        "GPU-gone": GpuMemory({"temp_critical": clock.now - 500}, {"temperature": (2, clock.now - 400)}, frozenset())
    }
    state_file.write(path, state_file.encode(memory, clock.now, state_file.boot_id()))
    path.chmod(0o600)
    clock.advance(10)
    run_exporter(sim, clock, path, 10)
    gpus = json.loads(path.read_text())["gpus"]
    assert "GPU-gone" not in gpus and gpus  # the scenario's own GPUs are there


def _killed_inside_the_write(path: str) -> None:
    """A writer that dies (SIGKILL, as the OOM killer kills) after its data is in the temporary file, before the
    rename: the real write, with fsync replaced by the kill."""
    os.fsync = lambda fd: os.kill(os.getpid(), signal.SIGKILL)
    state_file.write(Path(path), state_file.encode({}, 2000.0, state_file.boot_id()))


def test_a_writer_killed_in_the_middle_of_a_write_leaves_the_last_complete_file(tmp_path: Path) -> None:
    path = tmp_path / "state.json"
    valid_file(path)
    before = path.read_bytes()
    child = multiprocessing.get_context("fork").Process(target=_killed_inside_the_write, args=(str(path),))
    child.start()
    child.join(30)
    assert child.exitcode == -signal.SIGKILL
    assert path.read_bytes() == before
    (leftover,) = tmp_path.glob(".state.json.*.tmp")  # what the killed write left
    assert state_file.read(path, 1010.0, 300, state_file.boot_id())["GPU-1"].held == {"temp_critical": 800.0}
    assert leftover.exists()  # a minute old at most: perhaps another process's write in flight, left alone
    stale = leftover.stat().st_mtime - state_file.LEFTOVER_AGE_S - 1
    os.utime(leftover, (stale, stale))
    state_file.read(path, 1010.0, 300, state_file.boot_id())
    assert not leftover.exists()  # older: a crash's, removed at the next start


def _write_many(path: str, written_at: float, times: int) -> None:
    memory = {f"GPU-{written_at:.0f}": GpuMemory({"temp_critical": written_at - 1}, {}, frozenset())}
    data = state_file.encode(memory, written_at, "b")
    for _ in range(times):
        state_file.write(Path(path), data)


def test_two_writers_at_once_never_leave_a_mixed_file(tmp_path: Path) -> None:
    """Two exporters given one file by mistake: each write is whole, the last one wins, a reader never sees a mix."""
    path = tmp_path / "state.json"
    _write_many(str(path), 1000.0, 1)
    context = multiprocessing.get_context("fork")
    writers = [context.Process(target=_write_many, args=(str(path), at, 150)) for at in (1000.0, 2000.0)]
    for writer in writers:
        writer.start()
    seen = set()
    while any(writer.is_alive() for writer in writers):
        memory = state_file.read(path, 2000.0, 5000, "b")
        assert len(memory) == 1, memory  # one whole file or the other, never {} (unreadable) nor both
        seen |= set(memory)
    for writer in writers:
        writer.join(30)
        assert writer.exitcode == 0
    assert seen <= {"GPU-1000", "GPU-2000"}


def test_the_keeper_writes_on_change_and_while_anything_is_held_every_heartbeat(tmp_path: Path) -> None:
    path = tmp_path / "state.json"
    keeper = StateKeeper(path, "b", heartbeat_s=15)
    hot = {"GPU-1": GpuMemory({"temp_critical": 90.0}, {}, frozenset())}

    def written_at() -> float | None:
        try:
            return json.loads(path.read_text())["written_at"]
        except (OSError, ValueError):
            return None

    keeper.offer(hot, 100.0)
    wait_for(lambda: written_at() == 100.0)
    keeper.offer(dict(hot), 110.0)  # unchanged, inside the heartbeat: not written
    keeper.offer({"GPU-1": GpuMemory({"temp_critical": 90.0}, {"temperature": (2, 110.0)}, frozenset())}, 111.0)
    wait_for(lambda: written_at() == 111.0)  # changed: written at once
    keeper.offer({"GPU-1": GpuMemory({"temp_critical": 90.0}, {"temperature": (2, 110.0)}, frozenset())}, 126.0)
    wait_for(lambda: written_at() == 126.0)  # held, the last write 15 s old: written again
    idle = {"GPU-1": GpuMemory({}, {}, frozenset({"0"}))}
    keeper.offer(idle, 130.0)
    wait_for(lambda: written_at() == 130.0)
    keeper.offer(idle, 500.0)  # nothing held: no heartbeat
    keeper.close(idle, 600.0)  # a clean stop writes once more
    assert written_at() == 600.0


def test_a_state_file_that_cannot_be_written_is_said_once_and_nothing_else_changes(sim, tmp_path: Path, caplog) -> None:  # noqa: ANN001
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    path = blocker / "state.json"  # its directory is a file: not writable, even by root
    clock = ManualClock()
    with caplog.at_level(logging.WARNING, logger="gpuwarden.health.state_file"):
        pipeline = run_exporter(sim, clock, path, 150)
    uuid = pipeline.snapshot.gpus[HOT].uuid
    assert next(v for v in pipeline.snapshot.health[uuid] if v.check == "temperature").level == 2
    lines = [r.message for r in caplog.records if "cannot write" in r.message]
    assert len(lines) == 1 and str(path) in lines[0] and "health.state_file" in lines[0], caplog.text


@pytest.mark.parametrize(("value", "message"), [("relative/state.json", "absolute path"), ("", "absolute path")])
def test_a_bad_state_file_setting_is_one_line_naming_it(value: str, message: str) -> None:
    from gpuwarden.commandline import ConfigError

    with pytest.raises(ConfigError) as raised:
        settings(health={"state_file": value})
    assert "health.state_file" in str(raised.value) and message in str(raised.value)
    assert "\n" not in str(raised.value)


def test_auto_is_the_host_path_with_the_real_driver_and_none_with_the_simulator() -> None:
    assert settings(nvml={"backend": "nvml"}).health.state_path("nvml") == Path("/var/lib/gpuwarden/state.json")
    assert settings().health.state_path("sim") is None
    assert settings(health={"state_file": "off"}).health.state_path("nvml") is None
    assert settings(health={"state_file": "/x/s.json"}).health.state_path("sim") == Path("/x/s.json")
