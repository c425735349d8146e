"""exporter/gpuwarden/workers.py: a worker idle past its idle time ends and its key gets a new thread on the
next job; a worker inside a job (a wedged NVML call) never ends, and its key accepts nothing until the job returns."""

from __future__ import annotations

import threading
import time

from gpuwarden.workers import WorkerPool, run_with_deadline
from tests.helpers.common import wait_for


def _alive(name: str) -> int:
    return sum(1 for thread in threading.enumerate() if thread.name == name)


def test_an_idle_worker_ends_and_its_key_starts_a_new_one():
    pool = WorkerPool(idle_exit_s=0.2)
    assert run_with_deadline(pool, "once", lambda: 41 + 1, 2.0) == (True, 42)
    wait_for(lambda: _alive("gpuwarden-once") == 0, timeout=5)
    assert pool.thread_id("once") is None
    assert run_with_deadline(pool, "once", lambda: threading.get_ident(), 2.0) == (True, pool.thread_id("once"))
    assert _alive("gpuwarden-once") == 1  # a new thread (an ended thread's identifier may be reused)
    pool.stop()


def test_a_worker_inside_a_wedged_call_never_ends_and_takes_no_second_job():
    pool = WorkerPool(idle_exit_s=0.1)
    release = threading.Event()
    assert run_with_deadline(pool, "wedged", release.wait, 0.1) == (False, None)
    time.sleep(0.5)  # well past the idle time
    assert _alive("gpuwarden-wedged") == 1 and pool.busy() == ["wedged"]
    assert run_with_deadline(pool, "wedged", lambda: 1, 0.1) == (False, None)  # nothing queued behind the hang
    release.set()
    wait_for(lambda: not pool.busy(), timeout=5)
    assert run_with_deadline(pool, "wedged", lambda: 2, 2.0) == (True, 2)
    pool.stop()


def test_a_worker_used_more_often_than_its_idle_time_keeps_its_thread():
    pool = WorkerPool(idle_exit_s=0.3)
    idents = {run_with_deadline(pool, "fast", threading.get_ident, 2.0)[1] for _ in range(10) if not time.sleep(0.05)}
    assert len(idents) == 1
    pool.stop()


def test_a_gpu_forgotten_while_its_read_is_awaited_gets_no_outcome_and_no_error():
    """The slow loop forgets a GPU it found lost while the fast loop waits on that GPU's read (seen under load: a
    KeyError failed the fast cycle). The late answer is not used, and the runner keeps working for the others."""
    from gpuwarden.collect.tiers import Read, TierRunner
    from gpuwarden.model.snapshot import Tier, TierReading
    from gpuwarden.nvml.device import ErrorLedger, GpuDevice

    ledger = ErrorLedger()
    lost, healthy = GpuDevice(0, "GPU-lost", None, ledger), GpuDevice(1, "GPU-ok", None, ledger)
    runner = TierRunner(WorkerPool(), lambda: {Tier.FAST: [], Tier.SLOW: [], Tier.STATIC: []}, lambda _: 1.0)

    def job(dev: GpuDevice) -> TierReading:
        if dev is lost:
            runner.forget(dev.uuid)  # what the other loop does, here at a known point
        return TierReading((), {}, 0.0)

    outcomes = runner.run(Tier.FAST, [lost, healthy], wait=30.0, deadline=60.0, job=job)
    assert set(outcomes) == {"GPU-ok"} and isinstance(outcomes["GPU-ok"], Read)
    again = runner.run(Tier.FAST, [lost, healthy], wait=30.0, deadline=60.0, job=lambda dev: TierReading((), {}, 0.0))
    assert set(again) == {"GPU-lost", "GPU-ok"}
