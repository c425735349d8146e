"""What the host knows of a GPU process: its name and the pod and container whose cgroup holds it.

NVML reports host PIDs. Their names (`/proc/PID/comm`) and cgroups (`/proc/PID/cgroup`, which carry the pod UID and
the container ID under the kubelet's cgroup layout, systemd or cgroupfs driver) need the host's /proc: on bare metal
or under systemd that is /proc; in a pod, the host's /proc mounted read-only (the Helm value
`processes.hostProc`), the trade-off documented in docs/deploy.md. The pod's namespace and name come from the
kubelet's log directory, `/var/log/pods/<namespace>_<pod>_<uid>/<container>/` (the CRI logging layout), mounted
read-only beside it. Without either, gpuwarden falls back on the GPU's allocation
(exporter/gpuwarden/attribution/processes.py). Reads are bounded (a cgroup file is read up to 64 KiB) and cached per PID
until the PID leaves the GPU.

Two lookups can block for as long as the host lets them: a user name (`getpwuid` goes through NSS, which is SSSD or
LDAP on many Slurm clusters) and the listing of the pod-log directory (up to 10,000 entries). The assembly step runs
under the publication and NVML locks, so both run on a lookup thread of their own (`BackgroundLookups`); the
assembly reads what has been found and never waits. A process whose user is not known yet is counted as in no job
for that snapshot (its job's series start one snapshot later, with the name), never under a UID that then changes.
"""

from __future__ import annotations

import logging
import pwd
import queue
import re
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)

_POD_UID = re.compile(r"pod([0-9a-f]{8}[-_][0-9a-f]{4}[-_][0-9a-f]{4}[-_][0-9a-f]{4}[-_][0-9a-f]{12})")
_CONTAINER_ID = re.compile(r"([0-9a-f]{64})")
_PRINTABLE = re.compile(r"[^\x21-\x7e]")
# Slurm's cgroup layouts: v1 /slurm/uid_1000/job_123/step_0/task_0 (per controller), v2
# /system.slice/slurmstepd.scope/job_123/step_0/user/task_0 (the node name prefixes slurm/slurmstepd on multi-slurmd
# hosts). Anchored at the root of the hierarchy, which only root (slurmstepd) writes: a user with a delegated subtree
# (user@UID.service) can make .../slurmstepd.scope/job_N/... below it, never at the root. A reader in a cgroup namespace
# (a pod) sees host paths with leading /.. segments.
_SLURM_V2 = re.compile(
    r"^0::(?:/\.\.)*/system\.slice/(?:[^/\n]+_)?slurmstepd\.scope/job_(\d+)/step_(\w+?)(?:/user)?(?:/task_(\w+))?/?$",
    re.MULTILINE,
)
_SLURM_V1 = re.compile(
    r"^\d+:[^:\n]*:(?:/\.\.)*/slurm(?:_[^/\n]+)?/uid_(\d+)/job_(\d+)/step_(\w+?)(?:/task_(\w+))?/?$", re.MULTILINE
)
_MAX_READ = 64 * 1024
RESCAN_S = 5.0  # the pod log directory is listed again for an unknown UID at most this often
MAX_USER_NAMES = 10_000  # user names remembered (a node runs far fewer users' jobs)


class BackgroundLookups:
    """Lookups that may block, run one at a time on a daemon thread of their own: a hung directory service holds
    this thread only (and never the process's exit). `submit` returns at once; a key already queued is not queued
    again."""

    def __init__(self) -> None:
        self._queue: queue.SimpleQueue[tuple[str, Callable[[], None]]] = queue.SimpleQueue()
        self._queued: set[str] = set()
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)
        self._thread: threading.Thread | None = None

    def submit(self, key: str, job: Callable[[], None]) -> None:
        with self._lock:
            if key in self._queued:
                return
            self._queued.add(key)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="gpuwarden-host-lookups", daemon=True)
                self._thread.start()
        self._queue.put((key, job))

    def pending(self) -> bool:
        with self._lock:
            return bool(self._queued)

    def wait_idle(self, timeout: float) -> bool:
        """Wait until nothing is queued or running (the synchronous poll of tests and tools); False on timeout."""
        with self._idle:
            return self._idle.wait_for(lambda: not self._queued, timeout)

    def _run(self) -> None:
        while True:
            key, job = self._queue.get()
            try:
                job()
            except Exception:  # noqa: BLE001 - a lookup's failure must not end the thread
                log.exception("host lookup %s failed", key)
            finally:
                with self._lock:
                    self._queued.discard(key)
                    self._idle.notify_all()


@dataclass(frozen=True)
class HostProcess:
    """What the host's /proc says of a PID: its name and the pod and container of its cgroup."""

    name: str  # /proc/PID/comm, "" where the host's /proc does not show the PID
    pod_uid: str | None
    container_id: str | None
    slurm_job: str = ""  # the Slurm job ID whose step holds the process ("" outside Slurm)
    slurm_user: str = ""  # the job's user (name where the host knows it, else the UID)


@dataclass(frozen=True)
class PodDirectory:
    """A pod as the kubelet's log directory names it, with its containers."""

    namespace: str
    pod: str
    containers: tuple[str, ...]  # container names with a log directory


def _read(path: Path) -> str:
    try:
        with path.open("rb") as handle:
            return handle.read(_MAX_READ).decode("utf-8", "replace")
    except OSError:
        return ""


@dataclass(frozen=True)
class SlurmStep:
    """Where slurmstepd put a process: its job, step (a number, or batch, extern, interactive), the task's local ID
    ("" where the layout names none) and the job's UID where the path names it (v1)."""

    job: str
    step: str
    task: str = ""
    uid: str | None = None


def parse_slurm_step(text: str) -> SlurmStep | None:
    """The Slurm step of a /proc/PID/cgroup text; None outside one (or in a look-alike path below the root)."""
    found = _SLURM_V2.search(text)
    if found is not None:
        return SlurmStep(found.group(1), found.group(2), found.group(3) or "")
    found = _SLURM_V1.search(text)
    if found is not None:
        return SlurmStep(found.group(2), found.group(3), found.group(4) or "", found.group(1))
    return None


def parse_slurm(text: str) -> tuple[str, str | None]:
    """(Slurm job ID, UID where the path names it) from a /proc/PID/cgroup text; ("", None) outside a Slurm job."""
    step = parse_slurm_step(text)
    return ("", None) if step is None else (step.job, step.uid)


def _uid(uid: str | None, status: str) -> str | None:
    """The job's UID: from the cgroup path (v1), else from /proc/PID/status."""
    if uid is None:
        for line in status.splitlines():
            if line.startswith("Uid:"):
                fields = line.split()
                return fields[1] if len(fields) > 1 else None
    return uid


def user_name(uid: str) -> str:
    """A UID as a name where the host has one, else the UID itself (may block: NSS)."""
    try:
        return pwd.getpwuid(int(uid)).pw_name
    except (KeyError, ValueError, OverflowError):
        return uid


def parse_cgroup(text: str) -> tuple[str | None, str | None]:
    """(pod UID, container ID) from a /proc/PID/cgroup text, either or both None outside a pod."""
    pod = _POD_UID.search(text)
    containers = _CONTAINER_ID.findall(text)
    return (pod.group(1).replace("_", "-") if pod else None), (containers[-1] if containers else None)


class HostProcesses:
    """Lookups of host PIDs and pod UIDs; used by the assembly step only (one thread)."""

    def __init__(self, proc_root: Path | None, pod_logs_root: Path | None, clock=time.monotonic) -> None:  # noqa: ANN001
        if proc_root is not None and not (proc_root / "self").exists():
            log.warning(
                "processes.proc_root %s is not a /proc (no %s/self): GPU processes stay unnamed and are attributed "
                "through the GPU's allocation only; mount the host's /proc there read-only (Helm: processes.hostProc)",
                proc_root,
                proc_root,
            )
        self.proc_root = proc_root
        self.pod_logs_root = pod_logs_root
        self._clock = clock
        self._processes: dict[int, HostProcess] = {}
        self._pods: dict[str, PodDirectory] = {}
        self._scanned_at = float("-inf")
        self._user_names: dict[str, str] = {}
        self.lookups = BackgroundLookups()

    def process(self, pid: int) -> HostProcess:
        known = self._processes.get(pid)
        if known is not None:
            return known
        if self.proc_root is None:
            found = HostProcess("", None, None)
        else:
            base = self.proc_root / str(pid)
            name = _PRINTABLE.sub("", _read(base / "comm").strip())[:64]
            cgroup = _read(base / "cgroup")
            pod_uid, container_id = parse_cgroup(cgroup)
            job, uid = parse_slurm(cgroup)
            uid = _uid(uid, _read(base / "status")) if job else None
            user = self._user_name(uid) if uid is not None else ""
            if user is None:  # the name is being looked up: in no job for this snapshot, asked again next time
                return HostProcess(name, pod_uid, container_id)
            found = HostProcess(name, pod_uid, container_id, job, user)
            if not name and pod_uid is None:
                return found  # not visible (yet): asked again next time, not cached
        self._processes[pid] = found
        return found

    def retain(self, pids: set[int]) -> None:
        """Forget PIDs no GPU holds any more (a PID reused later is looked up afresh)."""
        for pid in [p for p in self._processes if p not in pids]:
            del self._processes[pid]

    def _user_name(self, uid: str) -> str | None:
        """The UID's name if known; None while it is looked up on the lookup thread."""
        known = self._user_names.get(uid)
        if known is not None:
            return known

        def look_up() -> None:
            if len(self._user_names) >= MAX_USER_NAMES:
                self._user_names.clear()
            self._user_names[uid] = user_name(uid)

        self.lookups.submit(f"user {uid}", look_up)
        return None

    def pod(self, uid: str) -> PodDirectory | None:
        """The pod a UID names, as last listed; an unknown UID has the directory listed again on the lookup thread
        (at most every RESCAN_S seconds), and is answered from the next snapshot on."""
        if uid not in self._pods and self.pod_logs_root is not None and self._clock() - self._scanned_at >= RESCAN_S:
            self._scanned_at = self._clock()
            self.lookups.submit("pod logs", self._scan)
        return self._pods.get(uid)

    def _scan(self) -> None:
        pods: dict[str, PodDirectory] = {}
        try:
            entries = list(self.pod_logs_root.iterdir()) if self.pod_logs_root else []
        except OSError:
            entries = []
        for entry in entries[:10_000]:
            parts = entry.name.split("_")
            if len(parts) != 3:
                continue
            namespace, pod, uid = parts
            try:
                containers = tuple(sorted(child.name for child in entry.iterdir() if child.is_dir()))
            except OSError:
                containers = ()
            pods[uid] = PodDirectory(namespace, pod, containers)
        self._pods = pods
