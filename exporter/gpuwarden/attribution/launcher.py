"""Who launched a GPU process, from the host's /proc alone: the job key and rank that launchers leave in the
environment at exec time, and the process tree. No hook in the job.

`/proc/PID/environ` is the environment the process was started with (changes made inside the program are not
there; proc_pid_environ(5)), readable with the same UID or CAP_SYS_PTRACE. What the launchers set
(docs/diagnosis.md, "Jobs"):
- torchrun: RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT, TORCHELASTIC_RUN_ID, TORCHELASTIC_RESTART_COUNT;
- Kubeflow PyTorchJob and Trainer: MASTER_ADDR/PORT or PET_MASTER_ADDR/PORT, PET_NNODES, PET_NODE_RANK;
- an Indexed Job: JOB_COMPLETION_INDEX (it numbers pods, not ranks: a pod may run several, so it is no rank here);
  Volcano: MASTER_ADDR, MASTER_PORT, WORLD_SIZE, RANK;
- Slurm (srun): SLURM_JOB_ID, SLURM_PROCID, SLURM_LOCALID, SLURM_NTASKS;
- torch.multiprocessing.spawn: nothing: its ranks are set inside the program, so the rank is `unknown`.

The job key is the same on every node of a job, so the fleet can join a job's nodes: the Slurm job, else the
rendezvous (MASTER_ADDR:MASTER_PORT, with the torchrun run id and restart count where set), qualified by the pod's
namespace (a loopback rendezvous, as single-node jobs use, is this node's only: `local/...`). Reads are bounded; a
value that is not printable ASCII is dropped, never exported.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

_MAX_ENVIRON = 256 * 1024  # a process's environment is limited by ARG_MAX; read no more than this
_MAX_VALUE = 96
_SAFE = re.compile(rf"[\x21-\x7e]{{1,{_MAX_VALUE}}}")
_INTEGER = re.compile(r"\d{1,7}")
UNKNOWN = "unknown"
LOOPBACK = frozenset({"localhost", "127.0.0.1", "::1", "[::1]", "0.0.0.0"})

# the variables read; everything else in the environment (secrets included) is never kept
LAUNCH_VARIABLES = frozenset(
    {
        "RANK",
        "LOCAL_RANK",
        "WORLD_SIZE",
        "LOCAL_WORLD_SIZE",
        "MASTER_ADDR",
        "MASTER_PORT",
        "TORCHELASTIC_RUN_ID",
        "TORCHELASTIC_RESTART_COUNT",
        "PET_MASTER_ADDR",
        "PET_MASTER_PORT",
        "PET_NNODES",
        "PET_NPROC_PER_NODE",
        "PET_NODE_RANK",
        "JOB_COMPLETION_INDEX",
        "SLURM_JOB_ID",
        "SLURM_PROCID",
        "SLURM_LOCALID",
        "SLURM_NTASKS",
    }
)


@dataclass(frozen=True)
class Launch:
    """What the environment says of the process's job: a key shared by every rank on every node ("" where none
    can be known from the environment), the global rank and world size where the launcher set them."""

    job: str = ""
    rank: str = UNKNOWN
    world_size: int | None = None
    source: str = ""  # which launcher's variables gave the key: slurm, torchrun, rendezvous


@dataclass(frozen=True)
class ProcessTree:
    """/proc/PID/stat's parent and session: ranks started by one launcher share a parent (torchrun's agent,
    mp.spawn's main process) or at least a session."""

    ppid: int
    session: int


def _read(path: Path, limit: int) -> bytes:
    try:
        with path.open("rb") as handle:
            return handle.read(limit)
    except OSError:
        return b""


def parse_environ(raw: bytes) -> dict[str, str]:
    """The launcher variables of a NUL-separated environment; unsafe or overlong values are dropped."""
    found: dict[str, str] = {}
    for entry in raw.split(b"\0"):
        name, sep, value = entry.partition(b"=")
        if not sep:
            continue
        key = name.decode("ascii", "replace")
        if key not in LAUNCH_VARIABLES:
            continue
        text = value.decode("ascii", "replace")
        if _SAFE.fullmatch(text):
            found[key] = text
    return found


def _integer(variables: dict[str, str], *names: str) -> int | None:
    for name in names:
        value = variables.get(name, "")
        if _INTEGER.fullmatch(value):
            return int(value)
    return None


def launch_from(variables: dict[str, str], namespace: str = "", slurm_job: str = "") -> Launch:
    """The job key, rank and world size; `namespace` qualifies a rendezvous address (two namespaces may both
    run a `trainer-master-0`), `slurm_job` is the job the cgroup names (stronger than the environment)."""
    from_environ = variables.get("SLURM_JOB_ID", "")
    slurm = slurm_job or (from_environ if _INTEGER.fullmatch(from_environ) else "")
    rank = _integer(variables, "RANK")
    world = _integer(variables, "WORLD_SIZE")
    if slurm:
        if rank is None:
            rank = _integer(variables, "SLURM_PROCID")
        if world is None:
            world = _integer(variables, "SLURM_NTASKS")
        return Launch(f"slurm/{slurm}", UNKNOWN if rank is None else str(rank), world, "slurm")
    address = variables.get("MASTER_ADDR") or variables.get("PET_MASTER_ADDR")
    port = variables.get("MASTER_PORT") or variables.get("PET_MASTER_PORT")
    if address and port and _INTEGER.fullmatch(port):
        key = f"{namespace}/{address}:{port}" if namespace else f"{address}:{port}"
        if address in LOOPBACK:  # the same on every node that runs such a job: a key for this node only
            key = f"local/{address}:{port}"
        run = variables.get("TORCHELASTIC_RUN_ID", "")
        source = "rendezvous"
        if run and run != "none":
            key += f"/{run}"
            source = "torchrun"
        restarts = variables.get("TORCHELASTIC_RESTART_COUNT", "")
        if restarts not in ("", "0"):
            key += f"#{restarts}"
        if rank is None:  # a Trainer pod's node rank times the processes per node plus the local rank
            node, per_node, local = (
                _integer(variables, name) for name in ("PET_NODE_RANK", "PET_NPROC_PER_NODE", "LOCAL_RANK")
            )
            if node is not None and per_node is not None and local is not None:
                rank = node * per_node + local
        if world is None:
            nodes, per_node = _integer(variables, "PET_NNODES"), _integer(variables, "PET_NPROC_PER_NODE")
            world = nodes * per_node if nodes is not None and per_node is not None else None
        return Launch(key[: _MAX_VALUE * 2], UNKNOWN if rank is None else str(rank), world, source)
    return Launch("", UNKNOWN if rank is None else str(rank), world, "")


def read_launch(proc_root: Path, pid: int, namespace: str = "", slurm_job: str = "") -> Launch:
    return launch_from(parse_environ(_read(proc_root / str(pid) / "environ", _MAX_ENVIRON)), namespace, slurm_job)


def parse_stat(text: str) -> ProcessTree | None:
    """(ppid, session) from /proc/PID/stat; the command name may hold spaces and parentheses, so the fields are
    read after its last ')'."""
    _, sep, rest = text.rpartition(")")
    fields = rest.split()
    if not sep or len(fields) < 4 or not all(_INTEGER.fullmatch(f) for f in fields[1:4]):
        return None
    return ProcessTree(int(fields[1]), int(fields[3]))


def read_tree(proc_root: Path, pid: int) -> ProcessTree | None:
    return parse_stat(_read(proc_root / str(pid) / "stat", 4096).decode("ascii", "replace"))
