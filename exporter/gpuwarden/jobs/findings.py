"""The job view's findings for humans: a job's straggler or hang, and the cause of a waiting GPU.

The job view's findings for humans: a job's straggler or hang named with its cause and its waiters, and the
cause of a `waiting` GPU read from what its main process does on the host. Added to the GPUs' findings
(health/diagnosis.py) by `diagnose`, which /api/v1/diagnosis and the node page serve.
"""

from __future__ import annotations

from dataclasses import replace

from gpuwarden.health import diagnosis
from gpuwarden.health.diagnosis import Finding
from gpuwarden.jobs import host_reading
from gpuwarden.jobs.causes import describe_cotenants
from gpuwarden.model.snapshot import CollectiveFinding, GpuSnapshot, HostEvidence, Snapshot


def diagnose(snapshot: Snapshot) -> list[Finding]:
    """Every finding of the node: the GPUs' (a waiting GPU's cause from the host, a shared GPU's other tenants) and
    the jobs'."""
    findings = shared_gpus(snapshot, diagnosis.diagnose(snapshot, explain_waiting)) + job_findings(snapshot)
    return sorted(findings, key=diagnosis.order)


SHARED_GPU = (
    "Another process computes on this GPU beside its job: the GPU time-slices between them, so the job's kernels "
    "wait their turn and it runs slower than it would alone (by about the other's share of the SMs).",
    "Give each its own GPU or MIG slice (MPS where they must share); find the other process's owner (pid above, "
    "`nvidia-smi`, its pod or Slurm job) and move it.",
)


def shared_gpus(snapshot: Snapshot, findings: list[Finding]) -> list[Finding]:
    """Each GPU that another process computes on gets its bottleneck finding naming that process with its SM share,
    and the advice for a shared GPU; a GPU whose class is healthy (its tensor cores busy: both processes compute)
    gets one as information. The GPU's class and numbers stay in the observed text."""
    out = list(findings)
    for gpu in snapshot.gpus:
        others = snapshot.cotenants.get(gpu.uuid)
        if not others:
            continue
        shared = f"; shared with {describe_cotenants(others)}"
        index = next((i for i, f in enumerate(out) if f.uuid == gpu.uuid and f.check == "bottleneck"), None)
        if index is not None:
            found = out[index]
            out[index] = replace(found, observed=found.observed + shared, likely_cause=SHARED_GPU[0],
                                 recommended_action=SHARED_GPU[1])  # fmt: skip
            continue
        verdict = next((v for v in snapshot.health.get(gpu.uuid, ()) if v.check == "bottleneck"), None)
        if verdict is not None:
            out.append(Finding(gpu.index, gpu.uuid, "bottleneck", "info", verdict.observed + shared,
                               verdict.threshold, *SHARED_GPU))  # fmt: skip
    return out


def explain_waiting(snapshot: Snapshot, uuid: str, bottleneck: str, cause: str, action: str) -> tuple[str, str]:
    """A `waiting` GPU's cause and action from its main process's host evidence; other classes as they are."""
    if bottleneck != "waiting":
        return cause, action
    member = snapshot.jobs.get(uuid)
    peers = None if member is None else member.peers
    stragglers = {found.straggler for found in snapshot.collective if found.straggler and found.kind != "imbalance"}
    return waiting_cause(snapshot.host_evidence.get(uuid), cause, action, peers, uuid in stragglers)


# What a waiting GPU's main process does on the host (host_reading.dominant) → the cause and action
WAITING_CAUSES: dict[str, tuple[str, str]] = {
    "checkpoint": (
        "Checkpointing: the job's main process writes to storage while the GPU waits (the training loop stops for "
        "the save).",
        "Asynchronous or sharded checkpoints (torch.distributed.checkpoint.async_save, FSDP sharded state dicts), "
        "checkpoint less often, or write to faster local storage and copy off in the background.",
    ),
    "io_wait": (
        "I/O stall: the job's threads wait on storage (D state) while the GPU idles: a checkpoint being written, or "
        "data read from slow or remote storage.",
        "Asynchronous or sharded checkpoints (torch.distributed.checkpoint async_save), checkpoint less often, "
        "faster or local storage for the data set.",
    ),
    "workers_running": (
        "Input-bound: the DataLoader worker processes are busy nearly all the time and the GPU waits for batches.",
        "More DataLoader workers (num_workers), pin_memory, cheaper or GPU-side preprocessing, a local cache of "
        "the decoded data set.",
    ),
    "main_running": (
        "Host-bound: the job's main thread runs on the CPU nearly all the time while the GPU waits: Python work "
        "between steps (preprocessing, logging, metrics) or launching kernels one by one.",
        "Move the work off the training loop or onto the GPU; CUDA graphs or torch.compile for the launches; "
        "profile the step on the CPU side (py-spy).",
    ),
    "asleep": (
        "Waiting on others: every thread of the job sleeps while the GPU idles: it waits on other ranks (a "
        "straggler, a collective), a parameter server or the network.",
        "Find the slowest rank (compare this job's GPUs on other nodes in the fleet view); check the network and "
        "NCCL settings.",
    ),
}
# asleep, with no peers in any job: nobody to wait on
IDLE_HOLDER = (
    "An idle holder: a process with no peers in any job holds the GPU's memory and sleeps (a notebook kernel, "
    "a finished or stuck job, a debugger).",
    "Ask its owner to release it, or end it; schedule notebooks on shared or fractional GPUs, and set an idle "
    "timeout on interactive sessions.",
)
# asleep, while its job's other ranks wait for it (the job view named it): it sleeps in its own code
ASLEEP_STRAGGLER = (
    "Asleep while the other ranks of its job wait for it in a collective (the job's straggler finding): its "
    "threads sleep in its own code (a sleep, a lock, a blocking call outside the collectives), not on its peers.",
    "`py-spy dump --pid PID` on this rank shows where it sleeps; the other ranks need no change.",
)


def waiting_cause(
    evidence: HostEvidence | None, cause: str, action: str, peers: int | None = None, straggler: bool = False
) -> tuple[str, str]:
    """The cause of a `waiting` GPU from the host's evidence where /proc shows its process; the GPU-side text
    (which lists the candidates) otherwise, saying what could not be seen. `peers`: other ranks of the GPU's job
    (None: unknown); a sleeping process with none waits on no one, and one its peers wait for (`straggler`) is not
    waiting on them."""
    if evidence is None or not host_reading.sampled(evidence):
        return cause + " Host evidence: none (the host's /proc is not mounted, or not yet sampled).", action
    seen = f" Host evidence ({host_reading.describe(evidence)})."
    found = host_reading.dominant(evidence)
    if found is None:
        return cause + f" Host evidence (PID {evidence.pid}) shows no single cause.", action
    if found == "asleep" and straggler:
        return ASLEEP_STRAGGLER[0] + seen, ASLEEP_STRAGGLER[1]
    if found == "asleep" and peers == 0:
        return IDLE_HOLDER[0] + seen, IDLE_HOLDER[1]
    found_cause, found_action = WAITING_CAUSES[found]
    return found_cause + seen, found_action


# a job's straggler or hang (jobs/collective.py): cause → (what it means, what to do)
STRAGGLER_CAUSES: dict[str, tuple[str, str]] = {
    "cpu": (
        "A CPU-bound rank: its main thread runs on the CPU nearly all the time while its GPU idles, and the other "
        "ranks spin in the next collective until it arrives (their processes spin a core too: the GPU side tells "
        "them apart).",
        "Find the Python work only this rank does (logging, metrics, evaluation, preprocessing on rank 0): move it "
        "off the step or onto every rank evenly; `py-spy dump --pid PID` on the straggler shows where it is.",
    ),
    "input": (
        "An input-bound rank: its DataLoader workers are busy all the time and its GPU waits for batches, while "
        "the other ranks wait for it in the collective.",
        "More DataLoader workers on that rank's node (num_workers), pin_memory, a local cache; check that rank's "
        "shard of the data set and the node's CPU and storage.",
    ),
    "io": (
        "A rank waiting on storage: its threads are in D state (a checkpoint written by one rank, data read from "
        "slow or remote storage) while the others wait for it.",
        "Asynchronous or sharded checkpoints (torch.distributed.checkpoint.async_save), faster or local storage "
        "for that node.",
    ),
    "slower_gpu": (
        "A slower GPU: it still computes while the others wait (lower clocks, throttling, a power cap, or another "
        "process computing on it).",
        "Compare its clocks and clock-event reasons (`nvidia-smi -q -d PERFORMANCE`), move a co-located process, "
        "fix cooling or the power limit; drain the GPU if it stays slow.",
    ),
    "unknown": (
        "A rank the others wait for; what holds it back could not be seen from the host.",
        "`py-spy dump --pid PID` on the straggler, and its node's CPU, storage and network.",
    ),
    "off_node": (
        "Every rank of the job on this node waits in a collective: the rank holding the job back runs on another node.",
        "Open the fleet's job view (`gpuwarden fleet`, /api/v1/fleet/jobs): it names the straggler node and GPU.",
    ),
}
HANG = (
    "A collective hang: the job's ranks spin in a collective, none computes, and nothing has moved on any path its "
    "data may take (NVLink, PCIe, the host's RDMA ports) for collective_hang_for_s: a rank died, deadlocked, or "
    "called a different collective.",
    "Dump every rank's stacks (`py-spy dump --pid PID`), the odd one out first where one is named; enable "
    "NCCL_DEBUG=INFO and the process group's timeout (TORCH_NCCL_ASYNC_ERROR_HANDLING) so a hang fails fast; "
    "restart the job from its last checkpoint.",
)


IMBALANCE = (
    "An imbalance built into the job, not a straggler: the other ranks wait for this one, but have waited as much "
    "since the job began (pipeline stages of unequal cost, a rank with extra work, a warm-up still running), and "
    "its GPU shows no sign of being slower.",
    "Nothing is wrong with the GPU. To gain throughput, even out the work: rebalance the pipeline's stages (layers "
    "per stage, micro-batches), spread rank 0's extra work; a warm-up ends by itself.",
)


def job_findings(snapshot: Snapshot) -> list[Finding]:
    """One finding per job whose GPUs disagree: the straggler (or hang) named, with its cause and the waiters."""
    by_uuid = {gpu.uuid: gpu for gpu in snapshot.gpus}
    return [_job_finding(snapshot, found, by_uuid) for found in snapshot.collective]


def _job_finding(snapshot: Snapshot, found: CollectiveFinding, by_uuid: dict[str, GpuSnapshot]) -> Finding:
    straggler = by_uuid.get(found.straggler) if found.straggler else None
    who = _straggler(snapshot, straggler)
    waiters = [
        {"gpu": by_uuid[u].index if u in by_uuid else None, "uuid": u, "wait_share": share}
        for u, share in found.waiting
    ]
    waiting_text = ", ".join(f"GPU {w['gpu']} {w['wait_share']:.0%}" for w in waiters)  # type: ignore[str-format]
    if found.kind == "collective_hang":
        cause, action = HANG
        check, severity = "collective_hang", "warning"
    elif found.kind == "imbalance":
        cause, action = IMBALANCE
        check, severity = "imbalance", "info"
    else:
        cause, action = STRAGGLER_CAUSES.get(found.cause, STRAGGLER_CAUSES["unknown"])
        check, severity = ("straggler", "warning") if found.kind == "straggler" else ("waiting_elsewhere", "info")
    observed = (
        f"job {found.job}: {_subject(who)} holds the others back ({found.cause}: {found.cause_detail}); "
        f"waiting: {waiting_text}"
    )
    if found.kind == "collective_hang" and who is None:
        observed = f"job {found.job}: {found.cause_detail}; spinning: {waiting_text}"
    structure = {"job": found.job, "kind": found.kind, "straggler": who, "cause": found.cause,
                 "waiting": waiters, "since": found.since}  # fmt: skip
    return Finding(
        None if straggler is None else straggler.index,
        found.straggler,
        check,
        severity,
        observed,
        "a job's GPUs wait alike",
        cause,
        action,
        job=structure,
    )


def _straggler(snapshot: Snapshot, gpu: GpuSnapshot | None) -> dict[str, object] | None:
    """The straggler's GPU, main process, rank and owner; None where it runs on no GPU of this node."""
    member = snapshot.jobs.get(gpu.uuid) if gpu is not None else None
    if gpu is None or member is None:
        return None
    main = next((p for p in snapshot.processes.get(gpu.uuid, ()) if p.pid == member.pid), None)
    return {
        "gpu": gpu.index,
        "uuid": gpu.uuid,
        "pid": member.pid,
        "rank": member.rank,
        "namespace": main.namespace if main else "",
        "pod": main.pod if main else "",
        "slurm_job": main.slurm_job if main else "",
    }


def _subject(who: dict[str, object] | None) -> str:
    if who is None:
        return "no GPU on this node"
    return (
        f"GPU {who['gpu']} ({who['uuid']}, pid {who['pid']}, rank {who['rank']}"
        + (f", {who['namespace']}/{who['pod']}" if who["pod"] else "")
        + (f", Slurm job {who['slurm_job']}" if who["slurm_job"] else "")
        + ")"
    )
