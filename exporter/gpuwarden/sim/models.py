"""GPU model presets for the simulator, grounded in real readings.

h100-sxm-80gb comes from readings of a real 2× H100 SXM 80GB host (the measured system of docs/nvml.md,
driver 580.159.04, 2026-11): idle at P0,
345 MHz SM, 38 °C, 73 W, GpuIdle reason, 480 MiB reserved, fan and retired pages NotSupported, 18 NVLinks
through NVSwitch with remote bus id FFFFFFFF:FF:FF.0.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class GpuModel:
    name: str
    memory_total: int
    memory_reserved: int
    vbios: str
    compute_capability: tuple[int, int]
    max_clocks_mhz: dict[str, int]  # sm, memory, graphics
    thresholds: dict[str, int]  # shutdown, slowdown, gpu_max, memory_max
    power_default_mw: int
    pcie_max: tuple[int, int]  # generation, width
    nvlinks: int
    idle: dict[str, float]  # baseline values of the trajectories
    unsupported: frozenset[str] = field(default_factory=frozenset)  # C symbols answering NOT_SUPPORTED
    unsupported_fields: frozenset[int] = field(default_factory=frozenset)
    supported_events: int = 0xFF9F
    clock_events_supported: int = 0x1FF
    serial_base: int = 1651326139729


# What every model reads at idle: nothing running, no engine busy, persistence on, no recovery asked; each model adds
# its own temperatures, clocks, power, P-state, PCIe link and fan.
IDLE_AT_REST: dict[str, float] = {
    "utilization": 0,
    "memory_utilization": 0,
    "encoder_utilization": 0,  # H100: nvmlDeviceGetEncoderUtilization (0, 100000 µs) at idle
    "decoder_utilization": 0,
    "memory_used_ratio": 0.0,
    "clock_event_reasons": 0x1,
    "processes": 0,
    "persistence_mode": 1,
    "recovery_action": 0,
}


H100_SXM_80GB = GpuModel(
    name="NVIDIA H100 80GB HBM3",
    memory_total=85_520_809_984,
    memory_reserved=503_316_480,
    vbios="96.00.DA.00.0C",
    compute_capability=(9, 0),
    max_clocks_mhz={"sm": 1980, "memory": 2619, "graphics": 1980},
    thresholds={"shutdown": 95, "slowdown": 89, "gpu_max": 87, "memory_max": 95},
    power_default_mw=700_000,
    pcie_max=(5, 16),
    nvlinks=18,
    idle={
        **IDLE_AT_REST,
        "temperature": 38,
        "memory_temperature": 41,
        "power_watts": 73.2,
        "sm_clock_mhz": 345,
        "memory_clock_mhz": 2619,
        "pstate": 0,
        "power_limit_watts": 700,
        "pcie_gen": 5,
        "pcie_width": 16,
        "pcie_tx_bytes_per_second": 2.0e5,
        "pcie_rx_bytes_per_second": 1.5e5,
        "fan_percent": 0,
    },
    unsupported=frozenset(
        {"nvmlDeviceGetFanSpeed", "nvmlDeviceGetRetiredPages", "nvmlDeviceGetRetiredPagesPendingStatus"}
    ),
    # Measured NOT_SUPPORTED on H100/H200 (driver 580.159.04): the aggregate NVLink *_TOTAL fields and the
    # legacy per-link CRC-data and ECC fields (39-44, 102-107, 148-159); the scoped DL counters 161-163 work.
    unsupported_fields=frozenset({38, 45, 52, 59, 160, *range(39, 45), *range(102, 108), *range(148, 160)}),
)

QUADRO_RTX_6000 = GpuModel(
    name="Quadro RTX 6000",
    memory_total=25_769_803_776,
    memory_reserved=270_532_608,
    vbios="90.02.2E.00.0C",
    compute_capability=(7, 5),
    max_clocks_mhz={"sm": 2100, "memory": 7001, "graphics": 2100},
    thresholds={"shutdown": 94, "slowdown": 91, "gpu_max": 89, "memory_max": 0},
    power_default_mw=260_000,
    pcie_max=(3, 16),
    nvlinks=0,
    idle={
        **IDLE_AT_REST,
        "temperature": 34,
        "memory_temperature": 0,
        "power_watts": 21.5,
        "sm_clock_mhz": 300,
        "memory_clock_mhz": 405,
        "pstate": 8,
        "power_limit_watts": 260,
        "pcie_gen": 1,
        "pcie_width": 16,
        "pcie_tx_bytes_per_second": 5.0e4,
        "pcie_rx_bytes_per_second": 5.0e4,
        "fan_percent": 33,
    },
    unsupported=frozenset({"nvmlDeviceGetRemappedRows"}),
    unsupported_fields=frozenset({82, 197, 198, 230, 269, 270, 271, 147}),
    supported_events=0x1F,
    clock_events_supported=0x1FF,
    serial_base=320_0119_000_001,
)

MODELS: dict[str, GpuModel] = {"h100-sxm-80gb": H100_SXM_80GB, "quadro-rtx-6000": QUADRO_RTX_6000}
