"""Classify NVML errors once, so the rest of the exporter handles states, never return codes.

The policy is the table in docs/nvml.md, Error policy.
"""

from __future__ import annotations

import enum

import pynvml


class ErrorKind(enum.Enum):
    UNSUPPORTED = "unsupported"  # absent on this SKU/driver: omit the series, remember, do not retry
    NO_DATA = "no_data"  # normal "nothing new" answers (no new samples, event timeout)
    TRANSIENT = "transient"  # count and omit; repeated → GPU lost
    GPU_LOST = "gpu_lost"  # this GPU fell off the bus or needs a reset
    LIBRARY_DOWN = "library_down"  # driver unloaded / NVML uninitialised: re-init with backoff
    FATAL = "fatal"  # driver upgraded under us: exit so we get restarted
    HARDWARE = "hardware"  # InfoROM/IRQ/power problems: mark the GPU unhealthy


_KIND_BY_CODE: dict[int, ErrorKind] = {
    pynvml.NVML_ERROR_NOT_SUPPORTED: ErrorKind.UNSUPPORTED,
    pynvml.NVML_ERROR_FUNCTION_NOT_FOUND: ErrorKind.UNSUPPORTED,
    pynvml.NVML_ERROR_NO_PERMISSION: ErrorKind.UNSUPPORTED,
    pynvml.NVML_ERROR_INVALID_ARGUMENT: ErrorKind.UNSUPPORTED,
    pynvml.NVML_ERROR_NOT_FOUND: ErrorKind.NO_DATA,
    pynvml.NVML_ERROR_NO_DATA: ErrorKind.NO_DATA,
    pynvml.NVML_ERROR_TIMEOUT: ErrorKind.NO_DATA,
    pynvml.NVML_ERROR_GPU_IS_LOST: ErrorKind.GPU_LOST,
    pynvml.NVML_ERROR_GPU_NOT_FOUND: ErrorKind.GPU_LOST,
    pynvml.NVML_ERROR_RESET_REQUIRED: ErrorKind.GPU_LOST,
    pynvml.NVML_ERROR_UNINITIALIZED: ErrorKind.LIBRARY_DOWN,
    pynvml.NVML_ERROR_DRIVER_NOT_LOADED: ErrorKind.LIBRARY_DOWN,
    pynvml.NVML_ERROR_LIBRARY_NOT_FOUND: ErrorKind.LIBRARY_DOWN,
    pynvml.NVML_ERROR_LIB_RM_VERSION_MISMATCH: ErrorKind.FATAL,
    pynvml.NVML_ERROR_CORRUPTED_INFOROM: ErrorKind.HARDWARE,
    pynvml.NVML_ERROR_IRQ_ISSUE: ErrorKind.HARDWARE,
    pynvml.NVML_ERROR_INSUFFICIENT_POWER: ErrorKind.HARDWARE,
}

_NAME_BY_CODE = {
    value: name.removeprefix("NVML_ERROR_").lower()
    for name, value in vars(pynvml).items()
    if name.startswith("NVML_ERROR_") and isinstance(value, int)
}


def error_code(exc: BaseException) -> int:
    """The NVML return code of an exception (pynvml errors are unhashable: key on the int)."""
    if isinstance(exc, pynvml.NVMLLibraryMismatchError):
        return pynvml.NVML_ERROR_FUNCTION_NOT_FOUND
    return int(getattr(exc, "value", pynvml.NVML_ERROR_UNKNOWN))


def classify(exc: BaseException) -> ErrorKind:
    return _KIND_BY_CODE.get(error_code(exc), ErrorKind.TRANSIENT)


def error_name(code: int) -> str:
    """A stable lower_snake label value for a return code, e.g. 15 → 'gpu_is_lost'."""
    return _NAME_BY_CODE.get(code, f"code_{code}")


class GpuLostError(Exception):
    """Raised out of a GPU's reads when the GPU must be marked down."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


class NvmlDownError(Exception):
    """Raised out of any read when the library itself is gone; the poller re-initialises."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


class NvmlFatalError(Exception):
    """The driver was upgraded under the process: only a restart helps."""
