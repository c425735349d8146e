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

from collections import deque
from dataclasses import dataclass
from pathlib import Path

from gpuwarden.model.snapshot import HostEvidence

SAMPLE_EVERY_S = 2.0
SAMPLES_KEPT = 60  # two minutes of samples at that pace
MAX_THREADS = 512
MAX_WORKERS = 64


@dataclass(frozen=True)
class ThreadSample:
    """One look at a process: its main thread's state, and how many of its threads and worker children run or
    wait on I/O."""

    main_running: bool
    disk_wait: int  # threads of the process in D state
    running: int  # threads of the process in R state
    workers: int
    workers_running: int
    write_bytes: int | None = None  # /proc/PID/io write_bytes (to storage; None where it cannot be read)
    at: float = 0.0


def _state(stat: str) -> str:
    """The state letter of a /proc stat line ("PID (comm) S ..."; comm may hold spaces and parentheses)."""
    rest = stat.rpartition(")")[2].split()
    return rest[0] if rest else "?"


def _read(path: Path) -> str:
    try:
        with path.open("rb") as handle:
            return handle.read(4096).decode("ascii", "replace")
    except OSError:
        return ""


def _write_bytes(text: str) -> int | None:
    """write_bytes from a /proc/PID/io text (readable with the same UID or CAP_SYS_PTRACE; None otherwise)."""
    for line in text.splitlines():
        name, _, value = line.partition(":")
        if name == "write_bytes" and value.strip().isdigit():
            return int(value.strip())
    return None


def sample(proc_root: Path, pid: int, at: float = 0.0) -> ThreadSample | None:
    """One look at `pid` under `proc_root` at time `at`, or None where the host's /proc does not show it."""
    base = proc_root / str(pid)
    try:
        threads = sorted(base.joinpath("task").iterdir())[:MAX_THREADS]
    except OSError:
        return None
    states = [_state(_read(task / "stat")) for task in threads]
    main = _state(_read(base / "task" / str(pid) / "stat"))
    children = _read(base / "task" / str(pid) / "children").split()[:MAX_WORKERS]
    worker_states = [_state(_read(proc_root / child / "stat")) for child in children if child.isdigit()]
    return ThreadSample(
        main_running=main == "R",
        disk_wait=states.count("D"),
        running=states.count("R"),
        workers=len(worker_states),
        workers_running=worker_states.count("R"),
        write_bytes=_write_bytes(_read(base / "io")),
        at=at,
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
