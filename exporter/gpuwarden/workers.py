"""Worker threads that let the poller abandon a hung NVML call without ever queueing work behind it.

A call stuck in the driver cannot be interrupted (docs/nvml.md, Hangs): it blocks only its own worker thread.
While a worker is busy it accepts no new job, so abandoned threads stay bounded to one per key. A worker idle for
IDLE_EXIT_S ends (the next job for its key starts a new one): the keys used once — NVML init, discovery, the
static reads, the topology probe — do not keep a thread, its stack and its malloc arena for the life of the process.
"""

from __future__ import annotations

import concurrent.futures
import queue
import threading
from collections.abc import Callable
from typing import Any

Job = Callable[[], Any]
IDLE_EXIT_S = 30.0


class Worker:
    """A daemon thread that runs one job at a time for one key (a GPU and tier, a discovery slot, NVML init)."""

    def __init__(
        self, name: str, retire: Callable[[Worker], bool] | None = None, idle_exit_s: float = IDLE_EXIT_S
    ) -> None:
        self._jobs: queue.SimpleQueue[tuple[Job | None, concurrent.futures.Future[Any] | None]] = queue.SimpleQueue()
        self.busy = False
        self._retire, self._idle_exit_s = retire, idle_exit_s
        self.thread = threading.Thread(target=self._run, name=name, daemon=True)
        self.thread.start()

    def submit(self, job: Job) -> concurrent.futures.Future[Any] | None:
        """Queue a job, or None while the previous one has not returned (never stack work on a hung call)."""
        if self.busy:
            return None
        self.busy = True
        future: concurrent.futures.Future[Any] = concurrent.futures.Future()
        self._jobs.put((job, future))
        return future

    def stop(self) -> None:
        """Let the thread end once it is idle (a thread stuck in a wedged call ends when the call returns)."""
        self._jobs.put((None, None))

    def idle(self) -> bool:
        return not self.busy and self._jobs.empty()

    def _run(self) -> None:
        while True:
            try:
                job, future = self._jobs.get(timeout=self._idle_exit_s if self._retire else None)
            except queue.Empty:
                if self._retire is not None and self._retire(self):
                    return
                continue
            if job is None or future is None:
                return
            try:
                future.set_result(job())
            except BaseException as exc:  # noqa: BLE001 - delivered to the caller through the future
                future.set_exception(exc)
            finally:
                self.busy = False


class WorkerPool:
    """Workers by key, created on first use and kept (a GPU's workers outlive its re-discovery)."""

    def __init__(self, idle_exit_s: float = IDLE_EXIT_S) -> None:
        self._workers: dict[str, Worker] = {}
        self._lock = threading.Lock()
        self._idle_exit_s = idle_exit_s

    def _worker(self, key: str) -> Worker:
        worker = self._workers.get(key)
        if worker is None:
            worker = self._workers[key] = Worker(f"gpuwarden-{key}", self._retire, self._idle_exit_s)
        return worker

    def worker(self, key: str) -> Worker:
        with self._lock:
            return self._worker(key)

    def _retire(self, worker: Worker) -> bool:
        """Called by an idle worker: True (and forgotten) when nothing was handed to it meanwhile."""
        with self._lock:
            if not worker.idle():
                return False
            for key, known in list(self._workers.items()):
                if known is worker:
                    del self._workers[key]
            return True

    def submit(self, key: str, job: Job) -> concurrent.futures.Future[Any] | None:
        with self._lock:  # under the lock: a worker cannot retire between being chosen and being given the job
            return self._worker(key).submit(job)

    def busy(self, prefix: str = "") -> list[str]:
        """Keys of the workers still inside a job (a wedged call, or one being waited on)."""
        with self._lock:
            return [key for key, worker in self._workers.items() if worker.busy and key.startswith(prefix)]

    def workers(self, prefix: str = "") -> list[Worker]:
        with self._lock:
            return [worker for key, worker in self._workers.items() if key.startswith(prefix)]

    def thread_id(self, key: str) -> int | None:
        with self._lock:
            worker = self._workers.get(key)
        return None if worker is None else worker.thread.ident

    def stop(self) -> None:
        with self._lock:
            for worker in self._workers.values():
                worker.stop()


def run_with_deadline(
    pool: WorkerPool, key: str, job: Job, deadline: float, started: concurrent.futures.Future[Any] | None = None
) -> tuple[bool, Any]:
    """Run `job` on the key's worker and wait up to `deadline` s: (True, result) or (False, None) when it did not
    answer in time or the worker is still stuck in an earlier job. The job's exception is raised here.
    `started`: the same job already submitted on that key (started early); its answer is awaited instead."""
    future = started if started is not None else pool.submit(key, job)
    if future is None:
        return False, None
    try:
        return True, future.result(timeout=deadline)
    except concurrent.futures.TimeoutError:
        return False, None
