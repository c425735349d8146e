"""Reads the kernel log from boot, then follows it, on a thread of its own (issue 39).

It starts once the host's GPUs are known (the tally's KnownDevices: a line read earlier would be ignored for naming
an address not yet known); `reading` says whether it reads now (gpuwarden_kernel_log_up). `/dev/kmsg` hands one
record per read, from the oldest the ring still holds; a reader that falls behind the ring gets EPIPE once and goes
on from the oldest left (the records in between are lost: counted in `lost`). A regular file (a copy of /dev/kmsg's
records handed over, e.g. for a test) is read in chunks and split into lines, and followed as it grows. Where the
log cannot be read (no /dev/kmsg, or `kernel.dmesg_restrict` = 1 without CAP_SYSLOG) it says why once, in
`unavailable`, and tries again every RETRY_S (every MISSING_RETRY_S while the path does not exist: a named pipe the
Helm chart's relay is about to make): the rest of the exporter serves as before. A named pipe (`gpuwarden
kernel-log-relay`) is read as a file is.
"""

from __future__ import annotations

import errno
import logging
import os
import select
import stat
import threading
from pathlib import Path

from gpuwarden.collect.kernel_log import MAX_LINE_BYTES, KernelLogTally

log = logging.getLogger(__name__)

READ_BYTES = 16384  # larger than any kmsg record (a smaller buffer makes the read fail with EINVAL)
WAIT_S = 1.0
RETRY_S = 60.0
MISSING_RETRY_S = 1.0  # a path not there yet: the Helm chart's relay makes its pipe as the pod starts


class KernelLogFollower:
    def __init__(self, path: Path, tally: KernelLogTally) -> None:
        self.path = path
        self.tally = tally
        self.unavailable: str | None = None  # why the log cannot be read, once said
        self.reading = False  # open (a pipe: with its writer, the relay), devices known: gpuwarden_kernel_log_up
        self.lost = 0  # times the kernel's ring overtook this reader (EPIPE)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="gpuwarden-kernel-log", daemon=True)
        self._pending = b""
        self._skipping = False  # inside a line longer than MAX_LINE_BYTES: dropped up to its end
        self.caught_up = threading.Event()  # set once the log from boot has been read (the first empty read)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()

    def join(self, timeout: float | None = None) -> None:
        self._thread.join(timeout)

    def _run(self) -> None:
        while not self.tally.devices.ready.wait(WAIT_S):  # the GPUs not known yet: NVML's discovery is under way
            if self._stop.is_set():
                return
        while not self._stop.is_set():
            try:
                fd = os.open(self.path, os.O_RDONLY | os.O_NONBLOCK)
            except OSError as exc:
                self._say_unavailable(exc)
                self._stop.wait(MISSING_RETRY_S if exc.errno == errno.ENOENT else RETRY_S)
                continue
            self.unavailable = None
            try:
                self.reading = True
                self._follow(fd)
            except OSError as exc:
                self.reading = False
                self._say_unavailable(exc)
                self._stop.wait(RETRY_S)
            except Exception:  # a bug must not end the reading for the life of the process
                self.reading = False
                log.exception("kernel log: reading %s failed; starting again", self.path)
                self._stop.wait(RETRY_S)
            finally:
                self.reading = False
                os.close(fd)

    def _say_unavailable(self, exc: OSError) -> None:
        reason = f"{self.path}: {exc.strerror or exc}"
        if exc.errno in (errno.EPERM, errno.EACCES):
            reason += " (kernel.dmesg_restrict is 1: the exporter needs CAP_SYSLOG, or turn the kernel log off)"
        if reason != self.unavailable:
            log.warning("kernel log not read: %s; XIDs from before the start stay unknown", reason)
        self.unavailable = reason

    def _follow(self, fd: int) -> None:
        mode = os.fstat(fd).st_mode
        device, pipe = stat.S_ISCHR(mode), stat.S_ISFIFO(mode)
        poller = select.poll()
        poller.register(fd, select.POLLIN)
        while not self._stop.is_set():
            try:
                chunk = os.read(fd, READ_BYTES)
            except BlockingIOError:
                chunk = None
            except BrokenPipeError:  # the ring overwrote records before they were read: go on from the oldest left
                self.lost += 1
                continue
            if pipe:  # the relay's pipe: nothing to read now with a writer there, end of file without one
                self.reading = chunk != b""
            if chunk:
                self._feed(chunk)
                continue
            self.caught_up.set()
            if device:
                poller.poll(WAIT_S * 1000)  # the next record, or a second to look at the stop flag
            else:
                self._stop.wait(WAIT_S)  # a file at its end: look again for what was appended

    def _feed(self, chunk: bytes) -> None:
        data = self._pending + chunk
        lines = data.split(b"\n")
        self._pending = lines.pop()
        for line in lines:
            if self._skipping:  # the end of an overlong line
                self._skipping = False
                continue
            self.tally.add_line(line)
        if len(self._pending) > MAX_LINE_BYTES:  # a line longer than any record: drop it as it comes, count it once
            if not self._skipping:
                self.tally.add_line(self._pending)  # counted as unparsed (too long)
            self._pending = b""
            self._skipping = True
