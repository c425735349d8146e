"""The GPM child process's supervisor: starts it, speaks its line protocol, and counts its failures.

The serving process keeps every other family whatever the child does (gpuwarden.nvml.gpm_sampler says why a child):
- a child that dies (signal or exit) or does not answer within `ANSWER_TIMEOUT_S` is counted, its last frames
  (faulthandler's) name the call, and the next request starts a new one;
- after `crash_limit` consecutive failures GPM is off (`gpuwarden_gpm_unavailable_info{reason="crashed"}`), with
  one log line naming the call and what to try; after `crash_backoff` seconds one new child is tried, and the
  backoff doubles (up to `MAX_BACKOFF_S`) each time that try fails too, so a fixed driver brings GPM back.
The protocol runs on a pipe of its own (answers) and the child's stdin (requests): whatever a library prints in the
child goes to its stderr, which is read as it comes (a bounded tail is kept for the crash report).
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
import time
from typing import Any, NoReturn

from gpuwarden.nvml.errors import GpuLostError, NvmlDownError, NvmlFatalError
from gpuwarden.nvml.gpm import GpmUnavailable, Window

log = logging.getLogger("gpuwarden.nvml.gpm_sampler")  # one logger name for GPM's sampler, as before the split

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


class ChildSupervisor:
    """One GPM child at a time, used by one thread (the sampler's owner) under `_lock`: each request starts the child
    where there is none, and a failure is counted, reported once and raised as GpmSamplerDown."""

    def __init__(self, spec: dict[str, Any], crash_limit: int = 3, crash_backoff: float = 600.0) -> None:
        # spec["module"]: the child's entry where the library is not the driver's (gpuwarden.sim.gpm_child)
        self.spec = spec  # how the child loads the same library (gpuwarden.nvml.library.child_spec)
        self.crash_limit, self.crash_backoff = crash_limit, crash_backoff
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
        self._stopping = False  # stop() was asked: a child killed now is no failure of its own

    def pid(self) -> int | None:
        proc = self._proc
        return None if proc is None else proc.pid

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
