"""Who drives the GPM windows: a supervised child process (default), or this process (`nvml.gpm_isolation: thread`).

Why a child: a native crash inside libnvidia-ml ends the process that made the call, and Kubernetes restarts it into
the same crash on every node at once. GPM is the one part of NVML that has crashed us (docs/nvml.md, GPM), so its
calls run in a small child process (gpuwarden.nvml.gpm_child) that owns every sample buffer and makes one call at a
time. The serving process keeps every other family whatever the child does:
- a child that dies (signal or exit) or does not answer within `ANSWER_TIMEOUT_S` is counted, its last frames
  (faulthandler's) name the call, and the next request starts a new one;
- after `crash_limit` consecutive failures GPM is off (`gpuwarden_gpm_unavailable_info{reason="crashed"}`), with
  one log line naming the call and what to try; after `crash_backoff` seconds one new child is tried, and the
  backoff doubles (up to `MAX_BACKOFF_S`) each time that try fails too, so a fixed driver brings GPM back.
The in-process sampler is the same API over gpuwarden.nvml.gpm.GpmWindow; the simulator falls back to it where the
child cannot reproduce the library (a scenario on a hand-moved clock, in tests).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import select
import signal
import subprocess
import sys
import threading
import time
from typing import Any, NoReturn, Protocol

from gpuwarden.nvml import library
from gpuwarden.nvml.errors import GpuLostError, NvmlDownError, NvmlFatalError
from gpuwarden.nvml.gpm import GpmUnavailable, GpmWindow, Window, check_support

log = logging.getLogger(__name__)

ANSWER_TIMEOUT_S = 3.0  # a GPM sample and 12 metrics take under 4 ms; a child that takes this long is wedged
START_TIMEOUT_S = 10.0  # interpreter start, pynvml import and nvmlInit
EXIT_GRACE_S = 0.5  # a child whose end of the pipe closed has exited within this, or is killed (hung)
MAX_BACKOFF_S = 3600.0
CRASHED, HUNG = "crashed", "hung"
_LAST_NVML_FRAME = re.compile(r'File ".*?", line \d+ in (nvml\w+)')
WindowKey = tuple[str, int | None]  # (GPU UUID, MIG GPU instance or None for the whole GPU)


class GpmSamplerDown(Exception):
    """No GPM this cycle: the sampler process failed (`counted`: this request saw the failure) or GPM is off after
    repeated failures. The GPU's other metrics are unaffected; the next cycle asks again."""

    def __init__(self, reason: str, counted: bool) -> None:
        super().__init__(reason)
        self.reason, self.counted = reason, counted


class GpmSamplerStarting(Exception):
    """The sampler process has not finished starting: nothing is known of the GPU yet (not even its support), so the
    caller changes nothing this cycle."""


class GpmSampler(Protocol):
    def advance(self, uuid: str, handle: Any, gpu_instance: int | None, metric_ids: list[int]) -> Window | None:
        """Sample one GPU (or MIG instance) now: the window since its previous sample, or None while there is none.
        Raises GpmUnavailable (this GPU cannot), GpmSamplerDown (no GPM now), GpuLost/NvmlDown/NvmlFatal."""
        ...

    def close(self, uuid: str, gpu_instance: int | None = None) -> None:
        """Forget a GPU's windows (all of them where gpu_instance is None): re-discovered, or a MIG slice gone."""
        ...

    def stop(self) -> None: ...


class InProcessSampler:
    """GPM windows in this process; every call holds gpuwarden.nvml.gpm.GPM_CALLS."""

    def __init__(self) -> None:
        self._windows: dict[WindowKey, GpmWindow] = {}
        self._lock = threading.Lock()

    def advance(self, uuid: str, handle: Any, gpu_instance: int | None, metric_ids: list[int]) -> Window | None:
        key = (uuid, gpu_instance)
        with self._lock:
            window = self._windows.get(key)
        if window is None:
            if gpu_instance is None:
                check_support(handle)
            window = GpmWindow(handle, gpu_instance=gpu_instance)
            with self._lock:
                self._windows[key] = window
        try:
            return window.advance(metric_ids)
        except GpmUnavailable:
            self.close(uuid, gpu_instance)
            raise

    def close(self, uuid: str, gpu_instance: int | None = None) -> None:
        with self._lock:
            keys = [k for k in self._windows if k[0] == uuid and (gpu_instance is None or k[1] == gpu_instance)]
            windows = [self._windows.pop(k) for k in keys]
        for window in windows:
            window.free()

    def stop(self) -> None:
        with self._lock:
            uuids = {uuid for uuid, _ in self._windows}
        for uuid in uuids:
            self.close(uuid)


class ChildProcessSampler:
    """GPM windows in a supervised child process (see the module docstring); one request at a time."""

    def __init__(self, spec: dict[str, Any], crash_limit: int = 3, crash_backoff: float = 600.0) -> None:
        self.spec = spec  # how the child loads the same library (gpuwarden.nvml.library.child_spec)
        self.crash_limit, self.crash_backoff = crash_limit, crash_backoff
        self._lock = threading.Lock()
        self._proc: subprocess.Popen[bytes] | None = None
        self._ready = False
        self._buffer = b""
        self._consecutive = 0
        self._backoff = crash_backoff
        self.off_until = 0.0  # monotonic time before which GPM is off (0: on)
        self.off_reason: str | None = None
        self.starts = 0

    # -- the API ----------------------------------------------------------------------------------------

    def advance(self, uuid: str, handle: Any, gpu_instance: int | None, metric_ids: list[int]) -> Window | None:
        answer = self._request({"op": "advance", "uuid": uuid, "gi": gpu_instance, "metrics": metric_ids})
        if answer is None:
            raise GpmSamplerStarting  # no answer about this GPU yet: its support is still unknown
        if "window" in answer:
            window = answer["window"]
            if window is None:
                return None  # a first sample proves little: the crashes seen were in the metrics of a window
            self._consecutive, self._backoff = 0, self.crash_backoff
            return Window(
                float(window["seconds"]),
                {int(k): float(v) for k, v in window["values"].items()},
                {int(k): str(v) for k, v in window["failed"].items()},
            )
        error, reason = answer["error"], answer["reason"]
        if error == "unavailable":
            raise GpmUnavailable(reason)
        if error == "lost":
            raise GpuLostError(reason)
        if error == "down":
            raise NvmlDownError(reason)
        raise NvmlFatalError(reason)

    def close(self, uuid: str, gpu_instance: int | None = None) -> None:
        if self._proc is not None and self._ready:
            with contextlib.suppress(GpmSamplerDown):  # a child that died on the way took its windows with it
                self._request({"op": "close", "uuid": uuid, "gi": gpu_instance})

    def stop(self) -> None:
        with self._lock:
            self._kill()

    def pid(self) -> int | None:
        return None if self._proc is None else self._proc.pid

    # -- the child ----------------------------------------------------------------------------------------

    def _request(self, message: dict[str, Any]) -> dict[str, Any] | None:
        with self._lock:
            if self.off_until:
                if time.monotonic() < self.off_until:
                    raise GpmSamplerDown(self.off_reason or CRASHED, counted=False)
                self.off_until, self.off_reason = 0.0, None  # the backoff is over: one more child is tried
                log.info("GPM: trying its sampler process again after the backoff")
            if self._proc is None:
                self._spawn()
            if not self._ready:
                line = self._read_line(0.0)  # never hold a fast cycle for the child's start
                if line is None:
                    if self._proc.poll() is not None or time.monotonic() - self._started_at > START_TIMEOUT_S:
                        self._failed()
                    return None
                if not json.loads(line).get("ready"):
                    self._failed()  # NVML would not initialise in the child
                self._ready = True
            assert self._proc.stdin is not None
            try:
                self._proc.stdin.write(json.dumps(message).encode() + b"\n")
                self._proc.stdin.flush()
            except OSError:
                self._failed()
            line = self._read_line(ANSWER_TIMEOUT_S)
            if line is None:
                self._failed()
            return json.loads(line)

    def _spawn(self) -> None:
        self._proc = subprocess.Popen(
            [sys.executable, "-X", "faulthandler", "-m", "gpuwarden.nvml.gpm_child", json.dumps(self.spec)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            start_new_session=True,  # a SIGINT to the exporter's terminal goes to the exporter, which stops the child
        )
        os.set_blocking(self._proc.stdout.fileno(), False)  # type: ignore[union-attr]
        self._ready, self._buffer, self._started_at = False, b"", time.monotonic()
        self.starts += 1

    def _read_line(self, timeout: float) -> bytes | None:
        """One line from the child within `timeout` s, or None (nothing yet, or the child's end closed)."""
        assert self._proc is not None and self._proc.stdout is not None
        deadline = time.monotonic() + timeout
        while b"\n" not in self._buffer:
            remaining = deadline - time.monotonic()
            readable, _, _ = select.select([self._proc.stdout], [], [], max(remaining, 0.0))
            if not readable:
                return None
            chunk = self._proc.stdout.read(65536)
            if not chunk:
                return None  # EOF: the child is gone
            self._buffer += chunk
        line, _, self._buffer = self._buffer.partition(b"\n")
        return line

    def _failed(self) -> NoReturn:
        """The child died or wedged: count it, name the call, turn GPM off after `crash_limit`; always raises.
        A child that exits by itself within the grace `crashed`; one that must be killed `hung`."""
        culprit, status, killed = self._reap()
        how = HUNG if killed else CRASHED
        self._consecutive += 1
        where = f" in {culprit}" if culprit else ""
        if self._consecutive >= self.crash_limit:
            self.off_until, self.off_reason = time.monotonic() + self._backoff, how
            log.error(
                "GPM off for %.0f s: its sampler process %s %d times in a row (last: %s%s); every other metric is "
                "unaffected. This is a driver fault: upgrade the NVIDIA driver, or set nvml.gpm: false to stop "
                "retrying (docs/nvml.md, GPM: the crash under training)",
                self._backoff,
                how,
                self._consecutive,
                status,
                where,
            )
            self._backoff = min(self._backoff * 2, MAX_BACKOFF_S)
            self._consecutive = self.crash_limit - 1  # after the backoff, one more failure turns it off again
        else:
            log.warning(
                "GPM sampler process %s (%s%s); starting a new one (%d of %d before GPM turns off)",
                how,
                status,
                where,
                self._consecutive,
                self.crash_limit,
            )
        raise GpmSamplerDown(how, counted=True)

    def _reap(self) -> tuple[str | None, str, bool]:
        """(the NVML call it died in, how it ended, whether it had to be killed)."""
        proc, self._proc, self._ready = self._proc, None, False
        if proc is None:
            return None, "not started", False
        killed = False
        try:
            proc.wait(EXIT_GRACE_S)  # its end of the pipe closed: the exit itself follows within milliseconds
        except subprocess.TimeoutExpired:
            proc.kill()
            killed = True
        try:
            proc.wait(2.0)
        except subprocess.TimeoutExpired:
            return None, "did not exit", killed
        stderr = b""
        if proc.stderr is not None:
            os.set_blocking(proc.stderr.fileno(), False)
            stderr = proc.stderr.read() or b""
            proc.stderr.close()
        for stream in (proc.stdin, proc.stdout):
            if stream is not None:
                stream.close()
        code = proc.returncode
        status = f"signal {signal.Signals(-code).name}" if code < 0 else f"exit {code}"
        frames = _LAST_NVML_FRAME.findall(stderr.decode(errors="replace"))
        # faulthandler prints the crashing thread first, innermost frame first: its first NVML frame is the call
        return (frames[0] if frames else None), status, killed

    def _kill(self) -> None:
        if self._proc is not None:
            self._proc.kill()
            self._reap()


_current: GpmSampler | None = None
_current_lock = threading.Lock()


def configure(isolation: str, crash_limit: int, crash_backoff: float) -> GpmSampler:
    """The process-wide sampler for these settings (kept across reloads unless the isolation changes)."""
    global _current
    with _current_lock:
        spec = library.child_spec()
        want_child = isolation == "process" and spec is not None
        current = _current
        if isinstance(current, ChildProcessSampler) and want_child:
            current.crash_limit, current.crash_backoff = crash_limit, crash_backoff
            return current
        if isinstance(current, InProcessSampler) and not want_child:
            return current
        if current is not None:
            current.stop()
        if isolation == "process" and spec is None:
            log.info("GPM runs in this process: the simulator on a hand-moved clock cannot be shared with a child")
        _current = ChildProcessSampler(spec, crash_limit, crash_backoff) if want_child else InProcessSampler()
        return _current


def current() -> GpmSampler:
    global _current
    with _current_lock:
        if _current is None:
            _current = InProcessSampler()
        return _current


def reset() -> None:
    """Stop and forget the sampler (the poller's stop; a new library installed)."""
    global _current
    with _current_lock:
        if _current is not None:
            _current.stop()
        _current = None
