"""Every NVML operation gpuwarden performs, in one table, with what an error from it means.

Nothing outside `gpuwarden.nvml` imports pynvml: readers, topology, events and the poller call the operations
and read the constants named here. Device reads go through `GpuDevice.call`, which applies the per-return-code
policy of docs/nvml.md, Error policy; the `on_error` column says what the caller does beyond that table. The
table is printed in docs/nvml.md (tests/test_boundaries.py keeps the two in step).
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable

import pynvml
from pynvml import (  # noqa: F401 - the constants the readers and topology use, re-exported as calls.<name>
    NVML_AGGREGATE_ECC,
    NVML_CLOCK_GRAPHICS,
    NVML_CLOCK_MEM,
    NVML_CLOCK_SM,
    NVML_FI_DEV_CLOCKS_EVENT_REASON_HW_POWER_BRAKE_SLOWDOWN,
    NVML_FI_DEV_CLOCKS_EVENT_REASON_HW_THERM_SLOWDOWN,
    NVML_FI_DEV_CLOCKS_EVENT_REASON_SW_THERM_SLOWDOWN,
    NVML_FI_DEV_GET_GPU_RECOVERY_ACTION,
    NVML_FI_DEV_MEMORY_TEMP,
    NVML_FI_DEV_NVLINK_ECC_DATA_ERROR_COUNT_L0,
    NVML_FI_DEV_NVLINK_ECC_DATA_ERROR_COUNT_L11,
    NVML_FI_DEV_NVLINK_ERROR_DL_CRC,
    NVML_FI_DEV_NVLINK_ERROR_DL_RECOVERY,
    NVML_FI_DEV_NVLINK_ERROR_DL_REPLAY,
    NVML_FI_DEV_NVLINK_GET_STATE,
    NVML_FI_DEV_NVLINK_LINK_COUNT,
    NVML_FI_DEV_NVSWITCH_CONNECTED_LINK_COUNT,
    NVML_FI_DEV_PCIE_COUNT_RX_BYTES,
    NVML_FI_DEV_PCIE_COUNT_TX_BYTES,
    NVML_FI_DEV_PERF_POLICY_BOARD_LIMIT,
    NVML_FI_DEV_PERF_POLICY_LOW_UTILIZATION,
    NVML_FI_DEV_PERF_POLICY_POWER,
    NVML_FI_DEV_PERF_POLICY_RELIABILITY,
    NVML_FI_DEV_PERF_POLICY_SYNC_BOOST,
    NVML_FI_DEV_PERF_POLICY_THERMAL,
    NVML_GPM_METRIC_ANY_TENSOR_UTIL,
    NVML_GPM_METRIC_DRAM_BW_UTIL,
    NVML_GPM_METRIC_FP16_UTIL,
    NVML_GPM_METRIC_FP32_UTIL,
    NVML_GPM_METRIC_FP64_UTIL,
    NVML_GPM_METRIC_GRAPHICS_UTIL,
    NVML_GPM_METRIC_NVLINK_TOTAL_RX_PER_SEC,
    NVML_GPM_METRIC_NVLINK_TOTAL_TX_PER_SEC,
    NVML_GPM_METRIC_PCIE_RX_PER_SEC,
    NVML_GPM_METRIC_PCIE_TX_PER_SEC,
    NVML_GPM_METRIC_SM_OCCUPANCY,
    NVML_GPM_METRIC_SM_UTIL,
    NVML_GPU_UTILIZATION_SAMPLES,
    NVML_INIT_FLAG_NO_GPUS,
    NVML_MEMORY_ERROR_TYPE_CORRECTED,
    NVML_MEMORY_ERROR_TYPE_UNCORRECTED,
    NVML_MEMORY_UTILIZATION_SAMPLES,
    NVML_P2P_CAPS_INDEX_NVLINK,
    NVML_P2P_STATUS_NOT_SUPPORTED,
    NVML_P2P_STATUS_OK,
    NVML_PAGE_RETIREMENT_CAUSE_DOUBLE_BIT_ECC_ERROR,
    NVML_PAGE_RETIREMENT_CAUSE_MULTIPLE_SINGLE_BIT_ECC_ERRORS,
    NVML_SUCCESS,
    NVML_TEMPERATURE_GPU,
    NVML_TEMPERATURE_THRESHOLD_GPU_MAX,
    NVML_TEMPERATURE_THRESHOLD_MEM_MAX,
    NVML_TEMPERATURE_THRESHOLD_SHUTDOWN,
    NVML_TEMPERATURE_THRESHOLD_SLOWDOWN,
    NVML_TOPOLOGY_HOSTBRIDGE,
    NVML_TOPOLOGY_INTERNAL,
    NVML_TOPOLOGY_MULTIPLE,
    NVML_TOPOLOGY_NODE,
    NVML_TOPOLOGY_SINGLE,
    NVML_TOPOLOGY_SYSTEM,
    NVML_VALUE_TYPE_DOUBLE,
    NVML_VALUE_TYPE_SIGNED_INT,
    NVML_VALUE_TYPE_SIGNED_LONG_LONG,
    NVML_VALUE_TYPE_UNSIGNED_INT,
    NVML_VALUE_TYPE_UNSIGNED_LONG,
    NVML_VALUE_TYPE_UNSIGNED_LONG_LONG,
    NVML_VALUE_TYPE_UNSIGNED_SHORT,
    NVML_VOLATILE_ECC,
    nvmlEventTypeXidCriticalError,
    nvmlMemory_v2,
)

TYPE_CHECKING = False  # typing.TYPE_CHECKING without importing typing in the GPM child (gpm.py, its imports)
if TYPE_CHECKING:
    from typing import Any

# What each role means for an error, beyond the return-code table.
READ = "unsupported: series omitted, not retried until re-discovery; lost/down/fatal change the GPU or library state"
LIFECYCLE = "any error: nvml_up 0, re-init with backoff 1-30 s; lib_rm_version_mismatch: exit for a restart"
DISCOVERY = "no_permission or lost: the GPU is skipped with a log line; a hang is abandoned at the call deadline"
EVENTS = "unknown: the event set is rebuilt; not_supported: the GPU is not registered; timeout is normal"
GPM = (
    "unsupported or no_permission: no profiling series for that GPU (a gauge says why); not retried until re-discovery"
)


class Operation:
    """One NVML entry point: callable like the pynvml function it wraps, named like the C symbol."""

    __slots__ = ("__name__", "fn", "tier", "on_error")

    def __init__(self, fn: Callable[..., Any], tier: str, on_error: str = READ) -> None:
        self.__name__ = fn.__name__
        self.fn = fn
        self.tier = tier
        self.on_error = on_error

    def __call__(self, *args: Any) -> Any:
        return self.fn(*args)

    def __repr__(self) -> str:
        return f"Operation({self.__name__})"


def _gpu_fabric_info(handle: Any) -> Any:
    """The GPU's NVSwitch fabric info in the newest structure the driver takes (v3 with the health summary, else
    v2), passed by pointer: pynvml's nvmlDeviceGetGpuFabricInfoV hands the driver whatever it is given, and a
    structure passed by value crashed a process inside libnvidia-ml on a lent H200 (issue 39)."""
    for structure, version in (
        (pynvml.c_nvmlGpuFabricInfo_v3_t, pynvml.nvmlGpuFabricInfo_v3),
        (pynvml.c_nvmlGpuFabricInfo_v2_t, pynvml.nvmlGpuFabricInfo_v2),
    ):
        info = structure()
        info.version = version
        try:
            pynvml.nvmlDeviceGetGpuFabricInfoV(handle, ctypes.byref(info))
        except pynvml.NVMLError_ArgumentVersionMismatch:
            continue
        return info
    raise pynvml.NVMLError(pynvml.NVML_ERROR_ARGUMENT_VERSION_MISMATCH)


_gpu_fabric_info.__name__ = "nvmlDeviceGetGpuFabricInfoV"


# Every operation, in the order docs/nvml.md prints them: the C symbol (pynvml's function of that name, or ours
# above), the tier that calls it, and what an error from it means beyond the return-code table (READ where the row
# names nothing).
_TABLE: tuple[tuple[str, ...], ...] = (
    # -- lifecycle and discovery (gpuwarden.nvml.session)
    ("nvmlInitWithFlags", "lifecycle", LIFECYCLE),
    ("nvmlShutdown", "lifecycle", "skipped while a call is wedged; errors ignored at exit"),
    ("nvmlSystemGetDriverVersion", "lifecycle", LIFECYCLE),
    ("nvmlSystemGetNVMLVersion", "lifecycle", LIFECYCLE),
    ("nvmlSystemGetCudaDriverVersion_v2", "lifecycle", LIFECYCLE),
    ("nvmlDeviceGetCount", "lifecycle", LIFECYCLE),
    ("nvmlDeviceGetHandleByIndex", "discovery", DISCOVERY),
    ("nvmlDeviceGetUUID", "discovery", DISCOVERY),
    ("nvmlDeviceGetHandleByUUID", "discovery", "any error: the GPU stays lost, retried with backoff 1-30 s"),
    # -- static tier (readers, at discovery)
    ("nvmlDeviceGetName", "static"),
    ("nvmlDeviceGetSerial", "static"),
    ("nvmlDeviceGetPciInfo_v3", "static"),
    ("nvmlDeviceGetVbiosVersion", "static"),
    ("nvmlDeviceGetMinorNumber", "static", READ + "; DRA names a GPU gpu-<minor>"),
    ("nvmlDeviceGetCudaComputeCapability", "static"),
    ("nvmlDeviceGetMaxClockInfo", "static"),
    ("nvmlDeviceGetTemperatureThreshold", "static"),
    ("nvmlDeviceGetPowerManagementDefaultLimit", "static"),
    ("nvmlDeviceGetMaxPcieLinkGeneration", "static"),
    ("nvmlDeviceGetMaxPcieLinkWidth", "static"),
    ("nvmlDeviceGetNvLinkRemotePciInfo", "static"),
    ("nvmlDeviceGetTopologyCommonAncestor", "topology"),
    ("nvmlDeviceGetP2PStatus", "topology"),
    # -- fast tier
    ("nvmlDeviceGetSamples", "fast", READ + "; not_found means no new samples"),
    ("nvmlDeviceGetUtilizationRates", "fast"),
    ("nvmlDeviceGetEncoderUtilization", "fast"),
    ("nvmlDeviceGetDecoderUtilization", "fast"),
    ("nvmlDeviceGetMemoryInfo", "fast", READ + "; v2 first, v1 on function_not_found"),
    ("nvmlDeviceGetTemperatureV", "fast", READ + "; falls back to GetTemperature"),
    ("nvmlDeviceGetTemperature", "fast"),
    ("nvmlDeviceGetPowerUsage", "fast"),
    ("nvmlDeviceGetEnforcedPowerLimit", "fast"),
    ("nvmlDeviceGetPerformanceState", "fast"),
    ("nvmlDeviceGetClockInfo", "fast"),
    ("nvmlDeviceGetCurrentClocksEventReasons", "fast", READ + "; falls back to GetCurrentClocksThrottleReasons"),
    ("nvmlDeviceGetCurrentClocksThrottleReasons", "fast"),
    ("nvmlDeviceGetTotalEccErrors", "fast"),
    ("nvmlDeviceGetRemappedRows", "fast"),
    ("nvmlDeviceGetPersistenceMode", "fast"),
    ("nvmlDeviceGetComputeRunningProcesses_v3", "fast", READ + "; falls back to _v2"),
    ("nvmlDeviceGetComputeRunningProcesses_v2", "fast"),
    ("nvmlDeviceGetGraphicsRunningProcesses_v3", "fast"),
    ("nvmlDeviceGetProcessesUtilizationInfo", "fast", READ + "; not_found means no sample since the last read"),
    (
        "nvmlDeviceGetFieldValues",
        "fast, slow",
        "per entry: an unsupported field is dropped for good; the call itself as " + READ,
    ),
    # -- slow tier
    ("nvmlDeviceGetTotalEnergyConsumption", "slow"),
    ("nvmlDeviceGetEccMode", "slow"),
    ("nvmlDeviceGetRetiredPages", "slow"),
    ("nvmlDeviceGetRetiredPagesPendingStatus", "slow"),
    ("nvmlDeviceGetCurrPcieLinkGeneration", "slow"),
    ("nvmlDeviceGetCurrPcieLinkWidth", "slow"),
    ("nvmlDeviceGetPcieReplayCounter", "slow"),
    ("nvmlDeviceGetFanSpeed", "slow"),
    ("nvmlDeviceGetComputeMode", "slow"),
    ("nvmlDeviceGetMigMode", "slow"),
    (
        "nvmlDeviceGetGpuFabricInfoV",
        "slow",
        READ + "; v3 first, v2 on argument_version_mismatch; state 0 on GPUs without a fabric",
    ),
    ("nvmlDeviceGetMaxMigDeviceCount", "slow"),
    ("nvmlDeviceGetMigDeviceHandleByIndex", "slow", READ + "; not_found is an empty MIG slot"),
    ("nvmlDeviceGetGpuInstanceId", "slow", READ + "; on a MIG handle: the instance GPM samples per slice"),
    ("nvmlDeviceGetGpuInstanceById", "slow", READ + "; a MIG slice's GPU instance, for its profile and placement"),
    ("nvmlGpuInstanceGetInfo", "slow", READ + "; profile ID and placement start: the slice's name under DRA"),
    (
        "nvmlDeviceGetGpuInstanceProfileInfoById",
        "slow",
        READ + "; a MIG profile's name (1g.10gb): the slice's profile label",
    ),
    # -- GPM, profiling-class activity (gpuwarden.nvml.gpm, fast tier; Hopper and newer)
    ("nvmlGpmQueryDeviceSupport", "fast", GPM),
    ("nvmlGpmSampleAlloc", "fast", GPM),
    ("nvmlGpmSampleFree", "fast", "errors ignored (the buffer is being dropped)"),
    ("nvmlGpmSampleGet", "fast", GPM + "; a failed sample restarts the window"),
    ("nvmlGpmMigSampleGet", "fast", GPM + "; per MIG GPU instance; a failed sample restarts that instance's window"),
    ("nvmlGpmMetricsGet", "fast", "per metric: its own return code; a metric that fails is dropped for the GPU"),
    # -- XID events (gpuwarden.nvml.events)
    ("nvmlEventSetCreate", "events", EVENTS),
    ("nvmlDeviceGetSupportedEventTypes", "events", EVENTS),
    ("nvmlDeviceRegisterEvents", "events", EVENTS),
    ("nvmlEventSetWait_v2", "events", EVENTS),
    ("nvmlEventSetFree", "events", EVENTS),
)
_OURS = {fn.__name__: fn for fn in (_gpu_fabric_info,)}
OPERATIONS: dict[str, Operation] = {
    row[0]: Operation(_OURS.get(row[0]) or getattr(pynvml, row[0]), *row[1:]) for row in _TABLE
}
globals().update(OPERATIONS)  # each callable as calls.<symbol>, the name readers use
