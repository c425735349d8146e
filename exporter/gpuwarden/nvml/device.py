"""One GPU's handle, with every NVML read routed through the error policy.

Readers call `device.call(fn, ...)`. A value comes back, or None when the series must be omitted. Calls that
proved unsupported are remembered and never retried until the GPU is re-discovered. Errors that change the
GPU's or the library's state are raised as GpuLostError / NvmlDownError / NvmlFatalError for the poller.
"""

from __future__ import annotations

import logging
import threading
from collections import Counter
from collections.abc import Callable, Iterable
from typing import Any

import pynvml

from gpuwarden.nvml import calls
from gpuwarden.nvml.errors import (
    ErrorKind,
    GpuLostError,
    NvmlDownError,
    NvmlFatalError,
    classify,
    error_code,
    error_name,
)

log = logging.getLogger(__name__)

# Consecutive UNKNOWN answers after which a GPU is treated as lost (docs/nvml.md, Error policy).
UNKNOWN_STREAK_LIMIT = 3

FieldKey = tuple[int, int]
_MISMATCH = (pynvml.NVMLError_FunctionNotFound, pynvml.NVMLLibraryMismatchError)


class ErrorLedger:
    """Process-wide error and timeout counters, exported as gpuwarden_collect_*_total."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._errors: Counter[tuple[str, str]] = Counter()
        self._timeouts: Counter[str] = Counter()

    def error(self, call: str, error: str) -> None:
        with self._lock:
            self._errors[(call, error)] += 1

    def timeout(self, call: str) -> None:
        with self._lock:
            self._timeouts[call] += 1

    def errors(self) -> dict[tuple[str, str], int]:
        with self._lock:
            return dict(self._errors)

    def timeouts(self) -> dict[str, int]:
        with self._lock:
            return dict(self._timeouts)


def decode_field(entry: Any) -> float:
    """Read a field value by its declared type (docs/nvml.md, Field values: never guess the union member)."""
    value = entry.value
    return {
        pynvml.NVML_VALUE_TYPE_DOUBLE: lambda: value.dVal,
        pynvml.NVML_VALUE_TYPE_UNSIGNED_INT: lambda: value.uiVal,
        pynvml.NVML_VALUE_TYPE_UNSIGNED_LONG: lambda: value.ulVal,
        pynvml.NVML_VALUE_TYPE_UNSIGNED_LONG_LONG: lambda: value.ullVal,
        pynvml.NVML_VALUE_TYPE_SIGNED_LONG_LONG: lambda: value.sllVal,
        pynvml.NVML_VALUE_TYPE_SIGNED_INT: lambda: value.siVal,
        pynvml.NVML_VALUE_TYPE_UNSIGNED_SHORT: lambda: value.usVal,
    }.get(entry.valueType, lambda: value.ullVal)()


class GpuDevice:
    """A GPU as the poller knows it: stable identity (UUID), current handle, and what it cannot do."""

    def __init__(self, index: int, uuid: str, handle: Any, ledger: ErrorLedger) -> None:
        self.index = index
        self.uuid = uuid
        self.handle = handle
        self.ledger = ledger
        self.state: dict[str, Any] = {}  # readers' accumulators; survives re-discovery
        # Last output of readers that run less often than their tier: reader name → (due at, samples, info)
        self.reader_cache: dict[str, tuple[float, tuple[Any, ...], dict[str, Any]]] = {}
        self.hardware_error: str | None = None
        self.in_flight: dict[int, str] = {}  # thread id → NVML call it is in (what a hung worker is stuck in)
        self._unsupported: set[str] = set()
        self._unsupported_fields: set[FieldKey] = set()
        self._choice: dict[str, int] = {}
        self._unknown_streak = 0

    def rebind(self, handle: Any) -> None:
        """New handle after re-discovery: forget what was learned about support (re-probe)."""
        self.handle = handle
        self.hardware_error = None
        self.reader_cache.clear()
        self._unsupported.clear()
        self._unsupported_fields.clear()
        self._choice.clear()
        self._unknown_streak = 0

    def supports(self, key: str) -> bool:
        return key not in self._unsupported

    def call(self, fn: Callable[..., Any], *args: Any, key: str | None = None, on: Any = None) -> Any:
        """Call `fn(handle, *args)` (or on another handle of this GPU, e.g. a MIG instance's); None means "omit
        the series"."""
        key = key or fn.__name__
        if key in self._unsupported:
            return None
        thread = threading.get_ident()
        self.in_flight[thread] = fn.__name__
        try:
            value = fn(self.handle if on is None else on, *args)
        except _MISMATCH:
            self._mark_unsupported(key, fn.__name__, pynvml.NVML_ERROR_FUNCTION_NOT_FOUND)
            return None
        except pynvml.NVMLError as exc:
            return self._handle(key, fn.__name__, exc)
        finally:
            self.in_flight.pop(thread, None)
        self._unknown_streak = 0
        return value

    def call_first(self, key: str, *alternatives: tuple[Callable[..., Any], tuple[Any, ...]]) -> Any:
        """Try the newest symbol first, fall back on FunctionNotFound, and remember which one works."""
        if key in self._unsupported:
            return None
        for position in range(self._choice.get(key, 0), len(alternatives)):
            fn, args = alternatives[position]
            thread = threading.get_ident()
            self.in_flight[thread] = fn.__name__
            try:
                value = fn(self.handle, *args)
            except _MISMATCH:
                continue
            except pynvml.NVMLError as exc:
                return self._handle(key, fn.__name__, exc)
            finally:
                self.in_flight.pop(thread, None)
            self._choice[key] = position
            self._unknown_streak = 0
            return value
        self._mark_unsupported(key, alternatives[-1][0].__name__, pynvml.NVML_ERROR_FUNCTION_NOT_FOUND)
        return None

    def chosen(self, key: str) -> int | None:
        """Which alternative of `call_first` answered (0 = newest), if any yet."""
        return self._choice.get(key)

    def fields(self, wanted: Iterable[int | FieldKey]) -> dict[FieldKey, float]:
        """One batched nvmlDeviceGetFieldValues; unsupported entries are dropped for good."""
        keys = [w if isinstance(w, tuple) else (w, 0) for w in wanted]
        keys = [k for k in keys if k not in self._unsupported_fields]
        if not keys:
            return {}
        request = [k if k[1] else k[0] for k in keys]
        entries = self.call(calls.nvmlDeviceGetFieldValues, request)
        if entries is None:
            return {}
        values: dict[FieldKey, float] = {}
        for key, entry in zip(keys, entries, strict=True):
            code = int(entry.nvmlReturn)
            if code == pynvml.NVML_SUCCESS:
                values[key] = decode_field(entry)
                continue
            kind = self._kind_of_code(code)
            if kind is ErrorKind.UNSUPPORTED:
                self._unsupported_fields.add(key)
                self.ledger.error(f"field_{key[0]}", error_name(code))
            elif kind is not ErrorKind.NO_DATA:
                self._raise_for(kind, f"field_{key[0]}", code)
        return values

    # -- error policy -------------------------------------------------------------------------------

    @staticmethod
    def _kind_of_code(code: int) -> ErrorKind:
        return classify(pynvml.NVMLError(code))

    def _mark_unsupported(self, key: str, call: str, code: int) -> None:
        self._unsupported.add(key)
        self.ledger.error(call, error_name(code))
        level = logging.WARNING if code == pynvml.NVML_ERROR_NO_PERMISSION else logging.DEBUG
        log.log(level, "gpu %s: %s answers %s; series omitted until re-discovery", self.index, key, error_name(code))

    def _handle(self, key: str, call: str, exc: BaseException) -> None:
        code = error_code(exc)
        kind = classify(exc)
        if kind is ErrorKind.UNSUPPORTED:
            self._mark_unsupported(key, call, code)
            return None
        if kind is ErrorKind.NO_DATA:
            return None
        self._raise_for(kind, call, code)
        return None

    def _raise_for(self, kind: ErrorKind, call: str, code: int) -> None:
        name = error_name(code)
        self.ledger.error(call, name)
        if kind is ErrorKind.GPU_LOST:
            raise GpuLostError(name)
        if kind is ErrorKind.LIBRARY_DOWN:
            raise NvmlDownError(name)
        if kind is ErrorKind.FATAL:
            raise NvmlFatalError(name)
        if kind is ErrorKind.HARDWARE:
            self.hardware_error = name
            return
        self._unknown_streak += 1
        if self._unknown_streak >= UNKNOWN_STREAK_LIMIT:
            raise GpuLostError(f"{name}_repeated")
