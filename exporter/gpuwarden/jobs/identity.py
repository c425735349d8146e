"""What the host says of one GPU process's job, source by source, from the host's /proc (no hook in the job):

- its cgroup (any user may read it): the pod and container, the Slurm step slurmstepd put it in, else the cgroup
  path; together the *scope* a loopback rendezvous is kept to;
- the Slurm job, only where root vouches for it: the cgroup slurmstepd made (anchored at the hierarchy's root,
  attribution/host.py), or, where Slurm tracks processes without cgroups (proctrack/linuxproc, pgid), a parent that
  is root's `slurmstepd: [JOB.STEP]`. SLURM_JOB_ID in the environment names nothing: any process can set it;
- its parent's command line (any user may read it): a torchrun or DeepSpeed agent (jobs/agents.py), and the
  worker's place among the agent's children (its local rank: the agent starts them in that order);
- its environment's launcher variables (jobs/launchers.py), only where readable: the same UID or CAP_SYS_PTRACE.

Each read is recorded in the source states (jobs/sources.py). An identity is read once per PID: the exec-time
environment never changes, and a launcher's workers keep their parent.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from gpuwarden.attribution.host import SlurmStep, parse_cgroup, parse_slurm_step
from gpuwarden.jobs import agents, launchers, procfs, sources
from gpuwarden.jobs.agents import Agent

SLURMSTEPD_DEPTH = 3  # ancestors looked at for slurmstepd: the task's parent, or the parent of a shell it ran
_SLURMSTEPD_TITLE = re.compile(rb"^slurmstepd: \[(\d+)\.\w+\]")
_CGROUP_LINE = re.compile(r"^(\d+):([^:\n]*):(.*)$", re.MULTILINE)
_MAX_SCOPE = 64


@dataclass(frozen=True)
class Identity:
    """One GPU process as the job view's sources show it."""

    pid: int
    ppid: int
    pod_uid: str = ""
    container_id: str = ""
    cgroup_path: str = ""
    slurm_job: str = ""  # vouched for by slurmstepd (cgroup or parent), "" otherwise
    environ: dict[str, str] | None = None  # the launcher variables; None where unreadable
    agent: Agent | None = None
    local_rank: int | None = None  # the worker's place among its agent's children

    @property
    def scope(self) -> str:
        """Where a loopback address is this process's own: its pod, container, Slurm job, else its cgroup."""
        if self.pod_uid:
            return f"pod/{self.pod_uid}"
        if self.container_id:
            return f"container/{self.container_id[:12]}"
        if self.slurm_job:
            return f"slurm/{self.slurm_job}"
        leaf = self.cgroup_path.rstrip("/").rpartition("/")[2]
        return f"cgroup/{leaf[:_MAX_SCOPE]}" if leaf else ""


def cgroup_path(text: str) -> str:
    """The unified hierarchy's path (cgroup v2), else the systemd controller's, else the first (v1)."""
    lines = {controllers: path for _, controllers, path in _CGROUP_LINE.findall(text)}
    return lines.get("", lines.get("name=systemd", next(iter(lines.values()), "")))


class IdentityReader:
    """Reads identities under the host's /proc, recording which sources worked."""

    def __init__(self, proc_root: Path, states: sources.SourceStates) -> None:
        self._proc_root = proc_root
        self._states = states

    def read(self, pid: int) -> Identity | None:
        """The process's identity, or None where /proc does not show it (gone, or hidden from this user)."""
        if not (self._proc_root / str(pid)).is_dir():
            return None
        stat = procfs.read_stat(self._proc_root, pid) or procfs.Stat("", 0, 0, 0)
        cgroup = self._read(pid, "cgroup", procfs.CGROUP_BYTES, sources.CGROUP)
        pod_uid, container_id = parse_cgroup(cgroup.text)
        step = parse_slurm_step(cgroup.text)
        agent, local_rank = self._agent(stat.ppid, pid)
        environ = launchers.read_environ(self._proc_root / str(pid) / "environ")
        self._states.record(sources.ENVIRON, environ is not None)
        return Identity(
            pid,
            stat.ppid,
            pod_uid or "",
            container_id or "",
            cgroup_path(cgroup.text),
            self._slurm_job(step, stat.ppid),
            environ,
            agent,
            local_rank,
        )

    def _read(self, pid: int, name: str, limit: int, source: str) -> procfs.Read:
        found = procfs.read_head(self._proc_root / str(pid) / name, limit)
        if found.data or found.denied:
            self._states.record(source, not found.denied)
        return found

    def _slurm_job(self, step: SlurmStep | None, ppid: int) -> str:
        """The job slurmstepd put the process in: its cgroup's, else a root-owned slurmstepd ancestor's."""
        if step is not None:
            return step.job
        for _ in range(SLURMSTEPD_DEPTH):
            if ppid <= 1:
                return ""
            base = self._proc_root / str(ppid)
            stat = procfs.read_stat(self._proc_root, ppid)
            if stat is None:
                return ""
            if stat.comm == "slurmstepd":
                status = procfs.read_head(base / "status", procfs.STAT_BYTES).text
                title = _SLURMSTEPD_TITLE.match(procfs.read_head(base / "cmdline", 256).data)
                return title.group(1).decode() if title and procfs.real_uid(status) == "0" else ""
            ppid = stat.ppid
        return ""

    def _agent(self, ppid: int, pid: int) -> tuple[Agent | None, int | None]:
        """The launcher agent that is the process's parent, and the process's place among its workers."""
        if ppid <= 1:
            return None, None
        cmdline = self._read(ppid, "cmdline", procfs.CMDLINE_BYTES, sources.CMDLINE)
        agent = agents.parse_agent(procfs.argv(cmdline.data), ppid) if cmdline.data else None
        if agent is None:
            return None, None
        children = procfs.read_head(self._proc_root / str(ppid) / "task" / str(ppid) / "children", 64 * 1024)
        order = [int(child) for child in children.text.split() if child.isdigit()]
        return agent, (order.index(pid) if pid in order else None)
