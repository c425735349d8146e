"""What a GPU process is doing on the host while its GPU waits: its threads' states and its worker children's.

The GPU's counters cannot tell an input pipeline from a checkpoint write or a rank waiting on its peers (low GPU
activity is not always data starvation). The host's /proc can, cheaply: a thread in D state waits on I/O; a main
thread that is always running is a Python loop the GPU waits on; worker children (DataLoader) that are always
running are an input pipeline at its limit; every thread asleep is a process waiting on something else (peers,
the network); bytes written to storage at a high rate are a checkpoint. Sampled only for GPUs whose bottleneck
class is `waiting` or whose job has peers (jobs/evidence.py), every SAMPLE_EVERY_S, over the largest
holder of the GPU's memory; reads are bounded (MAX_THREADS threads, MAX_WORKERS children).
"""

from __future__ import annotations

import math
import os
from array import array
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from gpuwarden.model.snapshot import HostEvidence

SAMPLE_EVERY_S = 2.0
SAMPLES_KEPT = 60  # two minutes of samples at that pace
MAX_THREADS = 256  # task stat files read per sample, the main thread's included
MAX_WORKERS = 64
RELIST_S = 30.0  # a process's threads are listed again at most this often (new threads are seen after this)
IO_THREADS = 4096  # /proc/PID/io is read every sample up to this many threads, every n-th sample at n times as many


@dataclass(frozen=True)
class ThreadSample:
    """One look at a process: its main thread's state, and how many of its threads and worker children run or
    wait on I/O."""

    main_running: bool
    disk_wait: int  # threads of the process in D state
    running: int  # threads of the process in R state
    workers: int
    workers_running: int
    # /proc/PID/io write_bytes (to storage; None where it cannot be read, or was not this sample: IO_THREADS)
    write_bytes: int | None = None
    at: float = 0.0
    threads_read: int = 0  # task stat files read (the main thread's and the picked ones that were still there)


def _state(stat: str) -> str:
    """The state letter of a /proc stat line ("PID (comm) S ..."; comm may hold spaces and parentheses)."""
    rest = stat.rpartition(")")[2].split()
    return rest[0] if rest else "?"


def _read(path: Path | str) -> str:
    """Up to 4 KiB of a /proc file ("" where it cannot be read); os-level calls on a string path: a sample reads up
    to MAX_THREADS of them, and pathlib's objects tripled the cost of each."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return ""
    try:
        return os.read(fd, 4096).decode("ascii", "replace")
    except OSError:
        return ""
    finally:
        os.close(fd)


def _write_bytes(text: str) -> int | None:
    """write_bytes from a /proc/PID/io text (readable with the same UID or CAP_SYS_PTRACE; None otherwise)."""
    for line in text.splitlines():
        name, _, value = line.partition(":")
        if name == "write_bytes" and value.strip().isdigit():
            return int(value.strip())
    return None


def pick_threads(tids: Sequence[int], pid: int, turn: int, limit: int = MAX_THREADS) -> list[int]:
    """The threads to read this sample: the main thread first, then up to `limit - 1` of `tids` (sorted numerically)
    in a stride that starts `turn` places further each sample. O(limit), whatever the number of threads."""
    room = max(limit - 1, 0)
    step = max(1, math.ceil(len(tids) / room)) if room else len(tids) + 1
    picked = [pid]
    for index in range(turn % step, len(tids), step):
        if tids[index] != pid and len(picked) <= room:
            picked.append(tids[index])
    return picked


def list_threads(proc_root: Path, pid: int) -> array[int] | None:
    """The TIDs of `pid` in numeric order, or None where the host's /proc does not show it."""
    try:
        names = os.listdir(proc_root / str(pid) / "task")
    except OSError:
        return None
    return array("i", sorted(int(name) for name in names if name.isdigit()))


class ThreadLists:
    """Each sampled process's TIDs as last listed, and its sample count (the stride's turn). `for_sample` never
    lists: it hands a listing to `submit` (the host's lookup thread) when the list is missing or older than
    RELIST_S, and answers with what it has (at first nothing: the main thread alone is read)."""

    def __init__(self, proc_root: Path, submit: Callable[[str, Callable[[], None]], None]) -> None:
        self._proc_root, self._submit = proc_root, submit
        self._lists: dict[int, tuple[float, array[int]]] = {}  # PID → (when listed, its TIDs)
        self._asked: dict[int, float] = {}  # PID → when a listing was last asked for
        self._turns: dict[int, int] = {}  # PID → samples taken

    def for_sample(self, pid: int, now: float) -> tuple[Sequence[int], int]:
        """(the TIDs to pick from, the turn) for a sample of `pid` at `now`."""
        turn = self._turns.get(pid, 0)
        self._turns[pid] = turn + 1
        listed_at, tids = self._lists.get(pid, (float("-inf"), array("i")))
        if now - listed_at >= RELIST_S and now - self._asked.get(pid, float("-inf")) >= RELIST_S:
            self._asked[pid] = now

            def relist() -> None:
                found = list_threads(self._proc_root, pid)
                if found is not None:
                    self._lists[pid] = (now, found)

            self._submit(f"threads {pid}", relist)
        return tids, turn

    def retain(self, pids: set[int]) -> None:
        """Forget the processes no longer sampled."""
        self._lists = {pid: entry for pid, entry in self._lists.items() if pid in pids}
        self._asked = {pid: at for pid, at in self._asked.items() if pid in pids}
        self._turns = {pid: turn for pid, turn in self._turns.items() if pid in pids}


def sample(proc_root: Path, pid: int, at: float = 0.0, tids: Sequence[int] = (), turn: int = 0) -> ThreadSample | None:
    """One look at `pid` under `proc_root` at time `at`: its main thread and the threads `pick_threads` chooses from
    `tids` for this `turn`; None where the host's /proc does not show it."""
    base = f"{proc_root}/{pid}"
    main = _read(f"{base}/task/{pid}/stat")
    if not main:
        return None
    states = [_state(main)]
    for tid in pick_threads(tids, pid, turn)[1:]:
        stat = _read(f"{base}/task/{tid}/stat")
        if stat:  # a thread that has ended since the listing
            states.append(_state(stat))
    children = _read(f"{base}/task/{pid}/children").split()[:MAX_WORKERS]
    worker_states = [_state(_read(f"{proc_root}/{child}/stat")) for child in children if child.isdigit()]
    # /proc/PID/io sums every thread's counters (~15 ms at 30,000 threads): read every `io_every` samples, so that
    # its cost per sample stays that of IO_THREADS threads (a cumulative counter: the rate loses nothing but detail)
    io_every = max(1, len(tids) // IO_THREADS)
    return ThreadSample(
        main_running=states[0] == "R",
        disk_wait=states.count("D"),
        running=states.count("R"),
        workers=len(worker_states),
        workers_running=worker_states.count("R"),
        write_bytes=_write_bytes(_read(f"{base}/io")) if turn % io_every == 0 else None,
        at=at,
        threads_read=len(states),
    )


class ActivityTally:
    """The last SAMPLES_KEPT samples of one GPU's main holder, summed up as shares of the samples."""

    def __init__(self) -> None:
        self.samples: deque[ThreadSample] = deque(maxlen=SAMPLES_KEPT)
        self.sampled_at = float("-inf")

    def add(self, found: ThreadSample) -> None:
        self.samples.append(found)

    def evidence(self, pid: int, since: float = float("-inf")) -> HostEvidence:
        """Shares over the samples taken at or after `since` (all kept by default); a job's straggler is judged
        over the job view's window, so what its process did before the onset does not dilute the cause."""
        samples = [s for s in self.samples if s.at >= since] or list(self.samples)[-1:]
        n = len(samples) or 1
        return HostEvidence(
            pid=pid,
            samples=len(samples),
            main_running=sum(s.main_running for s in samples) / n,
            io_wait=sum(s.disk_wait > 0 for s in samples) / n,
            workers_running=sum(s.workers_running > 0 for s in samples) / n,
            asleep=sum(s.running == 0 and s.disk_wait == 0 and s.workers_running == 0 for s in samples) / n,
            workers=max((s.workers for s in samples), default=0),
            write_bytes_per_second=self._write_rate(samples),
        )

    @staticmethod
    def _write_rate(samples: list[ThreadSample]) -> float | None:
        """Bytes per second the process wrote to storage over the samples (a checkpoint writes GB in seconds)."""
        written = [s for s in samples if s.write_bytes is not None]
        if len(written) < 2 or written[-1].at <= written[0].at:
            return None
        return max(written[-1].write_bytes - written[0].write_bytes, 0) / (written[-1].at - written[0].at)  # type: ignore[operator]
