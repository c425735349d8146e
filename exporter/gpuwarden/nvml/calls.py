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

TYPE_CHECKING = False  # typing.TYPE_CHECKING without importing typing in the GPM child (gpm.py, its imports)
if TYPE_CHECKING:
    from typing import Any

# What each role means for an error, beyond the return-code table.
READ = "unsupported: series omitted, not retried until re-discovery; lost/down/fatal change the GPU or library state"
LIFECYCLE = "any error: nvml_up 0, re-init with backoff 1-30 s; lib_rm_version_mismatch: exit for a restart"
DISCOVERY = "no_permission or lost: the GPU is skipped with a log line; a hang is abandoned at the call deadline"
EVENTS = "unknown: the event set is rebuilt; not_supported: the GPU is not registered; timeout is normal"


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


OPERATIONS: dict[str, Operation] = {}


def _op(fn: Callable[..., Any], tier: str, on_error: str = READ) -> Operation:
    operation = Operation(fn, tier, on_error)
    OPERATIONS[operation.__name__] = operation
    return operation


# -- lifecycle and discovery (gpuwarden.nvml.session) ---------------------------------------------------------
nvmlInitWithFlags = _op(pynvml.nvmlInitWithFlags, "lifecycle", LIFECYCLE)
nvmlShutdown = _op(pynvml.nvmlShutdown, "lifecycle", "skipped while a call is wedged; errors ignored at exit")
nvmlSystemGetDriverVersion = _op(pynvml.nvmlSystemGetDriverVersion, "lifecycle", LIFECYCLE)
nvmlSystemGetNVMLVersion = _op(pynvml.nvmlSystemGetNVMLVersion, "lifecycle", LIFECYCLE)
nvmlSystemGetCudaDriverVersion_v2 = _op(pynvml.nvmlSystemGetCudaDriverVersion_v2, "lifecycle", LIFECYCLE)
nvmlDeviceGetCount = _op(pynvml.nvmlDeviceGetCount, "lifecycle", LIFECYCLE)
nvmlDeviceGetHandleByIndex = _op(pynvml.nvmlDeviceGetHandleByIndex, "discovery", DISCOVERY)
nvmlDeviceGetUUID = _op(pynvml.nvmlDeviceGetUUID, "discovery", DISCOVERY)
nvmlDeviceGetHandleByUUID = _op(
    pynvml.nvmlDeviceGetHandleByUUID, "discovery", "any error: the GPU stays lost, retried with backoff 1-30 s"
)

# -- static tier (readers, at discovery) ----------------------------------------------------------------------
nvmlDeviceGetName = _op(pynvml.nvmlDeviceGetName, "static")
nvmlDeviceGetSerial = _op(pynvml.nvmlDeviceGetSerial, "static")
nvmlDeviceGetPciInfo_v3 = _op(pynvml.nvmlDeviceGetPciInfo_v3, "static")
nvmlDeviceGetVbiosVersion = _op(pynvml.nvmlDeviceGetVbiosVersion, "static")
nvmlDeviceGetMinorNumber = _op(pynvml.nvmlDeviceGetMinorNumber, "static", READ + "; DRA names a GPU gpu-<minor>")
nvmlDeviceGetCudaComputeCapability = _op(pynvml.nvmlDeviceGetCudaComputeCapability, "static")
nvmlDeviceGetMaxClockInfo = _op(pynvml.nvmlDeviceGetMaxClockInfo, "static")
nvmlDeviceGetTemperatureThreshold = _op(pynvml.nvmlDeviceGetTemperatureThreshold, "static")
nvmlDeviceGetPowerManagementDefaultLimit = _op(pynvml.nvmlDeviceGetPowerManagementDefaultLimit, "static")
nvmlDeviceGetMaxPcieLinkGeneration = _op(pynvml.nvmlDeviceGetMaxPcieLinkGeneration, "static")
nvmlDeviceGetMaxPcieLinkWidth = _op(pynvml.nvmlDeviceGetMaxPcieLinkWidth, "static")
nvmlDeviceGetNvLinkRemotePciInfo = _op(pynvml.nvmlDeviceGetNvLinkRemotePciInfo, "static")
nvmlDeviceGetTopologyCommonAncestor = _op(pynvml.nvmlDeviceGetTopologyCommonAncestor, "topology")
nvmlDeviceGetP2PStatus = _op(pynvml.nvmlDeviceGetP2PStatus, "topology")

# -- fast tier ---------------------------------------------------------------------------------------------------
nvmlDeviceGetSamples = _op(pynvml.nvmlDeviceGetSamples, "fast", READ + "; not_found means no new samples")
nvmlDeviceGetUtilizationRates = _op(pynvml.nvmlDeviceGetUtilizationRates, "fast")
nvmlDeviceGetEncoderUtilization = _op(pynvml.nvmlDeviceGetEncoderUtilization, "fast")
nvmlDeviceGetDecoderUtilization = _op(pynvml.nvmlDeviceGetDecoderUtilization, "fast")
nvmlDeviceGetMemoryInfo = _op(pynvml.nvmlDeviceGetMemoryInfo, "fast", READ + "; v2 first, v1 on function_not_found")
nvmlDeviceGetTemperatureV = _op(pynvml.nvmlDeviceGetTemperatureV, "fast", READ + "; falls back to GetTemperature")
nvmlDeviceGetTemperature = _op(pynvml.nvmlDeviceGetTemperature, "fast")
nvmlDeviceGetPowerUsage = _op(pynvml.nvmlDeviceGetPowerUsage, "fast")
nvmlDeviceGetEnforcedPowerLimit = _op(pynvml.nvmlDeviceGetEnforcedPowerLimit, "fast")
nvmlDeviceGetPerformanceState = _op(pynvml.nvmlDeviceGetPerformanceState, "fast")
nvmlDeviceGetClockInfo = _op(pynvml.nvmlDeviceGetClockInfo, "fast")
nvmlDeviceGetCurrentClocksEventReasons = _op(
    pynvml.nvmlDeviceGetCurrentClocksEventReasons, "fast", READ + "; falls back to GetCurrentClocksThrottleReasons"
)
nvmlDeviceGetCurrentClocksThrottleReasons = _op(pynvml.nvmlDeviceGetCurrentClocksThrottleReasons, "fast")
nvmlDeviceGetTotalEccErrors = _op(pynvml.nvmlDeviceGetTotalEccErrors, "fast")
nvmlDeviceGetRemappedRows = _op(pynvml.nvmlDeviceGetRemappedRows, "fast")
nvmlDeviceGetPersistenceMode = _op(pynvml.nvmlDeviceGetPersistenceMode, "fast")
nvmlDeviceGetComputeRunningProcesses_v3 = _op(
    pynvml.nvmlDeviceGetComputeRunningProcesses_v3, "fast", READ + "; falls back to _v2"
)
nvmlDeviceGetComputeRunningProcesses_v2 = _op(pynvml.nvmlDeviceGetComputeRunningProcesses_v2, "fast")
nvmlDeviceGetGraphicsRunningProcesses_v3 = _op(pynvml.nvmlDeviceGetGraphicsRunningProcesses_v3, "fast")
nvmlDeviceGetProcessesUtilizationInfo = _op(
    pynvml.nvmlDeviceGetProcessesUtilizationInfo, "fast", READ + "; not_found means no sample since the last read"
)
nvmlDeviceGetFieldValues = _op(
    pynvml.nvmlDeviceGetFieldValues,
    "fast, slow",
    "per entry: an unsupported field is dropped for good; the call itself as " + READ,
)

# -- slow tier --------------------------------------------------------------------------------------------------
nvmlDeviceGetTotalEnergyConsumption = _op(pynvml.nvmlDeviceGetTotalEnergyConsumption, "slow")
nvmlDeviceGetEccMode = _op(pynvml.nvmlDeviceGetEccMode, "slow")
nvmlDeviceGetRetiredPages = _op(pynvml.nvmlDeviceGetRetiredPages, "slow")
nvmlDeviceGetRetiredPagesPendingStatus = _op(pynvml.nvmlDeviceGetRetiredPagesPendingStatus, "slow")
nvmlDeviceGetCurrPcieLinkGeneration = _op(pynvml.nvmlDeviceGetCurrPcieLinkGeneration, "slow")
nvmlDeviceGetCurrPcieLinkWidth = _op(pynvml.nvmlDeviceGetCurrPcieLinkWidth, "slow")
nvmlDeviceGetPcieReplayCounter = _op(pynvml.nvmlDeviceGetPcieReplayCounter, "slow")
nvmlDeviceGetFanSpeed = _op(pynvml.nvmlDeviceGetFanSpeed, "slow")
nvmlDeviceGetComputeMode = _op(pynvml.nvmlDeviceGetComputeMode, "slow")
nvmlDeviceGetMigMode = _op(pynvml.nvmlDeviceGetMigMode, "slow")


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
nvmlDeviceGetGpuFabricInfoV = _op(
    _gpu_fabric_info, "slow", READ + "; v3 first, v2 on argument_version_mismatch; state 0 on GPUs without a fabric"
)
nvmlDeviceGetMaxMigDeviceCount = _op(pynvml.nvmlDeviceGetMaxMigDeviceCount, "slow")
nvmlDeviceGetMigDeviceHandleByIndex = _op(
    pynvml.nvmlDeviceGetMigDeviceHandleByIndex, "slow", READ + "; not_found is an empty MIG slot"
)
nvmlDeviceGetGpuInstanceId = _op(
    pynvml.nvmlDeviceGetGpuInstanceId, "slow", READ + "; on a MIG handle: the instance GPM samples per slice"
)
nvmlDeviceGetGpuInstanceById = _op(
    pynvml.nvmlDeviceGetGpuInstanceById, "slow", READ + "; a MIG slice's GPU instance, for its profile and placement"
)
nvmlGpuInstanceGetInfo = _op(
    pynvml.nvmlGpuInstanceGetInfo, "slow", READ + "; profile ID and placement start: the slice's name under DRA"
)

nvmlDeviceGetGpuInstanceProfileInfoById = _op(
    pynvml.nvmlDeviceGetGpuInstanceProfileInfoById,
    "slow",
    READ + "; a MIG profile's name (1g.10gb): the slice's profile label",
)

# -- GPM, profiling-class activity (gpuwarden.nvml.gpm, fast tier; Hopper and newer) ------------------------------
GPM = (
    "unsupported or no_permission: no profiling series for that GPU (a gauge says why); not retried until re-discovery"
)
nvmlGpmQueryDeviceSupport = _op(pynvml.nvmlGpmQueryDeviceSupport, "fast", GPM)
nvmlGpmSampleAlloc = _op(pynvml.nvmlGpmSampleAlloc, "fast", GPM)
nvmlGpmSampleFree = _op(pynvml.nvmlGpmSampleFree, "fast", "errors ignored (the buffer is being dropped)")
nvmlGpmSampleGet = _op(pynvml.nvmlGpmSampleGet, "fast", GPM + "; a failed sample restarts the window")
nvmlGpmMigSampleGet = _op(
    pynvml.nvmlGpmMigSampleGet, "fast", GPM + "; per MIG GPU instance; a failed sample restarts that instance's window"
)
nvmlGpmMetricsGet = _op(
    pynvml.nvmlGpmMetricsGet, "fast", "per metric: its own return code; a metric that fails is dropped for the GPU"
)

# -- XID events (gpuwarden.nvml.events) ----------------------------------------------------------------------------
nvmlEventSetCreate = _op(pynvml.nvmlEventSetCreate, "events", EVENTS)
nvmlDeviceGetSupportedEventTypes = _op(pynvml.nvmlDeviceGetSupportedEventTypes, "events", EVENTS)
nvmlDeviceRegisterEvents = _op(pynvml.nvmlDeviceRegisterEvents, "events", EVENTS)
nvmlEventSetWait_v2 = _op(pynvml.nvmlEventSetWait_v2, "events", EVENTS)
nvmlEventSetFree = _op(pynvml.nvmlEventSetFree, "events", EVENTS)

# -- constants the readers and topology use --------------------------------------------------------------------
NVML_SUCCESS = pynvml.NVML_SUCCESS
NVML_INIT_FLAG_NO_GPUS = pynvml.NVML_INIT_FLAG_NO_GPUS
NVML_GPU_UTILIZATION_SAMPLES = pynvml.NVML_GPU_UTILIZATION_SAMPLES
NVML_MEMORY_UTILIZATION_SAMPLES = pynvml.NVML_MEMORY_UTILIZATION_SAMPLES
NVML_VALUE_TYPE_DOUBLE = pynvml.NVML_VALUE_TYPE_DOUBLE
NVML_VALUE_TYPE_UNSIGNED_INT = pynvml.NVML_VALUE_TYPE_UNSIGNED_INT
NVML_VALUE_TYPE_UNSIGNED_LONG = pynvml.NVML_VALUE_TYPE_UNSIGNED_LONG
NVML_VALUE_TYPE_UNSIGNED_LONG_LONG = pynvml.NVML_VALUE_TYPE_UNSIGNED_LONG_LONG
NVML_VALUE_TYPE_SIGNED_LONG_LONG = pynvml.NVML_VALUE_TYPE_SIGNED_LONG_LONG
NVML_VALUE_TYPE_SIGNED_INT = pynvml.NVML_VALUE_TYPE_SIGNED_INT
NVML_VALUE_TYPE_UNSIGNED_SHORT = pynvml.NVML_VALUE_TYPE_UNSIGNED_SHORT
NVML_CLOCK_GRAPHICS = pynvml.NVML_CLOCK_GRAPHICS
NVML_CLOCK_SM = pynvml.NVML_CLOCK_SM
NVML_CLOCK_MEM = pynvml.NVML_CLOCK_MEM
NVML_TEMPERATURE_GPU = pynvml.NVML_TEMPERATURE_GPU
NVML_TEMPERATURE_THRESHOLD_SHUTDOWN = pynvml.NVML_TEMPERATURE_THRESHOLD_SHUTDOWN
NVML_TEMPERATURE_THRESHOLD_SLOWDOWN = pynvml.NVML_TEMPERATURE_THRESHOLD_SLOWDOWN
NVML_TEMPERATURE_THRESHOLD_MEM_MAX = pynvml.NVML_TEMPERATURE_THRESHOLD_MEM_MAX
NVML_TEMPERATURE_THRESHOLD_GPU_MAX = pynvml.NVML_TEMPERATURE_THRESHOLD_GPU_MAX
NVML_MEMORY_ERROR_TYPE_CORRECTED = pynvml.NVML_MEMORY_ERROR_TYPE_CORRECTED
NVML_MEMORY_ERROR_TYPE_UNCORRECTED = pynvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED
NVML_VOLATILE_ECC = pynvml.NVML_VOLATILE_ECC
NVML_AGGREGATE_ECC = pynvml.NVML_AGGREGATE_ECC
NVML_PAGE_RETIREMENT_CAUSE_MULTIPLE_SINGLE_BIT_ECC_ERRORS = (
    pynvml.NVML_PAGE_RETIREMENT_CAUSE_MULTIPLE_SINGLE_BIT_ECC_ERRORS
)
NVML_PAGE_RETIREMENT_CAUSE_DOUBLE_BIT_ECC_ERROR = pynvml.NVML_PAGE_RETIREMENT_CAUSE_DOUBLE_BIT_ECC_ERROR
NVML_TOPOLOGY_INTERNAL = pynvml.NVML_TOPOLOGY_INTERNAL
NVML_TOPOLOGY_SINGLE = pynvml.NVML_TOPOLOGY_SINGLE
NVML_TOPOLOGY_MULTIPLE = pynvml.NVML_TOPOLOGY_MULTIPLE
NVML_TOPOLOGY_HOSTBRIDGE = pynvml.NVML_TOPOLOGY_HOSTBRIDGE
NVML_TOPOLOGY_NODE = pynvml.NVML_TOPOLOGY_NODE
NVML_TOPOLOGY_SYSTEM = pynvml.NVML_TOPOLOGY_SYSTEM
NVML_P2P_CAPS_INDEX_NVLINK = pynvml.NVML_P2P_CAPS_INDEX_NVLINK
NVML_P2P_STATUS_OK = pynvml.NVML_P2P_STATUS_OK
NVML_P2P_STATUS_NOT_SUPPORTED = pynvml.NVML_P2P_STATUS_NOT_SUPPORTED
NVML_FI_DEV_MEMORY_TEMP = pynvml.NVML_FI_DEV_MEMORY_TEMP
NVML_FI_DEV_GET_GPU_RECOVERY_ACTION = pynvml.NVML_FI_DEV_GET_GPU_RECOVERY_ACTION
NVML_FI_DEV_PCIE_COUNT_TX_BYTES = pynvml.NVML_FI_DEV_PCIE_COUNT_TX_BYTES
NVML_FI_DEV_PCIE_COUNT_RX_BYTES = pynvml.NVML_FI_DEV_PCIE_COUNT_RX_BYTES
NVML_FI_DEV_PERF_POLICY_POWER = pynvml.NVML_FI_DEV_PERF_POLICY_POWER
NVML_FI_DEV_PERF_POLICY_THERMAL = pynvml.NVML_FI_DEV_PERF_POLICY_THERMAL
NVML_FI_DEV_PERF_POLICY_SYNC_BOOST = pynvml.NVML_FI_DEV_PERF_POLICY_SYNC_BOOST
NVML_FI_DEV_PERF_POLICY_BOARD_LIMIT = pynvml.NVML_FI_DEV_PERF_POLICY_BOARD_LIMIT
NVML_FI_DEV_PERF_POLICY_LOW_UTILIZATION = pynvml.NVML_FI_DEV_PERF_POLICY_LOW_UTILIZATION
NVML_FI_DEV_PERF_POLICY_RELIABILITY = pynvml.NVML_FI_DEV_PERF_POLICY_RELIABILITY
NVML_FI_DEV_CLOCKS_EVENT_REASON_SW_THERM_SLOWDOWN = pynvml.NVML_FI_DEV_CLOCKS_EVENT_REASON_SW_THERM_SLOWDOWN
NVML_FI_DEV_CLOCKS_EVENT_REASON_HW_THERM_SLOWDOWN = pynvml.NVML_FI_DEV_CLOCKS_EVENT_REASON_HW_THERM_SLOWDOWN
NVML_FI_DEV_CLOCKS_EVENT_REASON_HW_POWER_BRAKE_SLOWDOWN = pynvml.NVML_FI_DEV_CLOCKS_EVENT_REASON_HW_POWER_BRAKE_SLOWDOWN
NVML_FI_DEV_NVLINK_LINK_COUNT = pynvml.NVML_FI_DEV_NVLINK_LINK_COUNT
NVML_FI_DEV_NVSWITCH_CONNECTED_LINK_COUNT = pynvml.NVML_FI_DEV_NVSWITCH_CONNECTED_LINK_COUNT
NVML_FI_DEV_NVLINK_GET_STATE = pynvml.NVML_FI_DEV_NVLINK_GET_STATE
NVML_FI_DEV_NVLINK_ERROR_DL_CRC = pynvml.NVML_FI_DEV_NVLINK_ERROR_DL_CRC
NVML_FI_DEV_NVLINK_ERROR_DL_REPLAY = pynvml.NVML_FI_DEV_NVLINK_ERROR_DL_REPLAY
NVML_FI_DEV_NVLINK_ERROR_DL_RECOVERY = pynvml.NVML_FI_DEV_NVLINK_ERROR_DL_RECOVERY
NVML_FI_DEV_NVLINK_ECC_DATA_ERROR_COUNT_L0 = pynvml.NVML_FI_DEV_NVLINK_ECC_DATA_ERROR_COUNT_L0
NVML_FI_DEV_NVLINK_ECC_DATA_ERROR_COUNT_L11 = pynvml.NVML_FI_DEV_NVLINK_ECC_DATA_ERROR_COUNT_L11
NVML_GPM_METRIC_GRAPHICS_UTIL = pynvml.NVML_GPM_METRIC_GRAPHICS_UTIL
NVML_GPM_METRIC_SM_UTIL = pynvml.NVML_GPM_METRIC_SM_UTIL
NVML_GPM_METRIC_SM_OCCUPANCY = pynvml.NVML_GPM_METRIC_SM_OCCUPANCY
NVML_GPM_METRIC_ANY_TENSOR_UTIL = pynvml.NVML_GPM_METRIC_ANY_TENSOR_UTIL
NVML_GPM_METRIC_FP64_UTIL = pynvml.NVML_GPM_METRIC_FP64_UTIL
NVML_GPM_METRIC_FP32_UTIL = pynvml.NVML_GPM_METRIC_FP32_UTIL
NVML_GPM_METRIC_FP16_UTIL = pynvml.NVML_GPM_METRIC_FP16_UTIL
NVML_GPM_METRIC_DRAM_BW_UTIL = pynvml.NVML_GPM_METRIC_DRAM_BW_UTIL
NVML_GPM_METRIC_PCIE_RX_PER_SEC = pynvml.NVML_GPM_METRIC_PCIE_RX_PER_SEC
NVML_GPM_METRIC_PCIE_TX_PER_SEC = pynvml.NVML_GPM_METRIC_PCIE_TX_PER_SEC
NVML_GPM_METRIC_NVLINK_TOTAL_RX_PER_SEC = pynvml.NVML_GPM_METRIC_NVLINK_TOTAL_RX_PER_SEC
NVML_GPM_METRIC_NVLINK_TOTAL_TX_PER_SEC = pynvml.NVML_GPM_METRIC_NVLINK_TOTAL_TX_PER_SEC
nvmlMemory_v2 = pynvml.nvmlMemory_v2
nvmlEventTypeXidCriticalError = pynvml.nvmlEventTypeXidCriticalError
