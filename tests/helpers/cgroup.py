"""A memory cgroup at a given limit, as a kubelet enforces a pod's: the process under test is started inside it,
so everything it allocates counts, and going over the limit OOM-kills it (SIGKILL) as it would in a cluster.
cgroup v2 (memory.max) or v1 (memory.limit_in_bytes), whichever this host mounts writable. Where neither is (a
container without cgroup delegation), `PeakRss` stands in: nothing is killed, but the processes started in it are
judged by their peak resident memory (VmHWM) against the same limit, so the test still fails where the limit would
have been crossed."""

from __future__ import annotations

import contextlib
import os
import uuid
from collections.abc import Iterator
from pathlib import Path

V2 = Path("/sys/fs/cgroup")
V1 = Path("/sys/fs/cgroup/memory")


class MemoryCgroup:
    def __init__(self, path: Path, v2: bool) -> None:
        self.path, self.v2 = path, v2

    def enter(self) -> None:
        """Move the calling process in (a Popen's preexec_fn: the child joins before it execs)."""
        (self.path / "cgroup.procs").write_text(str(os.getpid()))

    def peak_mib(self) -> float:
        name = "memory.peak" if self.v2 else "memory.max_usage_in_bytes"
        try:
            return int((self.path / name).read_text()) / 2**20
        except (OSError, ValueError):
            return float("nan")

    def tcp_peak_mib(self) -> float:
        """Peak memory of the cgroup's TCP buffers where it is accounted apart (v1, with `tcp=True`); 0 under v2,
        which counts it in memory.peak."""
        if self.v2:
            return 0.0
        try:
            return int((self.path / "memory.kmem.tcp.max_usage_in_bytes").read_text()) / 2**20
        except (OSError, ValueError):
            return float("nan")

    def oom_kills(self) -> int:
        try:
            text = (self.path / ("memory.events" if self.v2 else "memory.oom_control")).read_text()
        except OSError:
            return 0
        for line in text.splitlines():
            if line.startswith("oom_kill "):
                return int(line.split()[1])
        return 0


class PeakRss:
    """The stand-in where no memory cgroup can be made: the processes that `enter` it are remembered, and crossing
    the limit with their summed peak RSS counts as an OOM kill."""

    def __init__(self, limit_mib: int, record: Path) -> None:
        self.limit_mib, self.record, self.v2, self.path = limit_mib, record, False, None

    def enter(self) -> None:
        with self.record.open("a") as out:
            out.write(f"{os.getpid()}\n")

    def peak_mib(self) -> float:
        total = 0.0
        for pid in self.record.read_text().split() if self.record.exists() else []:
            with contextlib.suppress(OSError, ValueError, IndexError):
                status = Path(f"/proc/{pid}/status").read_text()
                total += int(status.split("VmHWM:")[1].split()[0]) / 1024
        return total

    def tcp_peak_mib(self) -> float:
        return float("nan")

    def oom_kills(self) -> int:
        return int(self.peak_mib() > self.limit_mib)


@contextlib.contextmanager
def memory_cgroup(limit_mib: int, tcp: bool = False) -> Iterator[MemoryCgroup | PeakRss]:
    """`tcp`: under v1, account the cgroup's TCP buffers too (memory.kmem.tcp.*, apart from memory.usage: v2
    counts them in the one figure), limited to the same size."""
    name = f"gpuwarden-test-{uuid.uuid4().hex[:8]}"
    v2 = (V2 / "cgroup.controllers").exists() and "memory" in (V2 / "cgroup.controllers").read_text()
    root = V2 if v2 else V1
    path = root / name
    try:
        path.mkdir()
        (path / ("memory.max" if v2 else "memory.limit_in_bytes")).write_text(str(limit_mib * 2**20))
        if not v2:
            with contextlib.suppress(OSError):
                (path / "memory.memsw.limit_in_bytes").write_text(str(limit_mib * 2**20))  # no escape into swap
            if tcp:
                with contextlib.suppress(OSError):
                    (path / "memory.kmem.tcp.limit_in_bytes").write_text(str(limit_mib * 2**20))
    except OSError:
        import tempfile

        with tempfile.TemporaryDirectory() as scratch:
            yield PeakRss(limit_mib, Path(scratch) / "pids")
        return
    try:
        yield MemoryCgroup(path, v2)
    finally:
        for pid in (path / "cgroup.procs").read_text().split():
            with contextlib.suppress(OSError):
                os.kill(int(pid), 9)
        with contextlib.suppress(OSError):
            path.rmdir()
