"""The simulated host's /proc: a scenario's host processes written as the entries the job view reads.

The simulated host's /proc: a scenario's `host_processes` written as the entries the job view reads (stat, status,
comm, cmdline, environ, cgroup, io, the main thread's state and the children of each process), in a folder the
exporter reads as the host's /proc where `processes.proc_root` is unset (runtime/pipeline.py). The scenario's GPU
processes are the simulated ranks; their launchers, supervisors and co-tenants are entries here too. Written on first
use, removed at exit; PID 1 (root's init) is there too, so the job view's start line reads what it would on a host.
"""

from __future__ import annotations

import atexit
import shutil
import tempfile
import threading
from collections import defaultdict
from pathlib import Path

from gpuwarden.sim.host_spec import HostProcessSpec
from gpuwarden.sim.scenario import Scenario

INIT = HostProcessSpec(pid=1, ppid=0, comm="systemd", cmdline=("/sbin/init",), uid=0, cgroup="0::/init.scope")


def _nul(parts: list[str]) -> bytes:
    return b"".join(part.encode() + b"\0" for part in parts)


def write_process(root: Path, spec: HostProcessSpec, children: list[int]) -> None:
    base = root / str(spec.pid)
    task = base / "task" / str(spec.pid)
    task.mkdir(parents=True, exist_ok=True)
    # the start time (field 22) in PID order: a launcher starts its workers one after the other
    tail = f"0 -1 4194560 0 0 0 0 0 0 0 0 20 0 1 0 {spec.pid} 0 0"
    (base / "stat").write_text(f"{spec.pid} ({spec.comm}) S {spec.ppid} {spec.pid} {spec.session} {tail}\n")
    (task / "stat").write_text(f"{spec.pid} ({spec.comm}) {spec.state} {spec.ppid} {spec.pid} {spec.session} {tail}\n")
    (task / "children").write_text("".join(f"{child} " for child in children))
    (base / "comm").write_text(spec.comm + "\n")
    (base / "status").write_text(
        f"Name:\t{spec.comm}\nState:\t{spec.state}\nPid:\t{spec.pid}\nPPid:\t{spec.ppid}\n"
        f"Uid:\t{spec.uid}\t{spec.uid}\t{spec.uid}\t{spec.uid}\n"
    )
    (base / "cmdline").write_bytes(_nul(list(spec.cmdline or (spec.comm,))))
    (base / "environ").write_bytes(_nul([f"{name}={value}" for name, value in spec.environ.items()]))
    (base / "cgroup").write_text(spec.cgroup.rstrip("\n") + "\n")
    (base / "io").write_text("rchar: 0\nwchar: 0\nread_bytes: 0\nwrite_bytes: 0\n")


def write_tree(root: Path, specs: tuple[HostProcessSpec, ...]) -> None:
    """Every process of `specs` (and init) under `root`, each parent listing its children in PID order."""
    (root / "self").mkdir(parents=True, exist_ok=True)
    everyone = {spec.pid: spec for spec in (INIT, *specs)}
    children: dict[int, list[int]] = defaultdict(list)
    for spec in sorted(everyone.values(), key=lambda s: s.pid):
        if spec.ppid in everyone:
            children[spec.ppid].append(spec.pid)
    for spec in everyone.values():
        write_process(root, spec, children[spec.pid])


class SimulatedHostProc:
    """The scenario's host processes as a /proc folder, written on first use (a GPM child never asks)."""

    def __init__(self, scenario: Scenario) -> None:
        self.scenario = scenario
        self._path: Path | None = None
        self._lock = threading.Lock()

    def path(self) -> str:
        """The folder; "" when the scenario describes no host process (the exporter then reads no /proc)."""
        if not self.scenario.host_processes:
            return ""
        with self._lock:
            if self._path is None:
                self._path = Path(tempfile.mkdtemp(prefix="gpuwarden-sim-proc-"))
                write_tree(self._path, self.scenario.host_processes)
                atexit.register(shutil.rmtree, self._path, True)
        return str(self._path)
