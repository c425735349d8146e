"""A scenario's faults: what NVML fails or reports, on which GPU, from when, how often (docs/simulator.md, Faults)."""

from __future__ import annotations

from typing import Literal, get_args

from pydantic import Field, model_validator

from gpuwarden.sim.trajectory import StrictModel

ERROR_CODES = {
    "uninitialized": 1,
    "invalid_argument": 2,
    "not_supported": 3,
    "no_permission": 4,
    "not_found": 6,
    "insufficient_power": 8,
    "driver_not_loaded": 9,
    "timeout": 10,
    "irq_issue": 11,
    "library_not_found": 12,
    "function_not_found": 13,
    "corrupted_inforom": 14,
    "gpu_is_lost": 15,
    "reset_required": 16,
    "lib_rm_version_mismatch": 18,
    "gpu_not_found": 28,
    "unknown": 999,
}

# windows: active from `at` until `until` (or for `duration` every `every` seconds)
WindowKind = Literal[
    "gpu_lost",
    "hang",
    "crash",  # the process dies inside `call` as on a segfault in the driver's library (SIGSEGV)
    "error",
    "not_supported",
    "driver_unloaded",
    "library_missing",
    "version_mismatch",
    "nvlink_down",
    "remap_pending",
    "remap_failed",
    "retired_pages_pending",
    # NVSwitch fabric (nvlink: nvswitch nodes): Fabric Manager not started, set-up still in progress, set up with
    # degraded bandwidth (a trunk link lost), or with an unhealthy route
    "fabric_not_started",
    "fabric_in_progress",
    "fabric_degraded",
    "fabric_unhealthy",
]
# events: fire at `at` (and every `every` seconds), adding `count` each time
EventKind = Literal["xid", "ecc", "nvlink_errors", "pcie_replay", "remapped_rows", "retired_pages"]
FaultKind = Literal[WindowKind, EventKind]
_WINDOW_KINDS = frozenset(get_args(WindowKind))
_GLOBAL_KINDS = {"driver_unloaded", "library_missing", "version_mismatch"}


class Fault(StrictModel):
    kind: FaultKind
    gpu: int | None = Field(None, ge=0, description="GPU index; omitted = every GPU")
    at: float = Field(0.0, ge=0)
    until: float | None = None
    every: float | None = Field(None, gt=0)
    duration: float | None = Field(None, gt=0)
    call: str | None = None
    field: int | None = None
    code: str | None = None
    xid: int | None = Field(None, ge=0)
    count: int = Field(1, ge=1, le=1_000_000)
    type: str | None = None
    link: int | None = Field(None, ge=0)
    cause: Literal["correctable", "uncorrectable", "single_bit", "double_bit"] | None = None

    @model_validator(mode="after")
    def _kind_fields(self) -> Fault:
        need: dict[str, tuple[str, ...]] = {
            "hang": ("call",),
            "crash": ("call",),
            "error": ("call", "code"),
            "xid": ("xid",),
            "ecc": ("type",),
            "nvlink_down": ("link",),
            "nvlink_errors": ("link", "type"),
            "remapped_rows": ("cause",),
            "retired_pages": ("cause",),
        }
        for name in need.get(self.kind, ()):
            if getattr(self, name) is None:
                raise ValueError(f"a '{self.kind}' fault needs '{name}'")
        if self.kind == "not_supported" and self.call is None and self.field is None:
            raise ValueError("a 'not_supported' fault needs 'call' (a C symbol) or 'field' (a field id)")
        if self.code is not None and self.code not in ERROR_CODES:
            raise ValueError(f"unknown code; choose one of {', '.join(ERROR_CODES)}")
        if self.kind == "ecc" and self.type not in ("corrected", "uncorrected"):
            raise ValueError("an 'ecc' fault's type is corrected or uncorrected")
        if self.kind == "nvlink_errors" and self.type not in ("crc_flit", "crc_data", "replay", "recovery", "ecc"):
            raise ValueError("an 'nvlink_errors' fault's type is crc_flit, crc_data, replay, recovery or ecc")
        if self.until is not None and self.until <= self.at:
            raise ValueError("'until' must be later than 'at'")
        if (self.every is None) != (self.duration is None) and self.kind in _WINDOW_KINDS:
            raise ValueError("a repeating window needs both 'every' and 'duration'")
        return self

    @property
    def is_global(self) -> bool:
        return self.kind in _GLOBAL_KINDS

    def applies_to(self, gpu: int) -> bool:
        return self.gpu is None or self.gpu == gpu

    def active(self, t: float) -> bool:
        """For window faults: is the fault in force at time t?"""
        if t < self.at or (self.until is not None and t >= self.until):
            return False
        if self.every is not None and self.duration is not None:
            return (t - self.at) % self.every < self.duration
        return True

    def occurrences(self, t: float) -> int:
        """For event faults: how many times it has fired by time t."""
        if t < self.at:
            return 0
        end = t if self.until is None else min(t, self.until - 1e-9)
        if self.every is None:
            return 1
        return int((end - self.at) // self.every) + 1
