"""NVML's lifecycle as plain calls: init with the driver's versions, opening a GPU by index or UUID, shutdown.

Each function raises the exporter's own errors (NvmlDownError, GpuLostError, GpuSkipped), never pynvml's, and
records the NVML call it is inside per thread, so that a caller that abandons a hung call at its deadline can say
which one hung. The deadlines themselves are the caller's (gpuwarden.collect.lifecycle runs these on worker threads).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import pynvml

from gpuwarden.nvml import calls, library
from gpuwarden.nvml.driver_gpus import DriverGpu
from gpuwarden.nvml.errors import ErrorKind, GpuLostError, NvmlDownError, classify, error_code, error_name

if TYPE_CHECKING:
    from gpuwarden.workers import WorkerPool

_in_flight: dict[int, str] = {}  # thread id → the NVML call it is inside


class GpuSkipped(Exception):
    """A GPU that discovery cannot open (no permission in this container, lost): left out with a log line."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


@dataclass(frozen=True)
class DriverFacts:
    """The driver's, NVML's and CUDA's versions, as the driver reports them."""

    driver_version: str
    nvml_version: str
    cuda_driver_version: str

    def as_dict(self) -> dict[str, str]:
        return {
            "driver_version": self.driver_version,
            "nvml_version": self.nvml_version,
            "cuda_driver_version": self.cuda_driver_version,
        }


def in_flight(thread_id: int | None) -> str | None:
    """The NVML call a thread is inside, if any (what a hung lifecycle job is stuck in)."""
    return None if thread_id is None else _in_flight.get(thread_id)


def _call(operation: Callable[..., Any], *args: Any) -> Any:
    thread = threading.get_ident()
    _in_flight[thread] = operation.__name__
    try:
        return operation(*args)
    finally:
        _in_flight.pop(thread, None)


def initialise() -> tuple[DriverFacts, int]:
    """nvmlInit (no GPUs needed: a GPU-less node reports nvml_up 0 instead of crashing), versions, GPU count."""
    try:
        _call(calls.nvmlInitWithFlags, calls.NVML_INIT_FLAG_NO_GPUS)
        facts = DriverFacts(
            driver_version=_text(_call(calls.nvmlSystemGetDriverVersion)),
            nvml_version=_text(_call(calls.nvmlSystemGetNVMLVersion)),
            cuda_driver_version=_cuda_version(_call(calls.nvmlSystemGetCudaDriverVersion_v2)),
        )
        return facts, int(_call(calls.nvmlDeviceGetCount))
    except pynvml.NVMLError as exc:
        raise NvmlDownError(error_name(error_code(exc))) from None


def open_index(index: int) -> tuple[Any, str]:
    """The handle and UUID of the GPU at `index`."""
    try:
        handle = _call(calls.nvmlDeviceGetHandleByIndex, index)
        return handle, _text(_call(calls.nvmlDeviceGetUUID, handle))
    except pynvml.NVMLError as exc:
        # the library gone, or the driver changed under this process (fatal: the poller exits for a restart); a
        # mismatch met while opening the GPUs was served as a lost GPU for good (the daemon never exited)
        if classify(exc) in (ErrorKind.LIBRARY_DOWN, ErrorKind.FATAL):
            raise NvmlDownError(error_name(error_code(exc))) from None
        raise GpuSkipped(error_name(error_code(exc))) from None


def open_uuid(uuid: str) -> Any:
    """A fresh handle for a GPU known by UUID (indexes can change when a GPU comes back)."""
    try:
        return _call(calls.nvmlDeviceGetHandleByUUID, uuid)
    except pynvml.NVMLError as exc:
        raise GpuLostError(error_name(error_code(exc))) from None


def driver_gpus() -> list[DriverGpu]:
    """The GPUs the kernel driver lists, a lost one included (gpuwarden.nvml.driver_gpus); no NVML call."""
    return library.driver_gpus()


def shutdown() -> None:
    with contextlib.suppress(pynvml.NVMLError):
        _call(calls.nvmlShutdown)


def _text(value: str | bytes) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _cuda_version(raw: int) -> str:
    """13000 → '13.0' (nvidia-smi's CUDA Version)."""
    return f"{raw // 1000}.{raw % 1000 // 10}"


def start_init(pool: WorkerPool) -> concurrent.futures.Future[Any] | None:
    """Begin `initialise` on the pool's NVML-init worker now, for the lifecycle to adopt at its first init (the
    same key, so a hang is seen and counted as before): the driver's start, ~20 ms of C on an H100 host, then
    overlaps the import of the poller and the HTTP stack."""
    return pool.submit("nvml-init", initialise)
