"""ECC counts (volatile: fast; aggregate and mode: slow), remapped rows or, before Ampere, retired pages."""

from __future__ import annotations

from gpuwarden.collect.reader import Reader
from gpuwarden.model.families import (
    ECC_ENABLED,
    ECC_ERRORS_TOTAL,
    ECC_LIFETIME_ERRORS_TOTAL,
    REMAPPED_ROWS,
    REMAPPED_ROWS_FAILED,
    REMAPPED_ROWS_PENDING,
    RETIRED_PAGES,
    RETIRED_PAGES_PENDING,
)
from gpuwarden.model.snapshot import SampleWriter, Tier
from gpuwarden.nvml import calls as nvml
from gpuwarden.nvml.device import GpuDevice

_TYPES = {
    "corrected": nvml.NVML_MEMORY_ERROR_TYPE_CORRECTED,
    "uncorrected": nvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED,
}
_RETIREMENT_CAUSES = {
    "single_bit": nvml.NVML_PAGE_RETIREMENT_CAUSE_MULTIPLE_SINGLE_BIT_ECC_ERRORS,
    "double_bit": nvml.NVML_PAGE_RETIREMENT_CAUSE_DOUBLE_BIT_ECC_ERROR,
}


def _ecc_counts(dev: GpuDevice, out: SampleWriter, counter: int, family: str, scope: str) -> None:
    for label, error_type in _TYPES.items():
        out.add(
            family, dev.call(nvml.nvmlDeviceGetTotalEccErrors, error_type, counter, key=f"ecc_{scope}_{label}"), label
        )


def read_fast(dev: GpuDevice, out: SampleWriter) -> None:
    _ecc_counts(dev, out, nvml.NVML_VOLATILE_ECC, ECC_ERRORS_TOTAL, "volatile")
    remap = dev.call(nvml.nvmlDeviceGetRemappedRows)
    if remap is not None:
        correctable, uncorrectable, pending, failed = remap
        out.add(REMAPPED_ROWS, correctable, "correctable")
        out.add(REMAPPED_ROWS, uncorrectable, "uncorrectable")
        out.add(REMAPPED_ROWS_PENDING, 1 if pending else 0)
        out.add(REMAPPED_ROWS_FAILED, 1 if failed else 0)
        return
    if dev.supports("nvmlDeviceGetRemappedRows"):
        return  # transient answer: try again next poll, do not fall back yet
    # Pre-Ampere boards retire pages instead of remapping rows.
    for label, cause in _RETIREMENT_CAUSES.items():
        pages = dev.call(nvml.nvmlDeviceGetRetiredPages, cause, key=f"retired_{label}")
        out.add(RETIRED_PAGES, None if pages is None else len(pages), label)
    pending = dev.call(nvml.nvmlDeviceGetRetiredPagesPendingStatus)
    out.add(RETIRED_PAGES_PENDING, None if pending is None else (1 if pending else 0))


def read_slow(dev: GpuDevice, out: SampleWriter) -> None:
    mode = dev.call(nvml.nvmlDeviceGetEccMode)
    if mode is not None:
        out.add(ECC_ENABLED, 1 if mode[0] else 0)
    _ecc_counts(dev, out, nvml.NVML_AGGREGATE_ECC, ECC_LIFETIME_ERRORS_TOTAL, "aggregate")


FAST = Reader(
    "ecc",
    Tier.FAST,
    (
        ECC_ERRORS_TOTAL,
        REMAPPED_ROWS,
        REMAPPED_ROWS_PENDING,
        REMAPPED_ROWS_FAILED,
        RETIRED_PAGES,
        RETIRED_PAGES_PENDING,
    ),
    read_fast,
)
SLOW = Reader("ecc_lifetime", Tier.SLOW, (ECC_ENABLED, ECC_LIFETIME_ERRORS_TOTAL), read_slow)
