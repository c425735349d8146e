"""`gpuwarden kernel-log-relay` (issue 39): the privileged part of reading the kernel log, in a process of its own,
handing it to an unprivileged exporter through a named pipe. Real processes: the relay and the exporter (the
simulator beneath the real pynvml) as the Helm chart runs them, a kmsg file (the lent H200's boot log and an XID) as
the source: no device here can be read as /dev/kmsg is on a GPU host, so a file stands in for it."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from contextlib import contextmanager, suppress
from pathlib import Path

import pytest

from tests.helpers.common import parse_exposition, wait_for
from tests.helpers.daemon import running_cli
from tests.test_kernel_log import H200_BOOT, kmsg

XID_GPU1 = "NVRM: Xid (PCI:0000:28:00): 13, pid=77, name=python, Graphics Exception"  # the simulator's GPU 1


@contextmanager
def relay(fifo: Path, source: Path):
    proc = subprocess.Popen(
        [sys.executable, "-m", "gpuwarden", "kernel-log-relay", "--fifo", str(fifo), "--source", str(source)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        wait_for(lambda: fifo.exists() or proc.poll() is not None, timeout=30)
        yield proc
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def xids(url: str) -> dict:
    import httpx

    series = parse_exposition(httpx.get(url + "/metrics", timeout=10).text)
    return {dict(labels)["xid"]: v for (name, labels), v in series.items() if name == "gpuwarden_xid_errors_total"}


def kernel_log_up(url: str) -> float | None:
    import httpx

    return parse_exposition(httpx.get(url + "/metrics", timeout=10).text).get(("gpuwarden_kernel_log_up", frozenset()))


@pytest.mark.slow  # exporters and the relay as processes: the whole suite's
def test_each_exporter_start_gets_the_log_from_boot_and_a_relay_restart_counts_nothing_twice(tmp_path):
    """An exporter reading the pipe counts the XID logged before it started; restarted, it counts it again from the
    log (once: 1, not 0); a relay restarted under a running exporter sends the log from boot again, and the exporter
    skips what it counted; a record logged later is counted once. gpuwarden_kernel_log_up is 0 while no relay
    writes into the pipe."""
    source, fifo = tmp_path / "kmsg", tmp_path / "run" / "kmsg.fifo"
    fifo.parent.mkdir()
    source.write_bytes(H200_BOOT.read_bytes() + kmsg(900, time.monotonic() - 5, XID_GPU1))
    flags = ("--sim", "--nvml.scenario", "healthy", "--nvml.kernel-log", str(fifo))
    with relay(fifo, source) as first_relay:
        with running_cli(*flags) as (url, _):
            wait_for(lambda: xids(url).get("13") == 1, timeout=30)
        with running_cli(*flags) as (url, _):  # the exporter restarted: the pipe's reader is new
            wait_for(lambda: xids(url).get("13") == 1, timeout=30)
            assert kernel_log_up(url) == 1
            first_relay.terminate()
            first_relay.wait(timeout=10)
            wait_for(lambda: kernel_log_up(url) == 0, timeout=30)  # no relay writes into the pipe: not reading
            with relay(fifo, source):  # the relay restarted: the log from boot again, every record already counted
                with source.open("ab") as log:
                    log.write(kmsg(901, time.monotonic(), XID_GPU1))
                wait_for(lambda: xids(url).get("13") == 2, timeout=30)
                assert xids(url) == {"13": 2} and kernel_log_up(url) == 1


def test_a_path_that_is_not_a_pipe_is_refused_in_one_line(tmp_path):
    taken = tmp_path / "taken"
    taken.write_text("a file")
    result = subprocess.run(
        [sys.executable, "-m", "gpuwarden", "kernel-log-relay", "--fifo", str(taken)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2 and len(lines) == 1 and "is not a named pipe" in lines[0], result.stderr
    assert taken.read_text() == "a file"


@pytest.mark.slow  # exporters and the relay as processes: the whole suite's
def test_an_unreadable_source_is_said_once_and_the_exporter_serves(tmp_path):
    """The source cannot be opened (here: missing; on a host, /dev/kmsg without the device or CAP_SYSLOG): the relay
    says why once, on stderr, and waits; the exporter behind the pipe serves its metrics meanwhile."""
    fifo = tmp_path / "kmsg.fifo"
    with relay(fifo, tmp_path / "missing") as proc:
        with running_cli("--sim", "--nvml.scenario", "healthy", "--nvml.kernel-log", str(fifo)) as (url, _):
            assert xids(url) == {}
        proc.terminate()
        _, stderr = proc.communicate(timeout=10)
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "cannot read" in lines[0] and "missing" in lines[0], stderr
    assert os.path.exists(fifo)


@pytest.mark.slow  # exporters and the relay as processes: the whole suite's
def test_an_exporter_started_before_the_relay_made_its_pipe_reads_it_once_made(tmp_path):
    """The pod's containers start in any order: the exporter that finds no pipe yet says so and looks again every
    second (every minute for a log it may not read), so the log arrives as soon as the relay has made the pipe."""
    source, fifo = tmp_path / "kmsg", tmp_path / "kmsg.fifo"
    source.write_bytes(kmsg(1, time.monotonic() - 5, XID_GPU1))
    with running_cli("--sim", "--nvml.scenario", "healthy", "--nvml.kernel-log", str(fifo)) as (url, _):
        assert xids(url) == {}
        with relay(fifo, source):
            wait_for(lambda: xids(url).get("13") == 1, timeout=30)


def _first_records(fifo: Path, count: int) -> list[bytes]:
    """Open the pipe as the exporter does (non-blocking), read `count` records, close it."""
    records: list[bytes] = []
    fd = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK)
    try:
        pending = b""

        def more() -> bool:
            nonlocal pending
            with suppress(BlockingIOError):
                pending += os.read(fd, 65536)
            return pending.count(b"\n") >= count

        wait_for(more, timeout=30, step=0.05)
        records = pending.split(b"\n")[:count]
    finally:
        os.close(fd)
    return records


@pytest.mark.slow  # exporters and the relay as processes: the whole suite's
def test_on_this_hosts_dev_kmsg_each_new_reader_gets_the_log_from_boot(tmp_path):
    """The relay on the real /dev/kmsg (a character device: it waits in poll() for a record or for the reader to
    go): a reader that goes is seen at once, with no new kernel record needed (the relay lets go of the pipe), and
    the next reader gets the log from its oldest record again (the same first sequence numbers). A reader back
    within microseconds, before the relay has seen it go, would get the rest of the old stream; an exporter's
    restart takes seconds."""
    try:
        os.close(os.open("/dev/kmsg", os.O_RDONLY | os.O_NONBLOCK))
    except OSError as exc:
        pytest.skip(f"/dev/kmsg cannot be read here ({exc.strerror}): the device branch runs on GPU hosts only")
    fifo = tmp_path / "kmsg.fifo"
    with relay(fifo, Path("/dev/kmsg")) as proc:

        def holds_pipe() -> bool:
            with suppress(OSError):
                return any(link.resolve() == fifo for link in Path(f"/proc/{proc.pid}/fd").iterdir())
            return False

        first = _first_records(fifo, 3)
        wait_for(lambda: not holds_pipe(), timeout=30, step=0.05)  # it saw the reader go: waits for the next
        second = _first_records(fifo, 3)
    assert first == second and all(b";" in record for record in first), (first, second)
