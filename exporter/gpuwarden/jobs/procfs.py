"""Bounded reads of the host's /proc for the job view, telling a file it may not read from one that is gone.

Bounded reads of the host's /proc for the job view, telling a file this process may not read (another user's
`environ`, which needs the same UID or CAP_SYS_PTRACE) from one that is not there (the process ended, or the host
hides it: hidepid, systemd's ProtectProc=invisible). Which sources are readable is what the job view reports
(jobs/sources.py)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

STAT_BYTES = 4096
CGROUP_BYTES = 64 * 1024
CMDLINE_BYTES = 64 * 1024  # a launcher's own options come before the training script and its arguments


@dataclass(frozen=True)
class Read:
    """What one read gave: the bytes, or why none (denied: the file is there and this process may not read it)."""

    data: bytes = b""
    denied: bool = False

    @property
    def text(self) -> str:
        return self.data.decode("utf-8", "replace")


def read_head(path: Path, limit: int) -> Read:
    """Up to `limit` bytes from the start of `path`."""
    try:
        with path.open("rb") as handle:
            return Read(handle.read(limit))
    except PermissionError:
        return Read(denied=True)
    except OSError:
        return Read()


def argv(raw: bytes) -> list[str]:
    """A /proc/PID/cmdline as its arguments (NUL-separated; a process that rewrote its title may use spaces)."""
    parts = raw.rstrip(b"\0").split(b"\0")
    if len(parts) == 1:  # setproctitle-style: one string
        parts = parts[0].split(b" ")
    return [part.decode("utf-8", "replace") for part in parts if part]


@dataclass(frozen=True)
class Stat:
    """/proc/PID/stat's command name, parent, session and start time (clock ticks after boot: the order in which a
    launcher started its workers)."""

    comm: str
    ppid: int
    session: int
    started: int


def parse_stat(text: str) -> Stat | None:
    """The fields of a /proc/PID/stat line; the command name may hold spaces and parentheses, so the fields are read
    after its last ')'."""
    head, sep, rest = text.rpartition(")")
    fields = rest.split()
    if not sep or len(fields) < 4 or not all(f.isdigit() for f in fields[1:4]):
        return None
    started = int(fields[19]) if len(fields) > 19 and fields[19].isdigit() else 0
    return Stat(head.partition("(")[2], int(fields[1]), int(fields[3]), started)


def read_stat(proc_root: Path, pid: int) -> Stat | None:
    return parse_stat(read_head(proc_root / str(pid) / "stat", STAT_BYTES).text)


def real_uid(status: str) -> str | None:
    """The real UID from a /proc/PID/status text."""
    for line in status.splitlines():
        if line.startswith("Uid:"):
            fields = line.split()
            return fields[1] if len(fields) > 1 else None
    return None
