"""Findings for humans: what is wrong with a GPU, how sure, the likely cause and what to do.

Built from the health verdicts of the latest snapshot (exporter/gpuwarden/health/checks.py) plus node-level facts (NVML
state, driver, topology). The job view adds its findings and the host's evidence of a waiting GPU
(exporter/gpuwarden/jobs/findings.py); together they are served as /api/v1/diagnosis; the texts follow
docs/runbooks.md.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass

from gpuwarden.health.checks import NOT_READ_YET
from gpuwarden.model.snapshot import Snapshot

# check → (likely cause, recommended action)
ADVICE: dict[str, tuple[str, str]] = {
    "gpu_lost": (
        "The GPU fell off the bus or needs a reset (XID 79, GPU_IS_LOST / RESET_REQUIRED): a hardware, power or "
        "PCIe fault, or a driver failure.",
        "Cordon and drain the node; try `nvidia-smi -r`; otherwise power-cycle and reseat the GPU. RMA if it recurs.",
    ),
    "ecc": (
        "Uncorrectable (double-bit) memory errors: failing HBM. Jobs on this GPU may crash or compute garbage.",
        "Stop its workloads, cordon the node, reset the GPU (pending row remaps apply at reset); request a "
        "replacement if it recurs.",
    ),
    "row_remap": (
        "Memory rows were remapped (pending until the next reset) or a remap failed (no spare rows left).",
        "Pending: reset the GPU at the next maintenance window. Failed: drain, run the field diagnostic, open an RMA.",
    ),
    "page_retirement": (
        "Memory pages were retired for ECC errors (GPUs before Ampere retire pages instead of remapping rows): "
        "pending retirements apply when the driver reloads; at the limit the GPU has no more to give.",
        "Pending: reload the driver or reboot at the next maintenance window. At the limit: drain, run the field "
        "diagnostic, open an RMA.",
    ),
    "xid": (
        "The driver reported a critical XID (reset, reboot or hardware class; see NVIDIA's XID catalog).",
        "Drain the node and reset the GPU; check `dmesg | grep -i xid` and the runbook for that XID.",
    ),
    "nvlink": (
        "An NVLink link that was up went down or logs errors: a link, NVSwitch or baseboard fault.",
        "Drain the node, check `nvidia-smi nvlink -s` and `nvidia-smi topo -m`, reset or reboot; replace the "
        "baseboard if it recurs.",
    ),
    "fabric": (
        "The NVSwitch fabric is not set up for this GPU, or is unhealthy or degraded: Fabric Manager is stopped, "
        "failed, mismatched with the driver, or reports a route or configuration fault. CUDA cannot start (not set "
        "up) or jobs fail or slow down, while the GPU's own readings look healthy.",
        "Check `systemctl status nvidia-fabricmanager` and /var/log/fabricmanager.log; start or restart it (its "
        "version must match the driver's); drain and reboot if the fabric does not complete.",
    ),
    "temperature": (
        "The GPU runs hot: cooling (fans, airflow, inlet temperature, blanking panels) or a bad heatsink.",
        "Check the chassis' cooling and the GPU's neighbours; drain before it reaches its shutdown temperature.",
    ),
    "thermal_throttling": (
        "The clocks are held down for heat (HW/SW thermal slowdown): jobs run slower than they should.",
        "Fix the cooling; compare with the other GPUs in the chassis.",
    ),
    "power": (
        "The power limit is below the board's default, or the external power brake engaged: throughput is lost.",
        "Restore the limit (`nvidia-smi -pl`), find the out-of-band limiter (BMC), check the PSUs and rack budget.",
    ),
    "performance_state": (
        "A busy GPU is held in a low performance state: power, thermal or application-clock limits.",
        "Read the clock-event reasons (`nvidia-smi -q -d PERFORMANCE`), fix power/thermal, reset application clocks.",
    ),
    "memory_pressure": (
        "GPU memory is (nearly) full and the job risks CUDA out-of-memory. The parameter count underestimates "
        "training memory: weights + gradients + optimizer state (Adam: two fp32 moments) + activations; a 7B model "
        "with Adam needs ~100 GB unsharded. Frameworks also preallocate (JAX 75 %, PyTorch's caching allocator).",
        "See the holders below: a second container on the GPU (time-slicing, MPS, a stray notebook) is the first "
        "thing to remove. Then: smaller batch (with gradient accumulation), gradient checkpointing, ZeRO/FSDP "
        "sharding across GPUs, bf16 mixed precision, PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True against "
        "fragmentation, or a GPU with more memory.",
    ),
    "process_exit": (
        "A process left the GPU while its memory was nearly full: the pattern of a CUDA out-of-memory crash (or a "
        "job killed for it). The holders that remain are listed.",
        "Check the exited pod's logs for 'CUDA out of memory'; if another container shares the GPU, move it; "
        "otherwise smaller batch, gradient checkpointing, ZeRO/FSDP, bf16, "
        "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True.",
    ),
    "utilization": (
        "A job holds the GPU but kernels run less than half the time: the GPU waits for data (DataLoader workers, "
        "CPU preprocessing, storage), for communication (all-reduce) or for checkpoints.",
        "Profile first (PyTorch profiler, Nsight Systems). Then: more DataLoader workers, pin_memory, cache the data "
        "set locally, overlap communication, checkpoint asynchronously.",
    ),
    "persistence_mode": (
        "Persistence mode is off: the driver tears the GPU's state down between jobs.",
        "Enable nvidia-persistenced (or `nvidia-smi -pm 1`).",
    ),
    "pcie": (
        "The PCIe link replays packets: seating, riser or cable problems, or a degraded link.",
        "Reseat the GPU and check risers and cables at the next maintenance window.",
    ),
}


# bottleneck class → (what the numbers mean, what to do); information for the job's owners, never paged
BOTTLENECK_ADVICE: dict[str, tuple[str, str]] = {
    "idle": (
        "No process holds the GPU: it is allocated or provisioned but does no work.",
        "Release it or schedule work.",
    ),
    "tensor_bound": (
        "The tensor cores are busy: the job does what these GPUs are built for.",
        "Nothing to fix here: the job already runs its math on the tensor cores (mixed precision); larger batches "
        "or fused kernels may still raise throughput.",
    ),
    "memory_bound": (
        "Device-memory bandwidth is near its peak while the tensor cores wait: element-wise or memory-bound kernels "
        "(optimizer steps, normalisation, attention without fusion) dominate.",
        "Fuse kernels (torch.compile, FlashAttention), use bf16 to halve the bytes moved, larger batches.",
    ),
    "compute_without_tensor": (
        "The SMs are busy but the tensor cores are not: the math runs on the FP32 pipes (FP32 training, TF32 "
        "disabled, or non-matmul work).",
        "Use bf16 mixed precision (torch.autocast) or allow TF32 (torch.backends.cuda.matmul.allow_tf32 = True).",
    ),
    "communication_bound": (
        "The SMs wait while NVLink carries heavy traffic: gradient synchronisation dominates (too many GPUs for the "
        "model, no overlap of communication with compute, or NCCL on the wrong interface).",
        "Overlap all-reduce with backward (DDP buckets, FSDP prefetch), larger per-GPU batches, check NCCL_* "
        "interface settings and `nvidia-smi topo -m`.",
    ),
    "host_transfer_bound": (
        "The SMs wait on copies between host and device over PCIe, in either direction: inputs copied in (PCIe rx) "
        "or results, logits or metrics copied out (PCIe tx) from pageable memory, each copy blocking the stream.",
        "Copy less and less often (keep data and metrics on the GPU, sync them every N steps); pinned host memory "
        "(pin_memory=True, or a pinned buffer for copies out) with non_blocking copies overlapped with compute; "
        "more DataLoader workers for inputs.",
    ),
    "waiting": (
        "A process holds the GPU but the SMs are mostly idle and little moves over NVLink or PCIe: the job waits on "
        "something outside the GPU: its input pipeline, a checkpoint being written, or other ranks. The GPU's "
        "counters cannot tell these apart (low GPU activity is not always data starvation).",
        "Look at the process on the host before changing the input pipeline: DataLoader worker processes busy "
        "(input-bound: more workers, pin_memory, a local cache), threads in D state (I/O: asynchronous or sharded "
        "checkpoints), every thread asleep (waiting on peers or the network: find the slowest rank); "
        "`py-spy dump --pid PID` shows where each thread is.",
    ),
    "sm_bound_non_matmul": (
        "The SMs are busy but neither the tensor cores nor the FP32 pipe carries their time: element-wise work, "
        "reductions, softmax and normalisation kernels, each bound by memory traffic or latency. Precision is not "
        "the lever: a bf16 LayerNorm + softmax job reads SM 99 % with FP32 22 % and tensor 2 %.",
        "Fuse the kernels: torch.compile, fused attention (FlashAttention, scaled_dot_product_attention), fused "
        "LayerNorm/RMSNorm and fused optimizers (AdamW(fused=True)); profile a step to find the largest kernels.",
    ),
    "collective_wait": (
        "The GPU spins in a collective: NCCL's kernel is resident (the driver counts it busy, the SMs read its "
        "CTAs' share), the math pipes are idle and the links quiet. It waits for another rank of its job.",
        "Fix the rank it waits for: see the job's straggler finding on this node, or the fleet's job view when "
        "the job spans nodes; nothing on this GPU needs changing.",
    ),
    "launch_bound": (
        "The driver reports a kernel running much of the time while the SMs barely work: many tiny kernels launched "
        "one by one from Python (launch overhead), or latency-bound kernels.",
        "Fewer, larger kernels: CUDA graphs (torch.cuda.graphs, torch.compile mode='reduce-overhead'), "
        "torch.compile's fusion, larger batches; profile a step to find the small kernels.",
    ),
    "mixed": (
        "Moderate SM activity without one dominant limit.",
        "Profile a step (PyTorch profiler, Nsight Systems) to see where the time goes.",
    ),
}


@dataclass(frozen=True)
class Finding:
    gpu: int | None
    uuid: str | None
    check: str
    severity: str
    observed: str
    threshold: str
    likely_cause: str
    recommended_action: str
    holders: tuple[dict[str, object], ...] = ()  # processes holding the GPU's memory, largest first
    job: dict[str, object] | None = None  # a job finding's structure (jobs/findings.py): job, straggler, cause, waiters


# Findings that name the processes (and pods) on the GPU: whose job is at risk or already failed.
WHO_HOLDS_IT = ("memory_pressure", "ecc", "xid", "gpu_lost")


# (snapshot, GPU UUID, bottleneck class, cause, action) → (cause, action): a bottleneck's advice with what a stage
# above health knows of the GPU's processes (the job view's host evidence: jobs/findings.py)
ExplainBottleneck = Callable[[Snapshot, str, str, str, str], tuple[str, str]]


def diagnose(snapshot: Snapshot, explain: ExplainBottleneck | None = None) -> list[Finding]:
    """The GPUs' and the node's findings from the health verdicts; the job view's come from jobs/findings.py, which
    calls this with its `explain`."""
    findings: list[Finding] = []
    if not snapshot.nvml_up:
        error = snapshot.nvml_error or "unknown"
        if error == "lib_rm_version_mismatch":
            cause = (
                "The NVIDIA kernel driver was upgraded while this process kept the old libnvidia-ml loaded "
                "(driver/library version mismatch)."
            )
            action = "Restart gpuwarden (it exits on its own after a grace period) and any CUDA application."
        else:
            cause = (
                f"NVML is unusable ({error}): the NVIDIA driver is not loaded, still installing, or the "
                "container lacks the NVIDIA runtime (libnvidia-ml.so.1 and /dev/nvidia*)."
            )
            action = (
                "Check `nvidia-smi` and `lsmod | grep nvidia` on the node, `dmesg | grep -i nvrm`; in Kubernetes "
                "run with the NVIDIA runtime (NVIDIA_DRIVER_CAPABILITIES=utility); reload the driver or reboot."
            )
        findings.append(Finding(None, None, "driver", "critical", error, "nvml up", cause, action))
        return findings
    for gpu in snapshot.gpus:
        for verdict in snapshot.health.get(gpu.uuid, ()):
            if verdict.severity == "ok" or verdict.observed == NOT_READ_YET:  # nothing seen: no cause to name yet
                continue
            if verdict.check == "bottleneck":
                cause, action = BOTTLENECK_ADVICE[verdict.detail]
                if explain is not None:
                    cause, action = explain(snapshot, gpu.uuid, verdict.detail, cause, action)
            else:  # a check's own detail where it has advice of its own (page retirement under row_remap)
                cause, action = ADVICE.get(verdict.detail) or ADVICE[verdict.check]
            observed, holders = verdict.observed, ()
            if verdict.check in WHO_HOLDS_IT:
                holders = _holders(snapshot, gpu.uuid)
                # a lost GPU lists no process: its holders are the last ones seen, said as such (not as holding it)
                before_loss = not snapshot.processes.get(gpu.uuid) and bool(snapshot.lost_holders.get(gpu.uuid))
                observed = f"{observed}; {_describe(holders, 'held before the loss by' if before_loss else 'held by')}"
            if verdict.check == "gpu_lost":  # the command for this GPU, not the whole node
                # by PCI bus id where the driver still gave one: indices can shift once a GPU leaves the bus
                target = gpu.info.pci_bus_id or str(gpu.index)
                action = action.replace("`nvidia-smi -r`", f"`nvidia-smi -r -i {target}`")
            findings.append(
                Finding(
                    gpu.index,
                    gpu.uuid,
                    verdict.check,
                    verdict.severity,
                    observed,
                    verdict.threshold,
                    cause,
                    action,
                    holders,
                )
            )
    findings += _process_exits(snapshot)
    findings += _nvlink_missing(snapshot)
    return sorted(findings, key=order)


def order(finding: Finding) -> tuple[int, int, str]:
    """Findings most severe first, node-wide before per-GPU, then by GPU and check."""
    severity = {"critical": 0, "warning": 1, "info": 2}.get(finding.severity, 3)
    return severity, -1 if finding.gpu is None else finding.gpu, finding.check


def _holders(snapshot: Snapshot, uuid: str) -> tuple[dict[str, object], ...]:
    return tuple(
        {
            "pid": p.pid,
            "name": p.name,
            "namespace": p.namespace,
            "pod": p.pod,
            "container": p.container,
            "slurm_job": p.slurm_job,
            "slurm_user": p.slurm_user,
            "used_memory_bytes": p.used_memory_bytes,
            "memory_share": None if p.memory_share is None else round(p.memory_share, 4),
        }
        for p in snapshot.processes.get(uuid) or snapshot.lost_holders.get(uuid, ())
    )


def _who(holder: dict[str, object]) -> str:
    if holder["pod"]:
        return "/".join(str(holder[k]) for k in ("namespace", "pod", "container") if holder[k])
    if holder.get("slurm_job"):
        return f"Slurm job {holder['slurm_job']} ({holder['slurm_user'] or 'unknown user'}, pid {holder['pid']})"
    return f"pid {holder['pid']} ({holder['name'] or 'unknown'}, no pod found)"


def _describe(holders: tuple[dict[str, object], ...], held: str = "held by") -> str:
    """'held by ml/trainer-0/worker 60.0 GiB (75%), …; shared by 2 containers' — the sentence an SRE needs."""
    if not holders:
        return "no process listed (the holder may run in another PID namespace or be the driver itself)"
    parts = []
    for holder in holders[:5]:
        memory = holder["used_memory_bytes"]
        size = "?" if memory is None else f"{int(memory) / 1024**3:.1f} GiB"  # type: ignore[call-overload]
        share = holder["memory_share"]
        pid = f" pid {holder['pid']}" if holder["pod"] else ""  # _who names the PID when no pod was found
        parts.append(f"{_who(holder)}{pid} {size}" + ("" if share is None else f" ({share:.0%})"))
    text = f"{held} " + ", ".join(parts) + ("" if len(holders) <= 5 else f" and {len(holders) - 5} more")
    containers = {(h["namespace"], h["pod"], h["container"]) for h in holders if h["pod"]}
    if len(containers) > 1:
        text += f"; shared by {len(containers)} containers"
    return text


def _process_exits(snapshot: Snapshot) -> list[Finding]:
    cause, action = ADVICE["process_exit"]
    findings = []
    for exit_ in snapshot.process_exits:
        who = f"{exit_.namespace}/{exit_.pod}/{exit_.container}" if exit_.pod else "no pod found"
        memory = "?" if exit_.used_memory_bytes is None else f"{exit_.used_memory_bytes / 1024**3:.1f} GiB"
        holders = _holders(snapshot, exit_.uuid)
        observed = (
            f"pid {exit_.pid} ({exit_.name or 'unknown'}, {who}, {memory}) exited with the GPU "
            f"{exit_.gpu_memory_used_ratio:.1%} full; now {_describe(holders)}"
        )
        findings.append(
            Finding(
                exit_.gpu,
                exit_.uuid,
                "process_exit",
                "warning",
                observed,
                "no exit above 95% used",
                cause,
                action,
                holders,
            )
        )
    return findings


def _nvlink_missing(snapshot: Snapshot) -> list[Finding]:
    """Several GPUs and no NVLink between any pair: a PCIe SKU, or NVLink that should be there and is not."""
    up = [gpu for gpu in snapshot.gpus if gpu.up]
    if len(up) < 2:
        return []
    levels = [peer.level for gpu in up for peer in snapshot.topology.get(gpu.uuid, ())]
    if any(level.startswith("NV") for level in levels):
        return []
    has_links = any(gpu.info.nvlink_links for gpu in up)
    severity = "warning" if has_links else "info"
    cause = (
        "The GPUs have NVLink ports but no pair is joined by an active link: NVSwitch fabric manager not "
        "running, links trained down, or a baseboard fault."
        if has_links
        else "No NVLink between the GPUs: a PCIe SKU or no NVLink bridge. Multi-GPU training communicates over "
        f"PCIe ({', '.join(sorted(set(levels)))}), which is far slower."
    )
    action = (
        "Check `nvidia-smi topo -m` and `nvidia-smi nvlink -s`; on HGX/DGX systems start "
        "nvidia-fabricmanager; reboot; replace the baseboard if links stay down."
        if has_links
        else "Expected on PCIe cards; for multi-GPU training choose SXM/NVLink nodes or install NVLink bridges."
    )
    return [Finding(None, None, "nvlink_topology", severity, "no NV# pair", "NV# between GPUs", cause, action)]


def as_json(snapshot: Snapshot, findings: list[Finding]) -> dict[str, object]:
    driver = dict(snapshot.driver)
    if driver.get("cuda_driver_version"):
        driver["note"] = (
            f"This driver supports CUDA up to {driver['cuda_driver_version']}: an application built "
            "for a newer CUDA fails with 'CUDA driver version is insufficient' (upgrade the driver or "
            "use a matching CUDA build)."
        )
    return {"nvml_up": snapshot.nvml_up, "driver": driver, "findings": [asdict(f) for f in findings]}
