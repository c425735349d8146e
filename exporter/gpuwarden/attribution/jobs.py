"""The jobs stage, after processes: which GPUs of this node belong to one job, and each GPU's rank, from the host
alone (no hook in the job). A pipeline step: it reads the processes the processes step wrote and the host's /proc.

Evidence, strongest first (docs/diagnosis.md, "Jobs"):
1. the launcher's environment (exporter/gpuwarden/attribution/launcher.py): a Slurm job, or a rendezvous
   (MASTER_ADDR:MASTER_PORT with torchrun's run id): a key the same on every node;
2. one process holding several GPUs;
3. one pod, or one Slurm job's cgroup;
4. one parent process (torchrun's agent, mp.spawn's main process), else one session.
The GPU's main process is its largest holder of memory. A GPU whose process shares nothing with another GPU's is a
job of its own (no peers). Reads are cached per PID (a process's exec-time environment never changes) and forgotten
with the PID.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

from gpuwarden.attribution import launcher
from gpuwarden.model.draft import Draft
from gpuwarden.model.snapshot import JobMember, ProcessView


@dataclass(frozen=True)
class _Seen:
    launch: launcher.Launch
    tree: launcher.ProcessTree | None


class JobsStep:
    """Fills draft.jobs for every GPU held by a compute process."""

    def __init__(self, proc_root: Path | None) -> None:
        self._proc_root = proc_root  # None: the host's /proc is not mounted: processes of one PID only
        self._seen: dict[int, _Seen] = {}

    def _look(self, view: ProcessView) -> _Seen:
        known = self._seen.get(view.pid)
        if known is None:
            if self._proc_root is None:
                known = _Seen(launcher.launch_from({}, view.namespace, view.slurm_job), None)
            else:
                known = _Seen(
                    launcher.read_launch(self._proc_root, view.pid, view.namespace, view.slurm_job),
                    launcher.read_tree(self._proc_root, view.pid),
                )
            if self._proc_root is not None and known.tree is None:
                return known  # not visible (yet): looked at again next time, not cached
            self._seen[view.pid] = known
        return known

    def __call__(self, draft: Draft) -> None:
        main: dict[str, ProcessView] = {}
        for gpu in draft.gpus:
            views = [v for v in draft.processes.get(gpu.uuid, ()) if v.kind == "compute"]
            if views:
                main[gpu.uuid] = views[0]  # sorted by memory, largest first
        self._seen = {pid: seen for pid, seen in self._seen.items() if pid in {v.pid for v in main.values()}}
        keyed: dict[str, tuple[str, str]] = {uuid: self._key(view, main) for uuid, view in main.items()}
        members: dict[str, list[str]] = defaultdict(list)
        for uuid, (key, _) in keyed.items():
            members[key].append(uuid)
        draft.jobs = {}
        for uuid, view in main.items():
            key, source = keyed[uuid]
            launch = self._look(view).launch
            local = tuple(members[key])
            if key.startswith("pid/"):  # one process: its GPUs are its job, known on this node only
                key = f"local/pid-{view.pid}"
            draft.jobs[uuid] = JobMember(key, launch.rank, launch.world_size, source, view.pid, local)

    def _key(self, view: ProcessView, main: dict[str, ProcessView]) -> tuple[str, str]:
        """(grouping key, source) for one GPU's main process, the strongest evidence first."""
        seen = self._look(view)
        if seen.launch.job:
            return seen.launch.job, seen.launch.source
        if sum(1 for other in main.values() if other.pid == view.pid) > 1:
            return f"pid/{view.pid}", "process"
        if view.pod:
            return f"local/pod/{view.namespace}/{view.pod}", "pod"
        if seen.tree is not None:
            siblings = [o for o in main.values() if (t := self._look(o).tree) is not None and t.ppid == seen.tree.ppid]
            if len(siblings) > 1 and seen.tree.ppid > 1:
                return f"local/ppid-{seen.tree.ppid}", "tree"
            same_session = [
                o for o in main.values() if (t := self._look(o).tree) is not None and t.session == seen.tree.session
            ]
            if len(same_session) > 1 and seen.tree.session > 1:
                return f"local/session-{seen.tree.session}", "tree"
        return f"pid/{view.pid}", "lone"
