"""Which libnvidia-ml pynvml talks to: the real one (loaded lazily by pynvml) or the simulator's fake.

pynvml resolves every C symbol through the module-level `nvmlLib` and caches the lookups; it loads the real
shared object only while `nvmlLib` is unset. Installing the fake therefore means: set it, clear the cache,
reset the init refcount. Nothing above this module knows which library answers.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import pynvml

from gpuwarden.nvml.driver_gpus import DriverGpu, read_driver_gpus

_monotonic: Callable[[], float] = time.monotonic
_child_spec: dict[str, Any] | None = {"backend": "nvml"}
_driver_gpus: Callable[[], list[DriverGpu]] = read_driver_gpus


def monotonic() -> float:
    """Seconds on the installed library's clock: the real one's is the host's, the simulator's is its scenario
    time (tests move it by hand). Windows between two driver samples (GPM) are measured on it."""
    return _monotonic()


def child_spec() -> dict[str, Any] | None:
    """How a child process loads the same library (gpuwarden.nvml.gpm_child), or None where it cannot."""
    return _child_spec


def driver_gpus() -> list[DriverGpu]:
    """The GPUs the kernel driver lists (gpuwarden.nvml.driver_gpus); the simulator's driver answers for its own."""
    return _driver_gpus()


def install(
    library: Any,
    clock: Callable[[], float] | None = None,
    child_spec: dict[str, Any] | None = None,
    driver: Callable[[], list[DriverGpu]] | None = None,
) -> None:
    """Put `library` beneath pynvml (None restores lazy loading of the real libnvidia-ml.so.1), with its clock;
    `child_spec`: how a child process installs the same one (None: it cannot); `driver`: the kernel driver's
    GPU list beside it (None: /proc/driver/nvidia)."""
    global _monotonic, _child_spec, _driver_gpus
    _monotonic = clock or time.monotonic
    _driver_gpus = driver or read_driver_gpus
    _child_spec = {"backend": "nvml"} if library is None else child_spec
    with pynvml.libLoadLock:
        pynvml.nvmlLib = library
        pynvml._nvmlGetFunctionPointer_cache.clear()
        pynvml._nvmlLib_refcount = 0
