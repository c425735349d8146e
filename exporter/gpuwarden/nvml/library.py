"""Which libnvidia-ml pynvml talks to: the real one (loaded lazily by pynvml) or the simulator's fake.

pynvml resolves every C symbol through the module-level `nvmlLib` and caches the lookups; it loads the real
shared object only while `nvmlLib` is unset. Installing the fake therefore means: set it, clear the cache,
reset the init refcount. Nothing above this module knows which library answers.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import pynvml

TYPE_CHECKING = False  # typing.TYPE_CHECKING without importing typing in the GPM child (gpm.py, its imports)
if TYPE_CHECKING:  # the GPM child imports this module and never lists the driver's GPUs: nothing of it is loaded there
    from typing import Any

    from gpuwarden.nvml.driver_gpus import DriverGpu

_monotonic: Callable[[], float] = time.monotonic
_child_spec: dict[str, Any] | None = {"backend": "nvml"}
_driver_gpus: Callable[[], list[DriverGpu]] | None = None  # None: the kernel driver's (read_driver_gpus)
_uptime: Callable[[], float] = time.monotonic
HOST_KERNEL_LOG = "/dev/kmsg"


def _host_kernel_log() -> str:
    return HOST_KERNEL_LOG


_kernel_log: Callable[[], str] = _host_kernel_log
_nvswitches: Callable[[], list[str]] | None = None  # None: the host's PCI bus (nvml.nvswitches)
_host_proc: Callable[[], str] = str  # "": the host's /proc is what processes.proc_root says (unset: none)


def monotonic() -> float:
    """Seconds on the installed library's clock: the real one's is the host's, the simulator's is its scenario
    time (tests move it by hand). Windows between two driver samples (GPM) are measured on it."""
    return _monotonic()


def child_spec() -> dict[str, Any] | None:
    """How a child process loads the same library (gpuwarden.nvml.gpm_child), or None where it cannot."""
    return _child_spec


def driver_gpus() -> list[DriverGpu]:
    """The GPUs the kernel driver lists (gpuwarden.nvml.driver_gpus); the simulator's driver answers for its own."""
    if _driver_gpus is None:
        from gpuwarden.nvml.driver_gpus import read_driver_gpus

        return read_driver_gpus()
    return _driver_gpus()


def uptime() -> float:
    """Seconds since the host booted, on the clock the kernel log stamps its records with (the monotonic clock);
    the simulator's host has booted before its scenario began."""
    return _uptime()


def kernel_log() -> str:
    """The kernel log beside the installed library: /dev/kmsg, or the simulator's file of its scenario's records
    ("" when it has none)."""
    return _kernel_log()


def nvswitches() -> list[str]:
    """The NVSwitches on the PCI bus beside the installed library (gpuwarden.nvml.nvswitches), by PCI address; the
    simulator answers for its baseboard's."""
    if _nvswitches is None:
        from gpuwarden.nvml.nvswitches import read_nvswitches

        return read_nvswitches()
    return _nvswitches()


def host_proc() -> str:
    """The simulator's /proc of its scenario's host processes, read by the job view where processes.proc_root is
    unset; "" under the real library (the host's /proc is read only where configured)."""
    return _host_proc()


def install(
    library: Any,
    clock: Callable[[], float] | None = None,
    child_spec: dict[str, Any] | None = None,
    driver: Callable[[], list[DriverGpu]] | None = None,
    uptime: Callable[[], float] | None = None,
    kernel_log: Callable[[], str] | None = None,
    nvswitches: Callable[[], list[str]] | None = None,
    host_proc: Callable[[], str] | None = None,
) -> None:
    """Put `library` beneath pynvml (None restores lazy loading of the real libnvidia-ml.so.1), with its clock;
    `child_spec`: how a child process installs the same one (None: it cannot); `driver`: the kernel driver's
    GPU list beside it (None: /proc/driver/nvidia); `uptime`, `kernel_log` and `nvswitches`: the host's (None: this
    host's); `host_proc`: the simulated host's /proc (None: none)."""
    global _monotonic, _child_spec, _driver_gpus, _uptime, _kernel_log, _nvswitches, _host_proc
    _monotonic = clock or time.monotonic
    _driver_gpus = driver
    _uptime = uptime or time.monotonic
    _kernel_log = kernel_log or _host_kernel_log
    _nvswitches = nvswitches
    _host_proc = host_proc or str
    _child_spec = {"backend": "nvml"} if library is None else child_spec
    with pynvml.libLoadLock:
        pynvml.nvmlLib = library
        pynvml._nvmlGetFunctionPointer_cache.clear()
        pynvml._nvmlLib_refcount = 0
