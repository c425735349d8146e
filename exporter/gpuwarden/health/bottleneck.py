"""Bottleneck classes from one GPU's window (what its time went to), and the collective spin the job view reads.

Bottleneck classes from one GPU's window (what its time went to): the measured signatures they rest on, and the
collective spin the job view reads. Pure functions of a WindowActivity and the thresholds; health/history.py reads
the window from each GPU's history, jobs/ compares the windows of a job's GPUs. The numbers: docs/diagnosis.md.
"""

from __future__ import annotations

from dataclasses import dataclass

from gpuwarden.health.thresholds import Thresholds


@dataclass(frozen=True)
class WindowActivity:
    """What one GPU did over the bottleneck window: the ratios are shares of the window (GPM), the rates bytes per
    second, `busy` the driver's busy ratio (None until the window has been sampled). `paths`: the transfer paths
    whose counters were read over the whole window ("nvlink", "pcie"): a rate of 0 from a counter not read is no
    evidence that nothing moved. `throttle`: each clock-event reason's share of the window."""

    running: bool  # a process holds the GPU
    sm: float
    tensor: float = 0.0
    fp32: float = 0.0
    fp16: float = 0.0  # the half-precision pipe: bf16/fp16 arithmetic outside the tensor cores
    dram: float = 0.0
    nvlink_bytes_per_second: float = 0.0
    pcie_rx_bytes_per_second: float = 0.0
    busy: float | None = None
    pcie_tx_bytes_per_second: float = 0.0
    paths: frozenset[str] = frozenset()
    throttle: tuple[tuple[str, float], ...] = ()

    @property
    def math(self) -> float:
        """The busiest math pipe: what the GPU computes, whatever the precision."""
        return max(self.tensor, self.fp32, self.fp16)

    @property
    def pcie_bytes_per_second(self) -> float:
        return self.pcie_rx_bytes_per_second + self.pcie_tx_bytes_per_second

    def throttled(self, *reasons: str) -> float:
        """The share of the window the clocks were held down for any of `reasons` (the largest)."""
        return max((share for reason, share in self.throttle if reason in reasons), default=0.0)


def collective_wait(limits: Thresholds, activity: WindowActivity) -> bool:
    """The signature of a rank spinning in a collective for a late peer: the driver busy (NCCL's kernel is
    resident), the SMs no busier than NCCL's CTAs (one per channel: 17-24 % of 132 SMs measured), the math pipes
    idle, device memory and the links quiet. Measured on 2x and 4x H200 (docs/diagnosis.md): waiters at 85-99 %
    busy, DRAM 4-10 %; single-GPU tiny kernels from Python, the launch-bound look-alike, at 28-31 % busy with 0.3 %
    SM; decode replicas, busy with few tensor cycles, read device memory at 40-70 %; a job whose all-reduce crosses
    PCIe moves gigabytes a second there."""
    busy = activity.busy
    return (
        activity.running
        and busy is not None
        and busy >= limits.collective_busy_ratio
        and activity.sm <= limits.collective_sm_ratio
        and activity.math < limits.collective_math_ratio
        and activity.dram < limits.collective_dram_ratio
        and activity.nvlink_bytes_per_second < limits.bottleneck_nvlink_bytes_per_second
        and activity.pcie_bytes_per_second < limits.bottleneck_pcie_bytes_per_second
    )


def bottleneck_class(limits: Thresholds, activity: WindowActivity, peers: int = 0) -> str:
    """What a GPU's time goes to over the window: the limit that dominates, compared with the others, not one
    threshold chain. The math pipes are compared with each other (a bf16 job at 22 % tensor and 2 % FP32 is a
    tensor job); the driver's busy ratio is compared with SM activity (busy while the SMs idle is launch overhead,
    or, on a GPU with peers in its job, a collective waiting for one of them). `peers`: the other ranks of the
    GPU's job. The numbers and the jobs that set them: docs/diagnosis.md."""
    if not activity.running:
        return "idle"
    if _tensor_bound(limits, activity):
        return "tensor_bound"
    if activity.dram >= limits.bottleneck_dram_ratio:
        return "memory_bound"
    if peers and collective_wait(limits, activity):
        return "collective_wait"
    # NCCL's own kernels keep SMs 30-60 % active while they move the data: heavy link traffic with the math
    # pipes idle is communication, whatever the SMs read (measured: 2 GB of gradients a step, SM 46-48 %)
    math_idle = activity.math < limits.bottleneck_tensor_min_ratio
    if math_idle and activity.nvlink_bytes_per_second >= limits.bottleneck_nvlink_busy_bytes_per_second:
        return "communication_bound"
    if activity.sm >= limits.bottleneck_sm_busy_ratio:
        return _busy_sms(limits, activity)
    if activity.sm < limits.bottleneck_sm_idle_ratio:
        return _idle_sms(limits, activity)
    return "mixed"


def _tensor_bound(limits: Thresholds, activity: WindowActivity) -> bool:
    tensor = activity.tensor
    dominates = (
        tensor >= limits.bottleneck_tensor_min_ratio and tensor >= limits.bottleneck_pipe_dominance * activity.fp32
    )
    return tensor >= limits.bottleneck_tensor_ratio or (dominates and activity.sm >= limits.bottleneck_sm_idle_ratio)


def _busy_sms(limits: Thresholds, activity: WindowActivity) -> str:
    """FP32 training only where the FP32 pipe carries the SMs' time and no half-precision pipe is active: never tell
    a job already in bf16 to use bf16. SM-bound work off the math pipes (element-wise, reductions, softmax,
    LayerNorm: SM 99 %, FP32 22 %) is its own class, with fusion as the advice."""
    tensor, fp32 = activity.tensor, activity.fp32
    if fp32 > tensor and fp32 >= limits.bottleneck_fp32_ratio and activity.fp16 < limits.bottleneck_tensor_min_ratio:
        return "compute_without_tensor"
    return "sm_bound_non_matmul" if tensor < limits.bottleneck_tensor_min_ratio else "mixed"


def _idle_sms(limits: Thresholds, activity: WindowActivity) -> str:
    """The SMs mostly idle: what they wait on. Copies count in either direction: a device-to-host copy loop reads
    PCIe tx 16.7 GB/s with SM 0 % (H200), and one into pageable memory 1.6 GB/s at busy 5 %: a GPU that does
    nothing but copy is bound by its transfers however slow they are."""
    busy = activity.busy
    if activity.nvlink_bytes_per_second >= limits.bottleneck_nvlink_bytes_per_second:
        return "communication_bound"
    pcie = max(activity.pcie_rx_bytes_per_second, activity.pcie_tx_bytes_per_second)
    only_copies = activity.sm < limits.bottleneck_copy_sm_ratio and activity.math < limits.bottleneck_copy_sm_ratio
    if pcie >= limits.bottleneck_pcie_bytes_per_second or (
        only_copies and pcie >= limits.bottleneck_copy_only_bytes_per_second
    ):
        return "host_transfer_bound"
    if (
        busy is not None
        and busy >= limits.bottleneck_launch_busy_ratio
        and activity.sm < limits.bottleneck_launch_sm_share * busy
    ):
        return "launch_bound"
    return "waiting"
