"""Who drives the GPM windows: a supervised child process (default), or this process (`nvml.gpm_isolation: thread`).

Why a child: a native crash inside libnvidia-ml ends the process that made the call, and Kubernetes restarts it into
the same crash on every node at once. GPM is the one part of NVML that has crashed us (docs/nvml.md, GPM), so its
calls run in a small child process (gpuwarden.nvml.gpm_child) that owns every sample buffer and makes one call at a
time. One thread of this process, the sampler's owner, talks to the child; the GPUs' readers post a request and take
the answers that have come, never waiting on the child, so a child that hangs costs GPM's windows and nothing else
(each GPU's other families stay fresh at the fast tier: tests/test_gpm_containment.py). The serving process keeps
every other family whatever the child does:
- a child that dies (signal or exit) or does not answer within `ANSWER_TIMEOUT_S` is counted, its last frames
  (faulthandler's) name the call, and the next request starts a new one;
- after `crash_limit` consecutive failures GPM is off (`gpuwarden_gpm_unavailable_info{reason="crashed"}`), with
  one log line naming the call and what to try; after `crash_backoff` seconds one new child is tried, and the
  backoff doubles (up to `MAX_BACKOFF_S`) each time that try fails too, so a fixed driver brings GPM back.
The protocol runs on a pipe of its own (answers) and the child's stdin (requests): whatever a library prints in the
child goes to its stderr, which is read as it comes (a bounded tail is kept for the crash report).
The in-process sampler is the same API over gpuwarden.nvml.gpm.GpmWindow, called on the reader's thread, with no
containment (a hang there holds that GPU's reader); the simulator falls back to it where the child cannot reproduce
the library (a scenario on a hand-moved clock, in tests).
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
from collections import deque
from dataclasses import dataclass, field
from typing import Any, NoReturn, Protocol

from gpuwarden.nvml import library
from gpuwarden.nvml.errors import GpuLostError, NvmlDownError, NvmlFatalError
from gpuwarden.nvml.gpm import STOP_WAIT_S, GpmUnavailable, InProcessSampler, Window, WindowKey  # noqa: F401 - re-exported

log = logging.getLogger(__name__)

CHILD_MODULE = "gpuwarden.nvml.gpm_child"  # the child over the driver's library

ANSWER_TIMEOUT_S = 3.0  # a GPM sample and 12 metrics take under 4 ms; a child that takes this long is wedged
START_TIMEOUT_S = 10.0  # interpreter start, pynvml import and nvmlInit
EXIT_GRACE_S = 0.5  # a child whose end of the pipe closed has exited within this, or is killed (hung)
MAX_BACKOFF_S = 3600.0
STDERR_TAIL_BYTES = 64 * 1024  # what is kept of the child's stderr for the crash report (faulthandler's stacks)
CRASHED, HUNG = "crashed", "hung"
_LAST_NVML_FRAME = re.compile(r'File ".*?", line \d+ in (nvml\w+)')


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


@dataclass
class _Advance:
    """A reader's request for one window, queued for the owner thread (one per window key at most)."""

    key: WindowKey
    handle: Any
    metric_ids: list[int]
    cancelled: bool = False


@dataclass
class _Answers:
    """What the owner thread has learnt of one window key since its reader last asked."""

    windows: list[Window] = field(default_factory=list)
    error: Exception | None = None

    def take(self) -> Window | None:
        """The windows merged into one (means weighted by seconds), None where there is none; raises the error."""
        if self.error is not None:
            raise self.error
        if not self.windows:
            return None
        seconds = sum(w.seconds for w in self.windows)
        values: dict[int, float] = {}
        for metric in {m for w in self.windows for m in w.values}:
            weighted = [(w.values[metric], w.seconds) for w in self.windows if metric in w.values]
            values[metric] = sum(v * t for v, t in weighted) / max(sum(t for _, t in weighted), 1e-9)
        failed = {m: e for w in self.windows for m, e in w.failed.items()}
        return Window(seconds, values, failed)


def _uncounted(error: Exception) -> bool:
    return isinstance(error, GpmSamplerDown) and not error.counted


class ChildProcessSampler:
    """GPM windows in a supervised child process (see the module docstring).

    The readers' API (advance, close) never waits on the child: advance() queues a request for the owner thread and
    returns what has been answered since the reader last asked (windows merged; an error raised). So a window is
    reported one fast cycle after it was sampled, and a wedged child delays only GPM."""

    def __init__(self, spec: dict[str, Any], crash_limit: int = 3, crash_backoff: float = 600.0) -> None:
        # spec["module"]: the child's entry where the library is not the driver's (gpuwarden.sim.gpm_child)
        self.spec = spec  # how the child loads the same library (gpuwarden.nvml.library.child_spec)
        self.crash_limit, self.crash_backoff = crash_limit, crash_backoff
        self._lock = threading.Lock()  # the owner's: the child, its pipes and the failure counts
        self._proc: subprocess.Popen[bytes] | None = None
        self._answer_fd: int | None = None  # the protocol's pipe, apart from the child's stdout
        self._ready = False
        self._buffer = b""
        self._stderr_tail = b""
        self._unreaped: list[subprocess.Popen[bytes]] = []  # killed children that did not exit (D state)
        self._consecutive = 0
        self._backoff = crash_backoff
        self.off_until = 0.0  # monotonic time before which GPM is off (0: on)
        self.off_reason: str | None = None
        self.starts = 0
        # the mailbox between the readers and the owner thread
        self._mailbox = threading.Condition(threading.Lock())
        self._queue: deque[_Advance | tuple[str, str, int | None]] = deque()
        self._queued: dict[WindowKey, _Advance] = {}
        self._answers: dict[WindowKey, _Answers] = {}
        self._answered: set[WindowKey] = set()  # keys with any answer: their GPU's support is known
        self._owner: threading.Thread | None = None
        self._in_flight: _Advance | None = None  # the request the owner is asking the child now
        self._stopping = False

    # -- the readers' API (never waits on the child) ------------------------------------------------------

    def advance(self, uuid: str, handle: Any, gpu_instance: int | None, metric_ids: list[int]) -> Window | None:
        key = (uuid, gpu_instance)
        with self._mailbox:
            if self._stopping:
                raise GpmSamplerDown("stopped", counted=False)
            answers = self._answers.pop(key, None)
            if self.off_until and time.monotonic() < self.off_until:
                if answers is not None and answers.error is not None:
                    raise answers.error  # the failure that turned GPM off, counted once
                raise GpmSamplerDown(self.off_reason or CRASHED, counted=False)
            queued = self._queued.get(key)
            if queued is not None:  # still waiting for the owner: the newest request replaces it
                queued.handle, queued.metric_ids = handle, list(metric_ids)
            else:
                self._queued[key] = request = _Advance(key, handle, list(metric_ids))
                self._queue.append(request)
                self._mailbox.notify()
            known = key in self._answered
            self._start_owner()
        if answers is None:
            if not known:
                raise GpmSamplerStarting  # no answer about this GPU yet: its support is still unknown
            return None  # nothing new since the last cycle: the totals stand
        return answers.take()

    def close(self, uuid: str, gpu_instance: int | None = None) -> None:
        with self._mailbox:
            for key in [
                k for k in (*self._queued, *self._answers, *self._answered) if self._matches(k, uuid, gpu_instance)
            ]:
                if key in self._queued:
                    self._queued.pop(key).cancelled = True
                self._answers.pop(key, None)
                self._answered.discard(key)
            if self._in_flight is not None and self._matches(self._in_flight.key, uuid, gpu_instance):
                self._in_flight.cancelled = True  # its answer belongs to the windows being closed
            if self._owner is not None and not self._stopping:
                self._queue.append(("close", uuid, gpu_instance))
                self._mailbox.notify()

    def stop(self) -> None:
        """End the owner thread and the child. The child is killed from here, so a wedged request ends at once."""
        with self._mailbox:
            self._stopping = True
            self._queue.clear()
            self._queued.clear()
            self._mailbox.notify()
            owner = self._owner
        proc = self._proc
        if proc is not None:
            with contextlib.suppress(OSError):
                proc.kill()  # a signal to a separate process: safe from any thread
        if owner is not None and owner is not threading.current_thread():
            owner.join(STOP_WAIT_S)
        with self._lock:
            self._kill()
        with self._mailbox:  # a sampler stopped for a reload may be configured again
            self._owner, self._stopping = None, False
            self._answers.clear()
            self._answered.clear()

    def pid(self) -> int | None:
        proc = self._proc
        return None if proc is None else proc.pid

    @staticmethod
    def _matches(key: WindowKey, uuid: str, gpu_instance: int | None) -> bool:
        return key[0] == uuid and (gpu_instance is None or key[1] == gpu_instance)

    # -- the owner thread ---------------------------------------------------------------------------------

    def _start_owner(self) -> None:
        """Called with the mailbox held."""
        if self._owner is None or not self._owner.is_alive():
            self._owner = threading.Thread(target=self._serve, name="gpuwarden-gpm-owner", daemon=True)
            self._owner.start()

    def _serve(self) -> None:
        while True:
            with self._mailbox:
                while not self._queue and not self._stopping:
                    self._mailbox.wait()
                if self._stopping:
                    return
                item = self._queue.popleft()
                if isinstance(item, _Advance):
                    if item.cancelled:
                        continue
                    self._queued.pop(item.key, None)
                    self._in_flight = item
            if isinstance(item, tuple):
                _, uuid, gpu_instance = item
                with self._lock:
                    self._close_in_child(uuid, gpu_instance)
                continue
            self._answer(item)

    def _answer(self, item: _Advance) -> None:
        uuid, gpu_instance = item.key
        try:
            with self._lock:
                window = self._advance_in_child(uuid, gpu_instance, item.metric_ids)
        except GpmSamplerStarting:
            with self._mailbox:
                self._in_flight = None
            return  # nothing learnt: the reader asks again next cycle
        except (GpmUnavailable, GpmSamplerDown, GpuLostError, NvmlDownError, NvmlFatalError) as exc:
            self._deliver(item, error=exc)
            return
        except Exception as exc:  # noqa: BLE001 - the owner thread must outlive anything the protocol throws
            log.warning("GPM sampler: unexpected %s: %s; the child is restarted", type(exc).__name__, exc)
            with self._lock:
                self._kill()
            self._deliver(item, error=GpmSamplerDown(CRASHED, counted=True))
            return
        self._deliver(item, window=window)

    def _deliver(self, item: _Advance, window: Window | None = None, error: Exception | None = None) -> None:
        with self._mailbox:
            self._in_flight = None
            if item.cancelled or self._stopping:
                return  # closed meanwhile: the answer belongs to windows that are gone
            answers = self._answers.setdefault(item.key, _Answers())
            if error is not None:
                if answers.error is None or _uncounted(answers.error):
                    answers.error = error  # a counted failure is never hidden by a later "GPM is off"
            elif window is not None:
                answers.windows.append(window)
            self._answered.add(item.key)

    # -- the child (owner thread only, under self._lock) --------------------------------------------------

    def _advance_in_child(self, uuid: str, gpu_instance: int | None, metric_ids: list[int]) -> Window | None:
        answer = self._request({"op": "advance", "uuid": uuid, "gi": gpu_instance, "metrics": metric_ids})
        if answer is None:
            raise GpmSamplerStarting
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

    def _close_in_child(self, uuid: str, gpu_instance: int | None) -> None:
        if self._proc is not None and self._ready:
            with contextlib.suppress(GpmSamplerDown):  # a child that died on the way took its windows with it
                self._request({"op": "close", "uuid": uuid, "gi": gpu_instance})

    def _request(self, message: dict[str, Any]) -> dict[str, Any] | None:
        if self.off_until:
            if time.monotonic() < self.off_until:
                raise GpmSamplerDown(self.off_reason or CRASHED, counted=False)
            self.off_until, self.off_reason = 0.0, None  # the backoff is over: one more child is tried
            log.info("GPM: trying its sampler process again after the backoff")
        if self._proc is None:
            self._spawn()
        assert self._proc is not None
        if not self._ready:
            line = self._read_line(0.0)  # never hold a cycle for the child's start
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
        try:
            answer = json.loads(line)
        except ValueError:
            self._failed()
        if not isinstance(answer, dict):
            self._failed()
        return answer

    def _spawn(self) -> None:
        self._reap_unreaped()
        answers_read, answers_write = os.pipe()
        try:
            self._proc = subprocess.Popen(
                [sys.executable, "-X", "faulthandler", "-m", self.spec.get("module", CHILD_MODULE),
                 json.dumps(self.spec), str(answers_write)],
                stdin=subprocess.PIPE,
                stdout=subprocess.DEVNULL,  # the child sends its own stdout to stderr; the protocol has its pipe
                stderr=subprocess.PIPE,
                pass_fds=(answers_write,),
                start_new_session=True,  # a SIGINT to the exporter's terminal goes to the exporter, which stops it
            )  # fmt: skip
        except OSError:
            os.close(answers_read)
            raise
        finally:
            os.close(answers_write)
        self._answer_fd = answers_read
        os.set_blocking(answers_read, False)
        os.set_blocking(self._proc.stderr.fileno(), False)  # type: ignore[union-attr]
        self._ready, self._buffer, self._stderr_tail, self._started_at = False, b"", b"", time.monotonic()
        self.starts += 1

    def _read_line(self, timeout: float) -> bytes | None:
        """One protocol line from the child within `timeout` s, or None (nothing yet, or the child's end closed).
        The child's stderr is drained meanwhile, so a chatty child never blocks on a full pipe."""
        assert self._proc is not None and self._proc.stderr is not None and self._answer_fd is not None
        stderr = self._proc.stderr.fileno()
        deadline = time.monotonic() + timeout
        while b"\n" not in self._buffer:
            remaining = deadline - time.monotonic()
            readable, _, _ = select.select([self._answer_fd, stderr], [], [], max(remaining, 0.0))
            if stderr in readable:
                self._drain_stderr(self._proc)
            if self._answer_fd in readable:
                chunk = os.read(self._answer_fd, 65536)
                if not chunk:
                    return None  # EOF: the child is gone
                self._buffer += chunk
            elif remaining <= 0:
                return None
        line, _, self._buffer = self._buffer.partition(b"\n")
        return line

    def _failed(self) -> NoReturn:
        """The child died or wedged: count it, name the call, turn GPM off after `crash_limit`; always raises.
        A child that exits by itself within the grace `crashed`; one that must be killed `hung`."""
        if self._stopping:  # stop() killed it: not a failure of the child
            self._reap()
            raise GpmSamplerDown("stopped", counted=False)
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
        """(the NVML call it died in, how it ended, whether it had to be killed). Every pipe of the child is closed
        here whether or not it exits: one stuck in D state is kept to be reaped later, never its descriptors."""
        proc, self._proc, self._ready = self._proc, None, False
        if proc is None:
            return None, "not started", False
        killed = False
        try:
            proc.wait(EXIT_GRACE_S)  # its end of the pipe closed: the exit itself follows within milliseconds
        except subprocess.TimeoutExpired:
            with contextlib.suppress(OSError):
                proc.kill()
            killed = True
        exited = True
        try:
            proc.wait(2.0)
        except subprocess.TimeoutExpired:
            exited = False
            self._unreaped.append(proc)
        self._drain_stderr(proc)
        stderr = self._stderr_tail
        for stream in (proc.stdin, proc.stderr):
            if stream is not None:
                with contextlib.suppress(OSError):
                    stream.close()
        if self._answer_fd is not None:
            os.close(self._answer_fd)
            self._answer_fd = None
        if not exited:
            return None, "did not exit", killed
        code = proc.returncode
        status = f"signal {signal.Signals(-code).name}" if code < 0 else f"exit {code}"
        frames = _LAST_NVML_FRAME.findall(stderr.decode(errors="replace"))
        # faulthandler prints the crashing thread first, innermost frame first: its first NVML frame is the call
        return (frames[0] if frames else None), status, killed

    def _drain_stderr(self, proc: subprocess.Popen[bytes]) -> None:
        """What the child has written to stderr (non-blocking since spawn), its last STDERR_TAIL_BYTES kept."""
        if proc.stderr is None:
            return
        with contextlib.suppress(OSError, ValueError):
            while chunk := os.read(proc.stderr.fileno(), 65536):
                self._stderr_tail = (self._stderr_tail + chunk)[-STDERR_TAIL_BYTES:]

    def _reap_unreaped(self) -> None:
        self._unreaped = [proc for proc in self._unreaped if proc.poll() is None]

    def _kill(self) -> None:
        if self._proc is not None:
            with contextlib.suppress(OSError):
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
