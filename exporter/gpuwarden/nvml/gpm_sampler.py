"""Who drives the GPM windows: a supervised child process (default), or this process (`nvml.gpm_isolation: thread`).

Why a child: a native crash inside libnvidia-ml ends the process that made the call, and Kubernetes restarts it into
the same crash on every node at once. GPM is the one part of NVML that has crashed us (docs/nvml.md, GPM), so its
calls run in a small child process (gpuwarden.nvml.gpm_child) that owns every sample buffer and makes one call at a
time. One thread of this process, the sampler's owner, talks to the child; the GPUs' readers post a request and take
the answers that have come, never waiting on the child, so a child that hangs costs GPM's windows and nothing else
(each GPU's other families stay fresh at the fast tier: tests/test_gpm_containment.py); how a failing child is
counted, turned off and tried again: gpuwarden.nvml.gpm_supervisor.
The in-process sampler is the same API over gpuwarden.nvml.gpm.GpmWindow, called on the reader's thread, with no
containment (a hang there holds that GPU's reader); the simulator falls back to it where the child cannot reproduce
the library (a scenario on a hand-moved clock, in tests).
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Protocol

from gpuwarden.nvml import library
from gpuwarden.nvml.errors import GpuLostError, NvmlDownError, NvmlFatalError
from gpuwarden.nvml.gpm import STOP_WAIT_S, GpmUnavailable, InProcessSampler, Window, WindowKey  # noqa: F401 - re-exported
from gpuwarden.nvml.gpm_supervisor import (
    CRASHED,
    ChildSupervisor,
    GpmSamplerDown,
    GpmSamplerStarting,
)

log = logging.getLogger(__name__)


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


class ChildProcessSampler(ChildSupervisor):
    """GPM windows in a supervised child process (see the module docstring).

    The readers' API (advance, close) never waits on the child: advance() queues a request for the owner thread and
    returns what has been answered since the reader last asked (windows merged; an error raised). So a window is
    reported one fast cycle after it was sampled, and a wedged child delays only GPM."""

    def __init__(self, spec: dict[str, Any], crash_limit: int = 3, crash_backoff: float = 600.0) -> None:
        super().__init__(spec, crash_limit, crash_backoff)
        self._lock = threading.Lock()  # the owner's: the child, its pipes and the failure counts
        # the mailbox between the readers and the owner thread
        self._mailbox = threading.Condition(threading.Lock())
        self._queue: deque[_Advance | tuple[str, str, int | None]] = deque()
        self._queued: dict[WindowKey, _Advance] = {}
        self._answers: dict[WindowKey, _Answers] = {}
        self._answered: set[WindowKey] = set()  # keys with any answer: their GPU's support is known
        self._owner: threading.Thread | None = None
        self._in_flight: _Advance | None = None  # the request the owner is asking the child now

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
