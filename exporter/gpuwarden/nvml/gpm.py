"""GPM (GPU Performance Monitoring): profiling-class activity over a window between two samples, without DCGM.

A sample buffer is an opaque driver object; a public exporter that sampled inside scrapes, with buffers shared by
concurrent scrapes, caused driver null-pointer faults and node reboots. Each `GpmWindow` belongs to one GPU.
Every GPM call in the process also holds `GPM_CALLS`: on driver 580.159.04 two threads inside nvmlGpmMetricsGet at
once, one per GPU, segfaulted the process (docs/nvml.md, GPM: the crash under training). The windows are driven by
gpuwarden.nvml.gpm_sampler, in a child process by default; `InProcessSampler` is what that child runs (and what
`nvml.gpm_isolation: thread` runs in the exporter).
Costs measured on H200 (docs/nvml.md, GPM): a sample ~0.25 ms, 12 metrics from two samples 1.2-3.6 ms.

The GPM child imports this module, so it imports only what the child needs: no dataclasses, typing or logging at
import (each interpreter's copy of them is memory the pod pays twice; tests/test_gpm_containment.py checks the
child's modules).
"""

from __future__ import annotations

import contextlib
import threading

import pynvml

from gpuwarden.nvml import calls, errors, library

TYPE_CHECKING = False  # typing.TYPE_CHECKING without importing typing in the GPM child (gpm.py, its imports)
if TYPE_CHECKING:
    from typing import Any

GPM_CALLS = threading.Lock()  # one GPM call at a time in this process, whichever GPU (see the module docstring)
MIN_WINDOW_S = 0.1  # NVIDIA asks for at least 100 ms between two samples
NOT_SUPPORTED_REASON = "not_supported"
STOP_WAIT_S = 5.0  # how long stop() waits for a GPM call in flight before leaving its buffers allocated
WindowKey = tuple[str, int | None]  # (GPU UUID, MIG GPU instance or None for the whole GPU)


class GpmUnavailable(Exception):
    """GPM cannot be used on this GPU: `reason` is not_supported, no_permission or another NVML error name."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


class Window:
    """GPM metrics over the window between two samples, and those that did not answer (a plain class: see the module
    docstring on the child's imports)."""

    __slots__ = ("seconds", "values", "failed")

    def __init__(self, seconds: float, values: dict[int, float], failed: dict[int, str]) -> None:
        self.seconds = seconds
        self.values = values  # metric id → value over the window (percent, or MiB/s)
        self.failed = failed  # metric id → error name, for metrics that did not answer

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Window):
            return NotImplemented
        return (self.seconds, self.values, self.failed) == (other.seconds, other.values, other.failed)

    __hash__ = None  # type: ignore[assignment]  # mutable dicts inside, as the dataclass had

    def __repr__(self) -> str:
        return f"Window(seconds={self.seconds!r}, values={self.values!r}, failed={self.failed!r})"


def check_support(handle: Any) -> None:
    """Raise GpmUnavailable unless this GPU supports GPM (Hopper and newer, not every SKU)."""
    try:
        with GPM_CALLS:
            support = calls.nvmlGpmQueryDeviceSupport(handle)
    except pynvml.NVMLError as exc:
        raise GpmUnavailable(_reason(exc)) from None
    if not support.isSupportedDevice:
        raise GpmUnavailable(NOT_SUPPORTED_REASON)


class GpmWindow:
    """Two sample buffers of one GPU; `advance()` samples and returns the window since the last.

    Not thread-safe by design: one owner thread (see the module docstring).
    """

    def __init__(self, handle: Any, max_window_s: float = 60.0, gpu_instance: int | None = None) -> None:
        self.handle = handle
        self.gpu_instance = gpu_instance  # a MIG GPU instance of the GPU: samples that slice only
        self.max_window_s = max_window_s
        try:
            with GPM_CALLS:
                self._samples = [calls.nvmlGpmSampleAlloc(), calls.nvmlGpmSampleAlloc()]
        except pynvml.NVMLError as exc:
            raise GpmUnavailable(_reason(exc)) from None
        self._last: int | None = None  # index of the buffer holding the previous sample
        self._last_at = 0.0

    def advance(self, metric_ids: list[int]) -> Window | None:
        """Sample now; the metrics over the window since the previous sample, or None while there is no window
        (first sample, too short: the previous sample is kept, too long: reseeded)."""
        now = library.monotonic()
        if self._last is not None and now - self._last_at < MIN_WINDOW_S:
            return None
        target = 0 if self._last is None else 1 - self._last
        try:
            self._get(self._samples[target])
        except pynvml.NVMLError as exc:
            self._last = None
            _raise_for(exc)
            return None  # a transient failure: the window restarts at the next sample
        previous, previous_at = self._last, self._last_at
        self._last, self._last_at = target, now
        if previous is None or now - previous_at > self.max_window_s:
            return None
        return self._metrics(self._samples[previous], self._samples[target], metric_ids, now - previous_at)

    def free(self) -> None:
        for sample in self._samples:
            with GPM_CALLS, contextlib.suppress(pynvml.NVMLError):
                calls.nvmlGpmSampleFree(sample)
        self._samples = []

    def _get(self, sample: Any) -> None:
        with GPM_CALLS:
            if self.gpu_instance is None:
                calls.nvmlGpmSampleGet(self.handle, sample)
            else:
                calls.nvmlGpmMigSampleGet(self.handle, self.gpu_instance, sample)

    @staticmethod
    def _metrics(first: Any, second: Any, metric_ids: list[int], seconds: float) -> Window | None:
        request = pynvml.c_nvmlGpmMetricsGet_t()
        request.version = pynvml.NVML_GPM_METRICS_GET_VERSION
        request.numMetrics = len(metric_ids)
        request.sample1, request.sample2 = first, second
        for position, metric in enumerate(metric_ids):
            request.metrics[position].metricId = metric
        try:
            with GPM_CALLS:
                calls.nvmlGpmMetricsGet(request)
        except pynvml.NVMLError as exc:
            _raise_for(exc)
            return None  # transient: this window is lost, the next one counts
        values: dict[int, float] = {}
        failed: dict[int, str] = {}
        for position, metric in enumerate(metric_ids):
            entry = request.metrics[position]
            if entry.nvmlReturn == pynvml.NVML_SUCCESS:
                values[metric] = float(entry.value)
            else:
                failed[metric] = errors.error_name(int(entry.nvmlReturn))
        return Window(seconds, values, failed)


def _raise_for(exc: BaseException) -> None:
    """The error policy for GPM calls: unsupported → GpmUnavailable; lost, down, fatal → the exporter's states;
    anything else returns (transient)."""
    kind = errors.classify(exc)
    if kind is errors.ErrorKind.UNSUPPORTED:
        raise GpmUnavailable(_reason(exc)) from None
    if kind is errors.ErrorKind.GPU_LOST:
        raise errors.GpuLostError(_reason(exc)) from None
    if kind is errors.ErrorKind.LIBRARY_DOWN:
        raise errors.NvmlDownError(_reason(exc)) from None
    if kind is errors.ErrorKind.FATAL:
        raise errors.NvmlFatalError(_reason(exc)) from None


def _reason(exc: BaseException) -> str:
    return errors.error_name(errors.error_code(exc))


class InProcessSampler:
    """GPM windows in this process; every call holds gpuwarden.nvml.gpm.GPM_CALLS.

    The sampler's lock is held across a whole advance and a whole free, so that a reload's or shutdown's stop() never
    frees a buffer that a reader is sampling (a use-after-free in the real library). GPM calls are one at a time in
    the process anyway, so holding it costs no concurrency."""

    def __init__(self) -> None:
        self._windows: dict[WindowKey, GpmWindow] = {}
        self._lock = threading.RLock()

    def advance(self, uuid: str, handle: Any, gpu_instance: int | None, metric_ids: list[int]) -> Window | None:
        key = (uuid, gpu_instance)
        with self._lock:
            window = self._windows.get(key)
            if window is None:
                if gpu_instance is None:
                    check_support(handle)
                window = self._windows[key] = GpmWindow(handle, gpu_instance=gpu_instance)
            try:
                return window.advance(metric_ids)
            except GpmUnavailable:
                self.close(uuid, gpu_instance)
                raise

    def close(self, uuid: str, gpu_instance: int | None = None) -> None:
        with self._lock:
            keys = [k for k in self._windows if k[0] == uuid and (gpu_instance is None or k[1] == gpu_instance)]
            for key in keys:
                self._windows.pop(key).free()

    def stop(self) -> None:
        if not self._lock.acquire(timeout=STOP_WAIT_S):
            import logging  # here, not at import: the GPM child never stops this way (module docstring)

            logging.getLogger("gpuwarden.nvml.gpm_sampler").warning(
                "GPM: a call has not returned in %.0f s; its buffers are left allocated, not freed under it",
                STOP_WAIT_S,
            )
            return
        try:
            for uuid in {uuid for uuid, _ in self._windows}:
                self.close(uuid)
        finally:
            self._lock.release()
