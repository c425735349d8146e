"""What a waiting GPU's process does on the host, for a process with 30,000 threads (exporter/gpuwarden/attribution/
activity.py): the main thread every sample, a bounded stride of the rest that covers every thread in turn, the
listing of /proc/PID/task off the assembly. A host /proc built in a temporary folder (the host's own cannot be
staged with such a process here; bench/thread_heavy_evidence.py times a real one)."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from gpuwarden.attribution.host import BackgroundLookups
from gpuwarden.jobs import activity
from gpuwarden.jobs.evidence import HostEvidenceStep
from gpuwarden.model.draft import Draft
from gpuwarden.model.snapshot import ProcessView, Verdict

PID = 7000
THREADS = 30_000  # besides the main thread
IN_IO_WAIT = 3_000  # the numerically highest TIDs, in D state: what a lexicographic pick of the first few missed


@pytest.fixture(scope="module")
def heavy_proc(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """/proc with PID 7000: its main thread running, 30,000 more TIDs (7001-37000) asleep but the highest 3,000 in
    D state, one worker child."""
    root = tmp_path_factory.mktemp("heavy") / "proc"
    task = root / str(PID) / "task"
    task.mkdir(parents=True)
    (root / "self").mkdir()
    for tid in range(PID, PID + THREADS + 1):
        state = "R" if tid == PID else "D" if tid > PID + THREADS - IN_IO_WAIT else "S"
        (task / str(tid)).mkdir()
        (task / str(tid) / "stat").write_text(f"{tid} (python) {state} 1 2 3\n")
    (task / str(PID) / "children").write_text("9000 ")
    (root / "9000").mkdir()
    (root / "9000" / "stat").write_text("9000 (pt_data_worker) S 7000\n")
    (root / str(PID) / "io").write_text("write_bytes: 4096\n")
    return root


def test_each_sample_reads_the_main_thread_and_a_bounded_stride_that_covers_every_thread(heavy_proc: Path) -> None:
    tids = activity.list_threads(heavy_proc, PID)
    assert tids is not None and len(tids) == THREADS + 1 and list(tids) == sorted(tids)
    turns = math.ceil(len(tids) / (activity.MAX_THREADS - 1))
    seen: list[int] = []
    for turn in range(turns):
        picked = activity.pick_threads(tids, PID, turn)
        assert picked[0] == PID and len(picked) <= activity.MAX_THREADS
        seen += picked[1:]
    assert sorted(seen) == [tid for tid in tids if tid != PID]  # every other thread once over `turns` samples


def test_a_sample_of_a_thread_heavy_process_is_representative_and_bounded(heavy_proc: Path) -> None:
    """Every sample reads at most MAX_THREADS task files, the main thread's among them, and sees the threads in
    I/O wait in their proportion (a tenth), whichever turn it is."""
    tids = activity.list_threads(heavy_proc, PID)
    assert tids is not None
    for turn in (0, 1, 57, 117):
        found = activity.sample(heavy_proc, PID, 0.0, tids, turn)
        assert found is not None
        assert found.threads_read <= activity.MAX_THREADS
        assert found.main_running and found.workers == 1
        # /proc/PID/io sums every thread: read every 7th sample at 30,001 threads
        assert found.write_bytes == (4096 if turn % (len(tids) // activity.IO_THREADS) == 0 else None)
        share = found.disk_wait / (found.threads_read - 1)
        assert abs(share - IN_IO_WAIT / THREADS) < 0.02, (turn, found)


def test_the_listing_of_threads_runs_on_the_lookup_thread_and_again_only_after_relist_s(heavy_proc: Path) -> None:
    """The assembly's first sample of a process reads its main thread only; the listing it asked for runs on the
    lookup thread, and the next samples pick from it; it is listed again once RELIST_S has passed."""
    lookups = BackgroundLookups()
    asked: list[str] = []

    def submit(key: str, job) -> None:  # noqa: ANN001 - a lookup job
        asked.append(key)
        lookups.submit(key, job)

    lists = activity.ThreadLists(heavy_proc, submit)
    tids, turn = lists.for_sample(PID, 100.0)
    assert (len(tids), turn) == (0, 0) and asked == [f"threads {PID}"]
    assert activity.sample(heavy_proc, PID, 100.0, tids, turn).threads_read == 1  # type: ignore[union-attr]
    assert lookups.wait_idle(60)
    tids, turn = lists.for_sample(PID, 102.0)
    assert (len(tids), turn) == (THREADS + 1, 1) and len(asked) == 1
    lists.for_sample(PID, 100.0 + activity.RELIST_S)
    assert len(asked) == 2
    lists.retain(set())
    assert lists.for_sample(PID, 200.0) == (tids[:0], 0)  # forgotten: listed afresh, counted from the start


def _waiting_draft(at: float) -> Draft:
    """A draft at `at` in which GPU-0 is classed waiting, held by PID."""
    view = ProcessView(PID, "python", "compute", 1 << 30, 0.5, 0.1, 0.0, None, "", "", "", "")
    waiting = Verdict(check="bottleneck", level=0, severity="info", observed="", threshold="", detail="waiting")
    return Draft(
        taken_at=at, nvml_up=True, nvml_error=None, driver={}, gpus=(), xid={}, collect_errors={},
        collect_timeouts={}, reinit_total=0, tier_duration={}, tier_finished={}, health={"GPU-0": (waiting,)},
        processes={"GPU-0": (view,)},
    )  # fmt: skip


def test_the_evidence_step_samples_a_thread_heavy_process_within_its_bound(heavy_proc: Path) -> None:
    """Through the assembly's step: host evidence for the waiting GPU from samples of at most MAX_THREADS task
    files each, its main thread counted in every one."""
    lookups = BackgroundLookups()
    step = HostEvidenceStep(heavy_proc, submit=lookups.submit)
    for n in range(5):
        draft = _waiting_draft(1000.0 + n * activity.SAMPLE_EVERY_S)
        step(draft)
        assert lookups.wait_idle(60)
    evidence = draft.host_evidence["GPU-0"]
    assert evidence.samples == 5 and evidence.main_running == 1.0
    assert evidence.io_wait == 4 / 5  # every sample after the listing saw threads in D state; the first only the main
    tally = step._watched["GPU-0"].tally
    assert [s.threads_read for s in tally.samples] == [1] + [activity.MAX_THREADS] * 4
