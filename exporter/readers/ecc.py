"""ECC counts (volatile: fast; aggregate and mode: slow), remapped rows or, before Ampere, retired pages."""

from __future__ import annotations

import pynvml

from exporter.nvml.device import GpuDevice
from exporter.readers import Reader
from exporter.snapshot import SampleWriter, Tier

_TYPES = {
    "corrected": pynvml.NVML_MEMORY_ERROR_TYPE_CORRECTED,
    "uncorrected": pynvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED,
}
_RETIREMENT_CAUSES = {
    "single_bit": pynvml.NVML_PAGE_RETIREMENT_CAUSE_MULTIPLE_SINGLE_BIT_ECC_ERRORS,
    "double_bit": pynvml.NVML_PAGE_RETIREMENT_CAUSE_DOUBLE_BIT_ECC_ERROR,
}


def _ecc_counts(dev: GpuDevice, out: SampleWriter, counter: int, family: str, scope: str) -> None:
    for label, error_type in _TYPES.items():
        out.add(
            family, dev.call(pynvml.nvmlDeviceGetTotalEccErrors, error_type, counter, key=f"ecc_{scope}_{label}"), label
        )


def read_fast(dev: GpuDevice, out: SampleWriter) -> None:
    _ecc_counts(dev, out, pynvml.NVML_VOLATILE_ECC, "gpuwarden_ecc_errors_total", "volatile")
    remap = dev.call(pynvml.nvmlDeviceGetRemappedRows)
    if remap is not None:
        correctable, uncorrectable, pending, failed = remap
        out.add("gpuwarden_remapped_rows", correctable, "correctable")
        out.add("gpuwarden_remapped_rows", uncorrectable, "uncorrectable")
        out.add("gpuwarden_remapped_rows_pending", 1 if pending else 0)
        out.add("gpuwarden_remapped_rows_failed", 1 if failed else 0)
        return
    if dev.supports("nvmlDeviceGetRemappedRows"):
        return  # transient answer: try again next poll, do not fall back yet
    # Pre-Ampere boards retire pages instead of remapping rows.
    for label, cause in _RETIREMENT_CAUSES.items():
        pages = dev.call(pynvml.nvmlDeviceGetRetiredPages, cause, key=f"retired_{label}")
        out.add("gpuwarden_retired_pages", None if pages is None else len(pages), label)
    pending = dev.call(pynvml.nvmlDeviceGetRetiredPagesPendingStatus)
    out.add("gpuwarden_retired_pages_pending", None if pending is None else (1 if pending else 0))


def read_slow(dev: GpuDevice, out: SampleWriter) -> None:
    mode = dev.call(pynvml.nvmlDeviceGetEccMode)
    if mode is not None:
        out.add("gpuwarden_ecc_enabled", 1 if mode[0] else 0)
    _ecc_counts(dev, out, pynvml.NVML_AGGREGATE_ECC, "gpuwarden_ecc_lifetime_errors_total", "aggregate")


FAST = Reader(
    "ecc",
    Tier.FAST,
    (
        "gpuwarden_ecc_errors_total",
        "gpuwarden_remapped_rows",
        "gpuwarden_remapped_rows_pending",
        "gpuwarden_remapped_rows_failed",
        "gpuwarden_retired_pages",
        "gpuwarden_retired_pages_pending",
    ),
    read_fast,
)
SLOW = Reader("ecc_lifetime", Tier.SLOW, ("gpuwarden_ecc_enabled", "gpuwarden_ecc_lifetime_errors_total"), read_slow)
