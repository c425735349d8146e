"""The job diagnosis case suite's machinery (issue 49): a case is a simulated node (the real pynvml over the fake
library) and a host /proc written for its processes, both changing over time; the suite runs the real pipeline on
a manual clock, reads the job findings of /api/v1/diagnosis after every poll, and scores them against what the
case says happened (its expectations).

A case's GPU readings are mixes of measured signatures (docs/diagnosis.md): a rank computing, a rank spinning in a
collective for a late peer, a GPU left idle while its process works on the CPU. A rank `k` times slower than its
peers computes all the time while they compute 1/k of it and spin the rest: the relational evidence the job view
reads.

The scoring is tests/helpers/job_scoring.py.
"""

from __future__ import annotations

import shutil
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from gpuwarden.jobs.findings import diagnose
from gpuwarden.nvml import library
from gpuwarden.runtime.pipeline import Pipeline
from gpuwarden.sim import install_simulator
from tests.helpers.common import ManualClock, scenario_from, settings

Values = dict[str, float]

# --- GPU-side signatures (per 20 s window; percent, bytes per second per direction) ----------------------------
# a rank spinning in a collective for a late peer: 2x and 4x H200 (busy 85-99 %, SM 17-25 %, tensor 2 %, DRAM 4 %)
SPIN: Values = {
    "utilization": 99,
    "sm_active": 24,
    "tensor_active": 0,
    "fp32_active": 0,
    "dram_active": 3,
    "nvlink": 2e9,
}
# a rank computing a bf16 step (a GPU-bound job: the co-located and throttled families)
COMPUTE: Values = {
    "utilization": 97,
    "sm_active": 80,
    "tensor_active": 38,
    "fp32_active": 2,
    "dram_active": 40,
    "nvlink": 16e9,
}
# the process works on the CPU (Python, a loader, a compile) or sleeps: its GPU does nothing
IDLE: Values = {"utilization": 0, "sm_active": 0, "tensor_active": 0, "fp32_active": 0, "dram_active": 0, "nvlink": 2e9}
# balanced bf16 DDP (2x H200: busy 43-63 %, SM 38-47 %, tensor 11-12 %, NVLink 19-25 GB/s both ways)
BALANCED: Values = {
    "utilization": 55,
    "sm_active": 42,
    "tensor_active": 11,
    "fp32_active": 2,
    "dram_active": 25,
    "nvlink": 18e9,
}
# decode replicas serving requests: memory-bound, few tensor cycles
DECODE: Values = {
    "utilization": 88,
    "sm_active": 30,
    "tensor_active": 4,
    "fp32_active": 1,
    "dram_active": 55,
    "nvlink": 0.0,
}
NOISE = {"utilization": 6.0, "sm_active": 3.0, "tensor_active": 1.0, "dram_active": 2.0}
GPM_KEYS = ("utilization", "sm_active", "tensor_active", "fp32_active", "dram_active", "nvlink")


def mix(*parts: tuple[Values, float]) -> Values:
    """A window that is part one signature, part another (shares summing to 1)."""
    return {key: round(sum(values[key] * share for values, share in parts), 2) for key in GPM_KEYS}


def slower(k: float, busy_share: float = 0.95) -> tuple[Values, Values]:
    """(the slow rank, each peer) where one rank's GPU is `k` times slower: it computes `busy_share` of the time,
    its peers 1/k of that and spin the rest in the collective."""
    mine = mix((COMPUTE, busy_share), (SPIN, 1 - busy_share))
    theirs = mix((COMPUTE, busy_share / k), (SPIN, 1 - busy_share / k))
    return mine, theirs


def host_slower(k: float, busy_share: float = 0.95) -> tuple[Values, Values]:
    """(the slow rank, each peer) where one rank spends (k-1)/k of each step on the CPU: its GPU idles then, its
    peers spin."""
    computing = busy_share / k
    return mix((COMPUTE, computing), (IDLE, 1 - computing)), mix((COMPUTE, computing), (SPIN, 1 - computing))


@dataclass(frozen=True)
class Host:
    """What a process's threads do on the host from a time on: main thread state (R running, S asleep, D in I/O),
    how many of its worker children run, bytes per second written to storage."""

    main: str = "R"
    workers_running: int = 0
    workers: int = 0
    write_bytes_per_second: float = 0.0


RUNNING, ASLEEP = Host("R"), Host("S")


@dataclass(frozen=True)
class Proc:
    """A process holding a GPU: its /proc entry and what it does over time. `environ` None: unreadable (another
    user's, as an unprivileged exporter sees it); `cgroup`: the /proc/PID/cgroup line."""

    pid: int
    gpu: int
    ppid: int = 4990
    session: int = 4990
    environ: dict[str, str] | None = None
    cgroup: str = "0::/user.slice/user-1000.slice/session-3.scope\n"
    cmdline: tuple[str, ...] = ("python", "train.py")
    host: tuple[tuple[float, Host], ...] = ((0.0, RUNNING),)
    memory_gib: float = 40.0
    sm: tuple[tuple[float, float], ...] = ((0.0, 40.0),)  # per-process SM share over time (NVML), percent
    at: float = 0.0
    until: float | None = None
    environ_padding: int = 0  # bytes of other variables before the launcher's (a large environment)


@dataclass(frozen=True)
class Expect:
    """What a right diagnosis says: `kind` straggler or collective_hang, naming GPU `gpu` (None: a hang of the whole
    job), from `start` (the onset) to `end` (None: the end of the case); `cause` where the case knows it."""

    kind: str
    gpu: int | None
    start: float
    end: float | None = None
    cause: str | None = None
    within: float = 60.0  # seconds after `start` it must be named by


@dataclass(frozen=True)
class Case:
    name: str
    family: str
    gpus: dict[int, tuple[tuple[float, Values], ...]]  # GPU → (from t, readings) segments
    procs: tuple[Proc, ...]
    expect: tuple[Expect, ...] = ()
    seconds: float = 180.0
    node: dict[str, Any] = field(default_factory=lambda: {"model": "h100-sxm-80gb", "count": 4, "nvlink": "nvswitch"})
    extra: dict[int, dict[str, Any]] = field(default_factory=dict)  # GPU → other sim values (trajectories)
    groups: tuple[tuple[int, ...], ...] = ()  # GPUs that must share a job key, each tuple apart from the others
    grouping: bool = False  # a grouping case: rests on how processes are grouped into jobs
    pod_logs: tuple[str, ...] = ()  # /var/log/pods directory names (namespace_pod_uid) to create
    clear_within: float = 30.0  # seconds an episode may outlive its expectation's end (the job view's window)
    nic: tuple[tuple[float, float], ...] | None = None  # RDMA port bytes per second over time (None: no RDMA)
    links: tuple[tuple[float, float], ...] | None = None  # NVLink bytes/s (both ways) of every GPU over time,
    # where the traffic is not the signatures' (a hang: nothing moves)


def steps(segments: Iterable[tuple[float, float]], noise: float = 0.0) -> dict[str, Any]:
    trajectory: dict[str, Any] = {"steps": [[t, v] for t, v in segments]}
    if noise:
        trajectory["noise"] = noise
    return trajectory


def scenario(case: Case) -> dict[str, Any]:
    """The simulator scenario of a case."""
    gpus: dict[int, dict[str, Any]] = {}
    for gpu, segments in case.gpus.items():
        values = {key: steps(((t, v[key]) for t, v in segments), NOISE.get(key, 0.0)) for key in GPM_KEYS[:-1]}
        values["fp16_active"] = {"constant": 0}
        values["sm_clock_mhz"] = {"constant": 1980}
        values["clock_event_reasons"] = {"constant": 0}
        if case.node.get("nvlink", "nvswitch") != "none":  # each direction half of the GPU's traffic
            links = case.links or tuple((t, v["nvlink"]) for t, v in segments)
            values["nvlink_rx_bytes_per_second"] = values["nvlink_tx_bytes_per_second"] = steps(
                (t, v / 2) for t, v in links
            )
        values.update(case.extra.get(gpu, {}))
        gpus[gpu] = values
    processes = []
    for proc in case.procs:
        spec: dict[str, Any] = {"gpu": proc.gpu, "pid": proc.pid, "name": proc.cmdline[0][:64], "at": proc.at}
        spec.update(memory_gib={"constant": proc.memory_gib}, sm=steps(proc.sm))
        if proc.until is not None:
            spec["until"] = proc.until
        processes.append(spec)
    return {
        "name": case.name,
        "node": case.node,
        "values": {"memory_used_ratio": 0.6},
        "gpus": gpus,
        "processes": processes,
    }


class FakeHost:
    """The host's /proc (and /sys/class/infiniband, /var/log/pods) for a case's processes, rewritten as the case's
    timeline moves: thread states, worker children, bytes written."""

    def __init__(self, root: Path, case: Case) -> None:
        self.root, self.case = root, case
        self.proc, self.sys, self.pod_logs = root / "proc", root / "sys", root / "pods"
        shutil.rmtree(root, ignore_errors=True)
        (self.proc / "self").mkdir(parents=True)
        init = self.proc / "1"  # the host's init, as every /proc shows it
        (init / "task" / "1").mkdir(parents=True)
        (init / "stat").write_text("1 (systemd) S 0 1 1 0 -1\n")
        (init / "cgroup").write_text("0::/init.scope\n")
        (init / "cmdline").write_bytes(b"/sbin/init\0")
        (init / "environ").write_bytes(b"HOME=/\0")
        self.pod_logs.mkdir()
        for name in case.pod_logs:
            (self.pod_logs / name / "main").mkdir(parents=True)
        self._state: dict[int, Host | None] = {}
        self._written: dict[int, float] = {}
        self._nic_bytes = 0.0
        self._last = 0.0

    def _host_at(self, proc: Proc, t: float) -> Host | None:
        alive = t >= proc.at and (proc.until is None or t < proc.until)
        return next((h for at, h in reversed(proc.host) if t >= at), proc.host[0][1]) if alive else None

    def advance(self, t: float) -> None:
        elapsed, self._last = t - self._last, t
        for proc in self.case.procs:
            host = self._host_at(proc, t)
            self._written[proc.pid] = self._written.get(proc.pid, 0.0) + (
                host.write_bytes_per_second * elapsed if host else 0.0
            )
            if host != self._state.get(proc.pid, "unset"):
                self._write(proc, host)
                self._state[proc.pid] = host
            if host is not None:
                io = f"rchar: 1\nwchar: 1\nread_bytes: 0\nwrite_bytes: {int(self._written[proc.pid])}\n"
                (self.proc / str(proc.pid) / "io").write_text(io)
        if self.case.nic is not None:
            rate = next((v for at, v in reversed(self.case.nic) if t >= at), self.case.nic[0][1])
            self._nic_bytes += rate * elapsed
            counters = self.sys / "class" / "infiniband" / "mlx5_0" / "ports" / "1" / "counters"
            counters.mkdir(parents=True, exist_ok=True)
            for name in ("port_xmit_data", "port_rcv_data"):  # in units of 4 octets, as the kernel counts them
                (counters / name).write_text(f"{int(self._nic_bytes / 8)}\n")

    def _write(self, proc: Proc, host: Host | None) -> None:
        base = self.proc / str(proc.pid)
        shutil.rmtree(base, ignore_errors=True)
        for worker in range(proc.pid * 10, proc.pid * 10 + 16):
            shutil.rmtree(self.proc / str(worker), ignore_errors=True)
        if host is None:
            return
        (base / "task" / str(proc.pid)).mkdir(parents=True)
        name = Path(proc.cmdline[0]).name[:15]
        (base / "stat").write_text(f"{proc.pid} ({name}) {host.main} {proc.ppid} {proc.pid} {proc.session} 0 -1\n")
        (base / "comm").write_text(name + "\n")
        (base / "cmdline").write_bytes(b"\0".join(a.encode() for a in proc.cmdline) + b"\0")
        (base / "cgroup").write_text(proc.cgroup)
        (base / "status").write_text(f"Name:\t{name}\nUid:\t1000\t1000\t1000\t1000\n")
        if proc.environ is not None:
            padding = b"X_PAD=" + b"x" * proc.environ_padding + b"\0" if proc.environ_padding else b""
            env = b"".join(f"{k}={v}\0".encode() for k, v in proc.environ.items())
            (base / "environ").write_bytes(b"HOME=/root\0" + padding + env)
        task = base / "task" / str(proc.pid)
        (task / "stat").write_text(f"{proc.pid} ({name}) {host.main} {proc.ppid} 1 2\n")
        workers = [proc.pid * 10 + k for k in range(host.workers)]
        (task / "children").write_text(" ".join(map(str, workers)))
        for number, worker in enumerate(workers):
            state = "R" if number < host.workers_running else "S"
            (self.proc / str(worker)).mkdir(parents=True, exist_ok=True)
            (self.proc / str(worker) / "stat").write_text(f"{worker} (pt_data_worker) {state} {proc.pid} 1 2\n")


@dataclass
class Poll:
    t: float
    named: frozenset[tuple[str, int | None]]  # (check, GPU) of each straggler or hang finding
    causes: dict[tuple[str, int | None], str]
    info: frozenset[tuple[str, int | None]]  # waiting_elsewhere, imbalance: information


@dataclass
class CaseRun:
    case: Case
    polls: list[Poll]
    groups: dict[int, str]  # GPU index → job key at the end
    texts: list[str]  # the observed text of every job finding seen (for the report)


PAGED = ("straggler", "collective_hang")


Scrape = Callable[[float, Pipeline, Any], None]  # (wall time, the pipeline, its snapshot) after each poll


def run(
    case: Case, work: Path, health: dict[str, Any] | None = None, start: float = 0.0, scrape: Scrape | None = None
) -> CaseRun:
    """The case on the real pipeline over the simulator, polled every second of a manual clock that starts at
    `start` (the case's t = 0); `scrape` sees every poll."""
    host = FakeHost(work / case.name, case)
    clock = ManualClock(start)
    fake = install_simulator(scenario_from(scenario(case)), clock=clock)
    sections: dict[str, Any] = {
        "processes": {"proc_root": str(host.proc), "pod_logs_root": str(host.pod_logs), "sys_root": str(host.sys)},
    }
    if health:
        path = work / f"{case.name}-thresholds.yaml"
        path.write_text(yaml.safe_dump(health))
        sections["health"] = {"thresholds_file": str(path)}
    pipeline = Pipeline(settings(**sections), wall_clock=clock)
    polls: list[Poll] = []
    texts: list[str] = []
    snapshot = None
    try:
        while clock.now - start <= case.seconds:
            host.advance(clock.now - start)
            snapshot = pipeline.poll_once()
            polls.append(_poll(clock.now - start, snapshot, texts))
            if scrape is not None:
                scrape(clock.now, pipeline, snapshot)
            clock.advance(1)
    finally:
        pipeline.stop(timeout=0.2)
        fake.close()
        library.install(None)
    index = {gpu.uuid: gpu.index for gpu in snapshot.gpus} if snapshot else {}
    groups = {index[uuid]: member.job for uuid, member in (snapshot.jobs.items() if snapshot else ())}
    return CaseRun(case, polls, groups, texts)


def _poll(t: float, snapshot: Any, texts: list[str]) -> Poll:
    named, info, causes = set(), set(), {}
    for finding in diagnose(snapshot):
        if finding.job is None:
            continue
        straggler = (finding.job.get("straggler") or {}).get("gpu")
        key = (finding.check, straggler)
        if finding.check in PAGED and finding.severity != "info":
            named.add(key)
            causes[key] = str(finding.job.get("cause"))
        else:
            info.add(key)
        if len(texts) < 200 and finding.observed not in texts:
            texts.append(finding.observed)
    return Poll(t, frozenset(named), causes, frozenset(info))
