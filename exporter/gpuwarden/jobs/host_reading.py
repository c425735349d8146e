"""What the host evidence of a GPU's main process says: the activity that dominated, and its numbers.

What the host evidence of a GPU's main process says (the shares that jobs/activity.py sums up): the activity that
dominated, and the numbers behind it. Read both by a waiting GPU's advice (jobs/findings.py) and by a straggler's
cause (jobs/collective.py), so the two never disagree. Thresholds and the evidence behind them: docs/diagnosis.md.
"""

from __future__ import annotations

from gpuwarden.model.snapshot import HostEvidence

MIN_SAMPLES = 3
CHECKPOINT_BYTES_PER_SECOND = 50e6  # writing this fast to storage while the GPU waits: a checkpoint...
CHECKPOINT_IO_WAIT = 0.1  # ...if the writes stall a thread this share of the samples, or the main thread idles
# each share and the share of the samples above which it dominates, strongest first
LIMITS = (("io_wait", 0.3), ("workers_running", 0.6), ("main_running", 0.7), ("asleep", 0.7))


def sampled(evidence: HostEvidence | None) -> bool:
    """Whether enough samples were taken to say anything."""
    return evidence is not None and evidence.samples >= MIN_SAMPLES


def dominant(evidence: HostEvidence) -> str | None:
    """checkpoint, io_wait, workers_running, main_running or asleep: what the process did most of the time; None
    where no single activity dominates or too few samples were taken."""
    if not sampled(evidence):
        return None
    written = evidence.write_bytes_per_second
    # a checkpoint where the writes hold the loop up (threads in D state) or the main thread is not busy on its own:
    # a CPU-bound rank that also saves a checkpoint now and then read "writing 111 MB/s" with its main thread running
    # 88 % and no I/O wait on a lent H200 (docs/validation/2026-11-28-h200x2-jobs): cpu
    if (
        written is not None
        and written >= CHECKPOINT_BYTES_PER_SECOND
        and (evidence.io_wait >= CHECKPOINT_IO_WAIT or evidence.main_running < dict(LIMITS)["main_running"])
    ):
        return "checkpoint"
    return next((share for share, limit in LIMITS if getattr(evidence, share) >= limit), None)


def describe(evidence: HostEvidence) -> str:
    """The numbers behind `dominant`, as the findings quote them."""
    written = evidence.write_bytes_per_second
    return (
        f"PID {evidence.pid}, {evidence.samples} samples: main thread running {evidence.main_running:.0%}, I/O wait "
        f"{evidence.io_wait:.0%}, workers running {evidence.workers_running:.0%} ({evidence.workers} workers), all "
        f"asleep {evidence.asleep:.0%}" + ("" if written is None else f", writing {written / 1e6:.0f} MB/s to storage")
    )
