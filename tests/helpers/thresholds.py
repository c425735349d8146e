"""Health thresholds with short windows, so tests judge sustained conditions in seconds of simulated time."""

SHORT = {
    "utilization_for_s": 10,
    "memory_for_s": 3,
    "temperature_warning_for_s": 3,
    "temperature_critical_for_s": 3,
    "thermal_slowdown_for_s": 10,
    "power_cap_for_s": 10,
    "power_limit_reduced_for_s": 5,
    "pstate_for_s": 10,
    "nvlink_down_for_s": 3,
    "persistence_off_for_s": 5,
    "nvlink_crc_for_s": 10,
    "pcie_replays_for_s": 10,
    "bottleneck_window_s": 5,
}
