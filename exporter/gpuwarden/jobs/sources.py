"""Which sources of job identity work on this node, as the job view last found them.

Which sources of job identity work on this node, as the job view last found them: the process's cgroup and its
launcher's command line (any user may read them, where the host's /proc is mounted and shows other users'
processes), its environment (the same UID or CAP_SYS_PTRACE), and the pod API (jobs/pod_api.py, where configured).
Probed once at start on PID 1 (root's, so what an unprivileged exporter can read of it is what it can read of any
user's process), logged in one line, then kept up to date by every read of a GPU process; exported as
gpuwarden_job_identity_source_up{source}."""

from __future__ import annotations

import logging
import threading
from pathlib import Path

from gpuwarden.jobs import launchers, procfs

log = logging.getLogger(__name__)

CGROUP, CMDLINE, ENVIRON, POD_API = "cgroup", "cmdline", "environ", "pod_api"
PROC_SOURCES = (CGROUP, CMDLINE, ENVIRON)
# what is lost without each, for the start line
WITHOUT = {
    CGROUP: "no Slurm job, pod or container scope",
    CMDLINE: "no torchrun or DeepSpeed agent (rank and key from the agent's options)",
    ENVIRON: "launcher variables unread: keys and ranks from the cgroup, the agent's command line and the pod API",
    POD_API: "no pod labels or pod-spec environment",
}


class SourceStates:
    """Per source, whether its last read worked (None: never tried). Written by the jobs step's thread, read by the
    renderer's: a lock around the dictionary."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._up: dict[str, bool] = {}

    def record(self, source: str, up: bool) -> None:
        with self._lock:
            self._up[source] = up

    def forget(self, source: str) -> None:
        with self._lock:
            self._up.pop(source, None)

    def snapshot(self) -> dict[str, bool]:
        with self._lock:
            return dict(self._up)


def probe(proc_root: Path | None, states: SourceStates) -> None:
    """Read PID 1's cgroup, command line and environment under `proc_root`, record what worked, log one line."""
    if proc_root is None:  # the job view is off: no series, one line
        log.info(
            "job identity sources: none from /proc (processes.proc_root is unset): each GPU is a job of its own; "
            "set it to the host's /proc (Helm: processes.hostProc; systemd: ProtectProc=default)"
        )
        return
    init = proc_root / "1"
    if not (init / "stat").exists():
        for source in PROC_SOURCES:
            states.record(source, False)
        log.warning(
            "job identity sources: %s shows no other user's process (hidepid, or systemd's ProtectProc=invisible): "
            "each GPU is a job of its own; mount the host's /proc without hidepid (systemd: ProtectProc=default)",
            proc_root,
        )
        return
    states.record(CGROUP, bool(procfs.read_head(init / "cgroup", procfs.CGROUP_BYTES).data))
    states.record(CMDLINE, not procfs.read_head(init / "cmdline", procfs.CMDLINE_BYTES).denied)
    states.record(ENVIRON, launchers.read_environ(init / "environ") is not None)
    log.info("job identity sources: %s", describe(states.snapshot()))


def describe(up: dict[str, bool]) -> str:
    """'cgroup ok, cmdline ok, environ unreadable (…)': each source and what is lost without it."""
    return ", ".join(
        f"{source} ok" if working else f"{source} unreadable ({WITHOUT[source]})" for source, working in up.items()
    )
