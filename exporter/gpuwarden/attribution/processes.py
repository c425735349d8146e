"""Who holds each GPU: its processes attributed to containers, their usage, and exits from near-full GPUs.

Who holds each GPU: the fast tier's processes attributed to containers, per-container usage accumulated, and
exits from near-full GPUs remembered (the out-of-memory pattern). A pipeline step: it reads the draft, never NVML.

Attribution, best first: the process's cgroup names its pod (host /proc and the pod log directory, see
exporter/gpuwarden/attribution/host.py) and the pod has one container holding the GPU, or one log directory; else the
GPU is allocated to exactly one container (an exclusive GPU: its processes are that container's); else unattributed
(namespace, pod and container empty). Outside Kubernetes, a process in a Slurm job step's cgroup is the job's (job
ID and user). Per-container and per-job series are bounded by the containers and jobs on the node, however many
processes come and go; per-PID series are opt-in and capped (exporter/gpuwarden/exposition/render.py).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from gpuwarden.attribution.host import HostProcesses
from gpuwarden.model.draft import Draft
from gpuwarden.model.families import MEMORY_TOTAL_BYTES, MEMORY_USED_BYTES
from gpuwarden.model.snapshot import (
    Allocation,
    ContainerUsage,
    GpuSnapshot,
    JobUsage,
    ProcessExit,
    ProcessView,
)

MAX_WINDOW_S = 30.0  # a longer gap between two reads (a stall, a restart) is not credited to anyone
EXIT_MEMORY_RATIO = 0.95  # a GPU this full when a process leaves it: the exit is remembered as a likely OOM
EXIT_MEMORY_S = 600.0  # how long such an exit is kept for the diagnosis
MAX_EXITS = 64

Key = tuple[str, str, str]  # namespace, pod, container
UNATTRIBUTED: Key = ("", "", "")


@dataclass
class _GpuState:
    fast_at: float = 0.0  # the fast reading last accounted, so a snapshot published twice is not counted twice
    sm_seconds: dict[Key, float] = field(default_factory=dict)  # per container, while the container is seen
    job_sm_seconds: dict[tuple[str, str], float] = field(default_factory=dict)  # per Slurm job, while it is seen
    previous: dict[int, ProcessView] | None = None
    memory_ratio: float = 0.0


def _memory(gpu: GpuSnapshot) -> tuple[float | None, float | None]:
    used = total = None
    for sample in gpu.samples:
        if sample.name == MEMORY_USED_BYTES.name:
            used = sample.value
        elif sample.name == MEMORY_TOTAL_BYTES.name:
            total = sample.value
    return used, total


class ProcessesStep:
    """Fills draft.processes, draft.containers and draft.process_exits."""

    def __init__(self, host: HostProcesses, pid_series: Callable[[], int] = lambda: 0) -> None:
        self._host = host
        self._pid_series = pid_series  # per-PID series per GPU (0: off); read per snapshot, so a reload applies
        self._gpus: dict[str, _GpuState] = {}
        self._exits: deque[ProcessExit] = deque(maxlen=MAX_EXITS)
        self._last_seen: dict[str, tuple[ProcessView, ...]] = {}  # per GPU, while it is up or lost

    def __call__(self, draft: Draft) -> None:
        now = draft.taken_at
        live_pids: set[int] = set()
        for gpu in draft.gpus:
            if gpu.up and gpu.info.processes is not None:
                live_pids |= self._read_gpu(draft, gpu, now)
        self._remember_holders(draft)
        for uuid in [u for u in self._gpus if u not in draft.processes]:
            del self._gpus[uuid]  # a GPU gone (lost, removed): its per-container counters go with its series
        self._host.retain(live_pids)
        while self._exits and now - self._exits[0].at > EXIT_MEMORY_S:
            self._exits.popleft()
        draft.process_exits = tuple(self._exits)
        draft.pid_series = self._pid_series()

    def _read_gpu(self, draft: Draft, gpu: GpuSnapshot, now: float) -> set[int]:
        """One GPU's processes, containers and Slurm jobs into the draft; the PIDs holding it."""
        state = self._gpus.setdefault(gpu.uuid, _GpuState())
        used, total = _memory(gpu)
        views = self._attribute(gpu, total, draft.pods.get(gpu.uuid, ()))
        draft.processes[gpu.uuid] = tuple(sorted(views, key=lambda v: -(v.used_memory_bytes or 0)))
        fast_at = gpu.updated_at.get("fast", 0.0)
        if fast_at != state.fast_at:
            self._account(gpu, state, views, fast_at, now)
            state.memory_ratio = (used / total) if used is not None and total else 0.0
        draft.containers[gpu.uuid] = self._usage(state, views, draft.pods.get(gpu.uuid, ()))
        jobs = self._job_usage(state, views)
        if jobs:
            draft.slurm_jobs[gpu.uuid] = jobs
        return {view.pid for view in views}

    def _remember_holders(self, draft: Draft) -> None:
        """The processes last seen on each GPU, kept while it is lost: draft.lost_holders names them."""
        lost = {gpu.uuid for gpu in draft.gpus if not gpu.up}
        self._last_seen = {
            u: v for u, v in {**self._last_seen, **draft.processes}.items() if u in lost | set(draft.processes)
        }
        draft.lost_holders = {u: self._last_seen[u] for u in lost if self._last_seen.get(u)}

    def _attribute(
        self, gpu: GpuSnapshot, total: float | None, allocations: tuple[Allocation, ...]
    ) -> list[ProcessView]:
        containers = sorted({(a.namespace, a.pod, a.container) for a in allocations})
        views = []
        for process in gpu.info.processes or ():
            host = self._host.process(process.pid)
            key, how = UNATTRIBUTED, ""
            pod = self._host.pod(host.pod_uid) if host.pod_uid else None
            if pod is not None:
                held = [c for c in containers if c[:2] == (pod.namespace, pod.pod)]
                if len(held) == 1:
                    key = held[0]
                elif len(pod.containers) == 1:
                    key = (pod.namespace, pod.pod, pod.containers[0])
                else:
                    key = (pod.namespace, pod.pod, "")
                how = "cgroup"
            elif len(containers) == 1:
                key, how = containers[0], "allocation"
            memory = process.used_memory_bytes
            views.append(
                ProcessView(
                    pid=process.pid,
                    name=host.name,
                    kind=process.kind,
                    used_memory_bytes=memory,
                    memory_share=(memory / total) if memory is not None and total else None,
                    sm_ratio=process.sm_ratio,
                    memory_ratio=process.memory_ratio,
                    gpu_instance=process.gpu_instance,
                    namespace=key[0],
                    pod=key[1],
                    container=key[2],
                    attributed_by=how,
                    slurm_job=host.slurm_job,
                    slurm_user=host.slurm_user,
                )
            )
        return views

    def _account(
        self, gpu: GpuSnapshot, state: _GpuState, views: list[ProcessView], fast_at: float, now: float
    ) -> None:
        window = gpu.info.processes_window_s
        if window is None and state.fast_at:
            window = fast_at - state.fast_at
        if window is not None and 0 < window <= MAX_WINDOW_S:
            for view in views:
                if view.sm_ratio is not None:
                    key = (view.namespace, view.pod, view.container)
                    state.sm_seconds[key] = state.sm_seconds.get(key, 0.0) + view.sm_ratio * window
                    if view.slurm_job:
                        job = (view.slurm_job, view.slurm_user)
                        state.job_sm_seconds[job] = state.job_sm_seconds.get(job, 0.0) + view.sm_ratio * window
        current = {view.pid: view for view in views}
        if state.previous is not None and state.memory_ratio >= EXIT_MEMORY_RATIO:
            for pid, gone in state.previous.items():
                if pid not in current:
                    self._exits.append(
                        ProcessExit(
                            gpu.index,
                            gpu.uuid,
                            pid,
                            gone.name,
                            gone.namespace,
                            gone.pod,
                            gone.container,
                            gone.used_memory_bytes,
                            state.memory_ratio,
                            now,
                        )
                    )
        state.previous = current
        state.fast_at = fast_at

    @staticmethod
    def _job_usage(state: _GpuState, views: list[ProcessView]) -> tuple[JobUsage, ...]:
        """One row per Slurm job holding the GPU: bounded by the jobs running on the node, as containers are."""
        memory: dict[tuple[str, str], int] = {}
        count: dict[tuple[str, str], int] = {}
        for view in views:
            if view.slurm_job:
                key = (view.slurm_job, view.slurm_user)
                memory[key] = memory.get(key, 0) + (view.used_memory_bytes or 0)
                count[key] = count.get(key, 0) + 1
        for gone in [k for k in state.job_sm_seconds if k not in memory]:
            del state.job_sm_seconds[gone]
        return tuple(
            JobUsage(k[0], k[1], memory[k], state.job_sm_seconds.get(k, 0.0), count[k]) for k in sorted(memory)
        )

    @staticmethod
    def _usage(state: _GpuState, views: list[ProcessView], allocations: tuple[Allocation, ...]) -> tuple:
        """One row per container holding processes or allocated the GPU; counters of containers gone are dropped."""
        memory: dict[Key, int] = {}
        count: dict[Key, int] = {}
        for view in views:
            key = (view.namespace, view.pod, view.container)
            memory[key] = memory.get(key, 0) + (view.used_memory_bytes or 0)
            count[key] = count.get(key, 0) + 1
        keys = set(memory) | {(a.namespace, a.pod, a.container) for a in allocations}
        sm = state.sm_seconds
        for gone in [k for k in sm if k not in keys]:
            del sm[gone]
        return tuple(
            ContainerUsage(k[0], k[1], k[2], memory.get(k, 0), sm.get(k, 0.0), count.get(k, 0)) for k in sorted(keys)
        )
