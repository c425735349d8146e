"""A gpuwarden command (the exporter, `gpuwarden fleet`) as a process of its own on a loopback port: started, waited
for until it answers, stopped. The one way tests and bench/ start one (bench runs as `python -m bench.NAME`), so it
imports nothing beyond the standard library and httpx: no pytest, no gpuwarden."""

from __future__ import annotations

import itertools
import os
import random
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Any

import httpx

PORT_BLOCK = 1500  # ports per test worker, below the kernel's ephemeral range (32768-60999 by default)
# each session starts at its own place in the block: two sessions on one machine (a developer's run beside a
# stress loop's) took the same ports in the same order, and one test's /api/v1/fleet reached the other's exporter
_port_offset = itertools.count(random.randrange(PORT_BLOCK))


def free_port() -> int:
    """A loopback port for a server a test starts, that neither another pytest-xdist worker nor an outgoing
    connection can take between this call and the bind: each worker hands out its own block below the ephemeral
    range (a port from bind(0) can be given to a client socket a moment later), each port once per process. A
    session without workers (the serial phase, a developer's single run) takes the last block, so that it does not
    share worker 0's with a 4-worker run beside it (seen: another session's server answered a test's /healthz)."""
    worker = os.environ.get("PYTEST_XDIST_WORKER", "").removeprefix("gw")
    base = 20000 + (int(worker) % 7 if worker.isdigit() else 7) * PORT_BLOCK
    for _ in range(PORT_BLOCK):
        port = base + next(_port_offset) % PORT_BLOCK
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:  # in use, or still in TIME_WAIT from an earlier run
                continue
            return port
    raise RuntimeError(f"no free loopback port in {base}-{base + PORT_BLOCK - 1}")


def wait_ready(
    url: str,
    timeout: float = 60,  # a start on a starved 2-core machine took over 30 s
    step: float = 0.1,
    verify: Any = False,  # noqa: FBT002 - httpx's own argument: False, or an SSLContext (a client certificate)
    gone: Callable[[], str | None] = lambda: None,
) -> None:
    """Until `url` answers 200; RuntimeError after `timeout` s, or at once when `gone()` says why it never will
    (the process serving it exited). One client for all the tries: `httpx.get` builds a client per call, three
    times the CPU of the wait, taken from the process being waited for on a 2-core machine."""
    deadline = time.monotonic() + timeout
    no_reuse = httpx.Limits(max_keepalive_connections=0)  # each try a new connection, as a probe makes
    with httpx.Client(verify=verify, timeout=1, limits=no_reuse) as client:  # noqa: S501 - a test's own certificate
        while time.monotonic() < deadline:
            try:
                if client.get(url).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            if (why := gone()) is not None:
                raise RuntimeError(f"{url} will not answer: {why}")
            time.sleep(step)
    raise RuntimeError(f"{url} not ready after {timeout:g} s")


class Daemon:
    """A gpuwarden process and its base URL; unpacks as `(url, proc)`."""

    def __init__(self, url: str, proc: subprocess.Popen, args: Sequence[str], log: Path | None) -> None:
        self.url, self.proc, self.args, self.log = url, proc, tuple(args), log

    def __iter__(self) -> Iterator[Any]:
        return iter((self.url, self.proc))

    @property
    def port(self) -> int:
        return int(self.url.rsplit(":", 1)[1])

    def wait(self, ready: str = "/healthz", timeout: float = 60, step: float = 0.1, verify: Any = False) -> Daemon:
        """Until `ready` answers 200. A process that exits first or never answers is stopped, and RuntimeError
        says so with its exit code and the end of its output."""

        def gone() -> str | None:
            return None if self.proc.poll() is None else f"exit {self.proc.returncode}"

        try:
            wait_ready(self.url + ready, timeout=timeout, step=step, verify=verify, gone=gone)
        except RuntimeError as failed:
            self.stop()
            raise RuntimeError(f"gpuwarden {' '.join(self.args)}: {failed}\n{self.output()[-1500:]}") from None
        return self

    def stop(self, timeout: float = 10) -> int | None:
        """SIGTERM, as a kubelet or systemd stops it; SIGKILL if it outlives `timeout`. Its exit code (None when
        killed)."""
        if self.proc.poll() is None:
            self.proc.terminate()
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            return None

    def output(self) -> str:
        """What the process wrote to its log or its piped stderr: call it once the process has ended."""
        if self.log is not None:
            return self.log.read_text(errors="replace")
        return self.proc.stderr.read() if self.proc.stderr is not None else ""


def spawn_daemon(
    *args: str,
    port: int | None = None,
    env: Mapping[str, str] | None = None,
    log: Path | None = None,
    stderr: int | IO[Any] | None = subprocess.PIPE,
    command: Sequence[str] | None = None,
    python_flags: Sequence[str] = (),
    tls: bool = False,
    cgroup: Any = None,
    cwd: Path | None = None,
) -> Daemon:
    """`gpuwarden ARGS --web.listen-address 127.0.0.1:PORT` started, not yet waited for (see start_daemon). The
    environment is this process's without GPUWARDEN_* (a developer's own settings never leak in), plus `env`.
    Output: into `log` (stdout and stderr), else stderr as given (piped as text by default: readable once the
    process ended; one that logs much for long fills the pipe, give it a log). `command` runs gpuwarden (default
    this interpreter with `python_flags`, `-m gpuwarden`; e.g. an installed console script, with `cwd` outside
    the checkout). `cgroup` (tests/helpers/cgroup.py) is joined before the exec."""
    port = port or free_port()
    argv = [*(command or (sys.executable, *python_flags, "-m", "gpuwarden")), *args]
    argv += ["--web.listen-address", f"127.0.0.1:{port}"]
    environ = {k: v for k, v in os.environ.items() if not k.startswith("GPUWARDEN_")} | dict(env or {})
    sink = log.open("wb") if log is not None else None
    proc = subprocess.Popen(
        argv,
        stdout=sink or subprocess.DEVNULL,
        stderr=subprocess.STDOUT if sink else stderr,
        text=sink is None,
        env=environ,
        cwd=cwd,
        preexec_fn=cgroup.enter if cgroup is not None else None,  # noqa: PLW1509 - joins the cgroup before exec
    )
    if sink is not None:
        sink.close()  # the child has its own descriptor
    return Daemon(f"{'https' if tls else 'http'}://127.0.0.1:{port}", proc, args, log)


def start_daemon(
    *args: str, ready: str = "/healthz", timeout: float = 60, step: float = 0.1, verify: Any = False, **options: Any
) -> Daemon:
    """spawn_daemon(*args, **options), once `ready` answers 200 (Daemon.wait: `verify` is httpx's, False or an
    SSLContext with a client certificate)."""
    return spawn_daemon(*args, **options).wait(ready, timeout=timeout, step=step, verify=verify)


@contextmanager
def running_cli(*args: str, **options: Any) -> Iterator[Daemon]:
    """start_daemon(*args, **options) for the block, stopped after it. Yields the Daemon, which unpacks as
    `(url, proc)`; its piped stderr can be read once the block ended."""
    daemon = start_daemon(*args, **options)
    try:
        yield daemon
    finally:
        daemon.stop()
