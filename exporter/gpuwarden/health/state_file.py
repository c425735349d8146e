"""The health evaluator's memory across restarts, in a small JSON file.

The health evaluator's memory across restarts: a small JSON file, so that a restart forgets nothing that pages or
drains.

What it keeps, per GPU UUID: when each held condition began (a temperature over its threshold, an NVLink down, the
fabric not set up, ...), when each non-ok verdict began, and the NVLinks seen up. Without it every sustain window
starts again at a start, and a GPU at 92 °C reads pending for two minutes; with it, a condition that had held its
window before the restart and holds at the first reading after it is critical at once.

The file (docs/reliability.md, The state file): `{"version": 1, "written_at": unix time, "boot_id": the host's,
"gpus": {uuid: {"held": {condition: since}, "levels": {check: [level, since]}, "links_up": [link, ...]}}}`, a few
KB for 8 GPUs, at most MAX_STATE_BYTES. Written crash-safe (a temporary file in the same directory, fsync, rename,
fsync of the directory) by a thread of its own, so that a slow disk never holds a publication: when what it holds
changes, every HEARTBEAT_S while it holds anything, and at a clean stop. Read once at start: a missing, corrupt,
truncated or unknown-version file, one others can write, or one written before the host's last boot is ignored
with one log line, never a crash; so are its conditions and levels when it is older than `health.state_max_gap`
(the exporter was down longer than a restart takes: what happened meanwhile is unknown), while the links seen up in
this boot stay known. What it says of a GPU no longer present is dropped at the next write.
"""

from __future__ import annotations

import json
import logging
import math
import os
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

STATE_VERSION = 1
MAX_STATE_BYTES = 256 * 1024  # 8 GPUs write ~2 KB; a node of 64 holding every condition stays far below
MAX_KEYS = 64  # conditions, checks or links per GPU
MAX_NAME = 96  # characters of a UUID, a condition, a check or a link
HEARTBEAT_S = 15.0  # while anything is held: the gap measured at the next start is at most this much too long
CLOCK_SLACK_S = 5.0  # a written_at this far ahead of the reading clock is a clock that jumped, not a file to trust
BOOT_ID = Path("/proc/sys/kernel/random/boot_id")


@dataclass(frozen=True)
class GpuMemory:
    """What the evaluator remembers of one GPU: each held condition's start, each non-ok level with its start, the
    NVLinks seen up."""

    held: dict[str, float]
    levels: dict[str, tuple[int, float]]
    links_up: frozenset[str]

    def empty(self) -> bool:
        return not (self.held or self.levels or self.links_up)

    def timed(self) -> bool:
        """Holds anything whose age matters (a condition or a level): the file is then kept fresh."""
        return bool(self.held or self.levels)


def boot_id(path: Path = BOOT_ID) -> str:
    """The host's boot ID (one per boot, the same in every container): "" where it cannot be read."""
    try:
        return path.read_text().strip()[:64]
    except OSError:
        return ""


def encode(memory: dict[str, GpuMemory], written_at: float, boot: str) -> bytes:
    """The file's bytes for `memory` as of `written_at`."""
    gpus = {
        uuid: {
            "held": gpu.held,
            "levels": {check: [level, since] for check, (level, since) in gpu.levels.items()},
            "links_up": sorted(gpu.links_up),
        }
        for uuid, gpu in sorted(memory.items())
        if not gpu.empty()
    }
    document = {"version": STATE_VERSION, "written_at": written_at, "boot_id": boot, "gpus": gpus}
    return json.dumps(document, separators=(",", ":"), sort_keys=True, allow_nan=False).encode()


def write(path: Path, data: bytes) -> None:
    """Replace `path` with `data` so that a reader, and a crash at any point, sees the old file or the new one, never
    a part: a temporary file beside it, fsync, rename, fsync of the directory. OSError where that cannot be done."""
    if len(data) > MAX_STATE_BYTES:
        raise OSError(f"{len(data)} bytes, over the {MAX_STATE_BYTES} a state file may hold")
    path.parent.mkdir(mode=0o700, exist_ok=True)  # the last directory only: StateDirectory= and the chart make it
    fd, temporary = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")  # mode 0600
    try:
        with os.fdopen(fd, "wb") as out:
            out.write(data)
            out.flush()
            os.fsync(out.fileno())
        os.replace(temporary, path)
    except BaseException:
        Path(temporary).unlink(missing_ok=True)
        raise
    directory = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(directory)
    finally:
        os.close(directory)


class Unusable(Exception):
    """The state file cannot be trusted; the message says why, in a few words."""


def read(path: Path, now: float, max_gap: float, boot: str) -> dict[str, GpuMemory]:
    """What the file remembers, or {} with one log line saying why it is not used (never an exception)."""
    _remove_leftovers(path)
    try:
        memory, written_at = _parse(path, boot)
    except FileNotFoundError:
        log.info("state file %s: none yet; sustained conditions start their windows afresh (pending)", path)
        return {}
    except (OSError, Unusable) as why:
        why = why.strerror if isinstance(why, OSError) and why.strerror else why
        log.warning("state file %s ignored: %s; sustained conditions start their windows afresh (pending)", path, why)
        return {}
    gap = now - written_at
    if gap > max_gap or gap < -CLOCK_SLACK_S:
        log.info(
            "state file %s: written %.0f s ago, outside health.state_max_gap %.0f s: its conditions are not "
            "recalled (sustained conditions start their windows afresh, pending), only the NVLinks seen up",
            path,
            gap,
            max_gap,
        )
        return {uuid: GpuMemory({}, {}, gpu.links_up) for uuid, gpu in memory.items() if gpu.links_up}
    log.info("state file %s: %d GPU(s) recalled, written %.0f s ago", path, len(memory), gap)
    return memory


LEFTOVER_AGE_S = 60.0  # a write takes milliseconds: an older temporary file is one a crash left


def _remove_leftovers(path: Path) -> None:
    """Temporary files of writes a crash interrupted (bounded: one per interrupted write, removed at each start);
    not a younger one, which may be another process's write in flight (an old pod still stopping beside the new)."""
    try:
        for leftover in path.parent.glob(f".{path.name}.*.tmp"):
            if time.time() - leftover.stat().st_mtime > LEFTOVER_AGE_S:
                leftover.unlink(missing_ok=True)
    except OSError:
        pass


def _parse(path: Path, boot: str) -> tuple[dict[str, GpuMemory], float]:
    with path.open("rb") as source:
        status = os.fstat(source.fileno())
        if status.st_mode & 0o022 or status.st_uid not in (os.geteuid(), 0):
            raise Unusable("writable by another user (it must be the exporter's own, mode 0600)")
        data = source.read(MAX_STATE_BYTES + 1)
    if len(data) > MAX_STATE_BYTES:
        raise Unusable(f"over {MAX_STATE_BYTES} bytes")
    try:
        document = json.loads(data)
    except (ValueError, RecursionError):
        raise Unusable("corrupt or truncated (not JSON)") from None
    if not isinstance(document, dict):
        raise Unusable("corrupt (not a JSON object)")
    if document.get("version") != STATE_VERSION:
        raise Unusable(f"version {str(document.get('version'))[:20]!r}, this exporter reads {STATE_VERSION}")
    written_at = document.get("written_at")
    if not _time(written_at):
        raise Unusable("written_at is not a time")
    if boot and document.get("boot_id") != boot:
        raise Unusable("written before the host's last boot")
    gpus = document.get("gpus")
    if not isinstance(gpus, dict) or len(gpus) > 4 * MAX_KEYS:
        raise Unusable("gpus is not a mapping of GPU UUIDs")
    return {uuid: _gpu(gpu, written_at) for uuid, gpu in gpus.items() if _name(uuid)}, written_at


def _gpu(entry: Any, written_at: float) -> GpuMemory:
    """One GPU's memory, of the entries that are well formed and not later than the file itself."""
    if not isinstance(entry, dict):
        raise Unusable("a GPU's entry is not a mapping")
    held, levels, links = entry.get("held", {}), entry.get("levels", {}), entry.get("links_up", [])
    if not (isinstance(held, dict) and isinstance(levels, dict) and isinstance(links, list)):
        raise Unusable("a GPU's entry has the wrong shape")
    if max(len(held), len(levels), len(links)) > MAX_KEYS:
        raise Unusable(f"a GPU has over {MAX_KEYS} entries")

    def possible(since: Any) -> bool:  # a start after the file was written cannot have been seen
        return _time(since) and since <= written_at

    return GpuMemory(
        {key: float(since) for key, since in held.items() if _name(key) and possible(since)},
        {
            check: (value[0], float(value[1]))
            for check, value in levels.items()
            if _name(check)
            and isinstance(value, list)
            and len(value) == 2
            and value[0] in (1, 2)
            and not isinstance(value[0], bool)
            and possible(value[1])
        },
        frozenset(link for link in links if _name(link)),
    )


def _time(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value) and value > 0


def _name(value: Any) -> bool:
    return isinstance(value, str) and 0 < len(value) <= MAX_NAME and value.isprintable()


class StateKeeper:
    """Keeps the evaluator's memory on disk (module docstring): `offer` after each evaluation is cheap (a compare),
    the write is a thread's; `close` writes the last memory before the process ends."""

    def __init__(self, path: Path, boot: str, heartbeat_s: float = HEARTBEAT_S) -> None:
        self.path, self.boot, self.heartbeat_s = path, boot, heartbeat_s
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._closed = False
        self._thread: threading.Thread | None = None
        self._offered: dict[str, GpuMemory] | None = None  # the memory last handed to the writer
        self._offered_at = -math.inf
        self._due: bytes | None = None  # written next
        self._failing = ""  # the last write's error, said once until a write succeeds again

    def offer(self, memory: dict[str, GpuMemory], now: float) -> None:
        """The evaluator's memory as of `now`: written when it changed, or when it holds anything and the last write
        is HEARTBEAT_S old (the next start measures the gap from it)."""
        timed = any(gpu.timed() for gpu in memory.values())
        if memory == self._offered and not (timed and now - self._offered_at >= self.heartbeat_s):
            return
        self._offered, self._offered_at = memory, now
        self._hand_over(encode(memory, now, self.boot))

    def _hand_over(self, data: bytes) -> None:
        with self._lock:
            if self._closed:
                return
            self._due = data
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="state-file", daemon=True)
                self._thread.start()
        self._wake.set()

    def _run(self) -> None:
        while True:
            self._wake.wait()
            self._wake.clear()
            with self._lock:
                data, self._due = self._due, None
                closed = self._closed
            if data is not None:
                self._write(data)
            if closed:
                return

    def _write(self, data: bytes) -> None:
        try:
            write(self.path, data)
        except OSError as error:
            reason = error.strerror or str(error)
            if reason != self._failing:
                log.warning(
                    "state file %s: cannot write it (%s); a restart will start every sustain window afresh (checks "
                    "read pending until watched): give health.state_file a writable path",
                    self.path,
                    reason,
                )
            self._failing = reason
            return
        if self._failing:
            log.info("state file %s: written again", self.path)
            self._failing = ""

    def close(self, memory: dict[str, GpuMemory] | None, now: float, timeout: float = 2.0) -> None:
        """Write `memory` as of `now` (a clean stop: the next start measures the gap from it), then stop the writer,
        waiting at most `timeout` s (a hung disk does not hold the exit)."""
        if memory is not None and self._offered is not None:
            self._hand_over(encode(memory, now, self.boot))
        with self._lock:
            self._closed = True
            thread = self._thread
        if thread is None:
            return
        self._wake.set()
        thread.join(timeout)
