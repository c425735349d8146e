"""`gpuwarden kernel-log-relay`: hands the host's kernel log to an unprivileged exporter through a named pipe.

Reading /dev/kmsg in a pod takes what the exporter must not have: the device (a container's device cgroup admits a
mounted /dev/kmsg only in a privileged container) and CAP_SYSLOG where `kernel.dmesg_restrict` is 1 (which a
non-root process never holds in effect, as Kubernetes sets no ambient capabilities). So the Helm chart runs this, a
second container of the pod that listens on nothing, privileged; the exporter, which every pod can reach, keeps
every capability dropped and reads the pipe (`nvml.kernel_log`) as it would read /dev/kmsg.

Each reader gets the log from boot: when the reader goes (the exporter restarted), the pipe's write end reports an
error (POLLERR) at once, and the relay reopens the pipe, waits for the next reader and reads /dev/kmsg from its
oldest record again. A relay that restarts while the exporter keeps reading sends records the exporter has
counted: it skips them by their sequence numbers (collect/kernel_log.py). Memory: one record at a time, and the
pipe's buffer (64 KiB) between the two.
"""

from __future__ import annotations

import contextlib
import errno
import os
import select
import signal
import stat
import sys
from pathlib import Path

from gpuwarden.commandline import EXIT_CONFIG, ConfigError, OneLineParser

READ_BYTES = 16384  # larger than any kmsg record (a smaller buffer makes the read fail with EINVAL)
RETRY_S = 60.0  # an unreadable source is tried again this often
FILE_WAIT_S = 0.5  # a source that is a regular file (tests, a saved log), at its end: how often to look for more


def build_parser() -> OneLineParser:
    parser = OneLineParser(
        prog="gpuwarden kernel-log-relay",
        hint="; see gpuwarden kernel-log-relay --help",
        description="Copy the kernel log into a named pipe the exporter reads (nvml.kernel_log): the privileged "
        "part of reading it, in a container of its own.",
    )
    parser.add_argument("--fifo", type=Path, required=True, metavar="PATH", help="The named pipe (made if missing).")
    parser.add_argument("--source", type=Path, default=Path("/dev/kmsg"), metavar="PATH", help="Default /dev/kmsg.")
    return parser


class Relay:
    """Copies `source` into `fifo`, from the oldest record, once per reader of the pipe."""

    def __init__(self, source: Path, fifo: Path) -> None:
        self.source, self.fifo = source, fifo
        self.readers = 0  # readers served (each got the log from boot)
        self._unavailable = ""

    def make_fifo(self) -> None:
        """Make the pipe; an existing path must be one (ConfigError otherwise: it would be overwritten)."""
        try:
            os.mkfifo(self.fifo, 0o644)
        except FileExistsError:
            if not stat.S_ISFIFO(os.stat(self.fifo).st_mode):
                raise ConfigError(f"--fifo {self.fifo}: exists and is not a named pipe; give a new path") from None
        except OSError as exc:
            raise ConfigError(f"--fifo {self.fifo}: {exc.strerror}; give a path in a writable folder") from None

    def run(self) -> None:
        while True:
            pipe = os.open(self.fifo, os.O_WRONLY)  # blocks until a reader opens the pipe
            try:
                self.readers += 1
                self._serve(pipe)
            finally:
                os.close(pipe)

    def _serve(self, pipe: int) -> None:
        """Copy the log from boot until the reader goes."""
        while True:
            try:
                source = os.open(self.source, os.O_RDONLY | os.O_NONBLOCK)
            except OSError as exc:
                self._say_unavailable(exc)
                if self._reader_gone(pipe, RETRY_S):
                    return
                continue
            self._unavailable = ""
            try:
                if self._copy(source, pipe):
                    return
            finally:
                os.close(source)
            if self._reader_gone(pipe, RETRY_S):  # the source failed while read: not at once again
                return

    def _copy(self, source: int, pipe: int) -> bool:
        """Copy until the reader goes (True) or the source fails (False: reopened)."""
        device = stat.S_ISCHR(os.fstat(source).st_mode)
        poller = select.poll()
        poller.register(pipe, 0)  # POLLERR and POLLHUP are always reported: the reader went
        if device:
            poller.register(source, select.POLLIN)
        while True:
            try:
                chunk = os.read(source, READ_BYTES)
            except BlockingIOError:
                chunk = None
            except BrokenPipeError:  # the kernel's ring overwrote records before they were read: go on
                continue
            except OSError as exc:
                self._say_unavailable(exc)
                return False
            if chunk:
                try:
                    os.write(pipe, chunk)  # blocks while the pipe is full: the reader sets the pace
                except BrokenPipeError:
                    return True
                continue
            events = poller.poll(None if device else FILE_WAIT_S * 1000)
            if any(fd == pipe for fd, _ in events):
                return True

    def _reader_gone(self, pipe: int, wait_s: float) -> bool:
        poller = select.poll()
        poller.register(pipe, 0)
        return bool(poller.poll(wait_s * 1000))

    def _say_unavailable(self, exc: OSError) -> None:
        reason = f"{self.source}: {exc.strerror or exc}"
        if exc.errno in (errno.EPERM, errno.EACCES):
            reason += " (this container needs the device and CAP_SYSLOG: privileged)"
        if reason != self._unavailable:
            print(f"gpuwarden kernel-log-relay: cannot read {reason}; retrying every {RETRY_S:g} s", file=sys.stderr)
        self._unavailable = reason


def main(argv: list[str]) -> int:
    try:
        args = build_parser().parse_args(argv)
        relay = Relay(args.source, args.fifo)
        relay.make_fifo()
    except ConfigError as exc:
        print(f"gpuwarden kernel-log-relay: {exc}", file=sys.stderr)
        return EXIT_CONFIG
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    with contextlib.suppress(KeyboardInterrupt):
        relay.run()
    return 0
