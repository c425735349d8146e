"""The health checks by name, in the order verdicts are reported: 0 ok, 1 warning, 2 critical per GPU and check.

Conditions that must be sustained (temperature for 5 m, a starved job for 30 m, ...) are judged over the exporter's
own samples (health/history.py) with the same thresholds and durations as the alert rules
(exporter/gpuwarden/health/thresholds.toml); health/evaluator.py runs the checks on each snapshot.
"""

from __future__ import annotations

from collections.abc import Callable

from gpuwarden.health.context import CRITICAL, OK, WARNING, CheckContext
from gpuwarden.health.hardware_checks import (
    FABRIC_DEGRADED,
    FABRIC_FAULTS,
    XID_NAMES,
    check_ecc,
    check_fabric,
    check_gpu_lost,
    check_nvlink,
    check_row_remap,
    check_xid,
)
from gpuwarden.health.operating_checks import (
    check_bottleneck,
    check_memory_pressure,
    check_pcie,
    check_performance_state,
    check_persistence_mode,
    check_power,
    check_temperature,
    check_thermal_throttling,
    check_utilization,
)
from gpuwarden.model.snapshot import Verdict

# the fault lists and the XID catalog, read by the alert rules (health/rules_hardware.py, alert_rules/dcgm_compat.py)
__all__ = [
    "CHECKS",
    "CHECK_FUNCTIONS",
    "FABRIC_DEGRADED",
    "FABRIC_FAULTS",
    "NEEDS_SLOW_READINGS",
    "NOT_READ_YET",
    "XID_NAMES",
    "not_read_yet",
]

CHECKS = (
    "gpu_lost",
    "ecc",
    "row_remap",
    "xid",
    "nvlink",
    "fabric",
    "temperature",
    "thermal_throttling",
    "power",
    "performance_state",
    "memory_pressure",
    "utilization",
    "persistence_mode",
    "pcie",
    "bottleneck",
)


# Every check, in the order verdicts are reported; a check is one function of its context.
CHECK_FUNCTIONS: dict[str, Callable[[CheckContext], Verdict]] = {
    "gpu_lost": check_gpu_lost,
    "ecc": check_ecc,
    "row_remap": check_row_remap,
    "xid": check_xid,
    "nvlink": check_nvlink,
    "fabric": check_fabric,
    "temperature": check_temperature,
    "thermal_throttling": check_thermal_throttling,
    "power": check_power,
    "performance_state": check_performance_state,
    "memory_pressure": check_memory_pressure,
    "utilization": check_utilization,
    "persistence_mode": check_persistence_mode,
    "pcie": check_pcie,
    "bottleneck": check_bottleneck,
}
assert tuple(CHECK_FUNCTIONS) == CHECKS
# Checks judged on slow-tier readings (NVLink state, the fabric, PCIe replays), with the worst level each gives: until
# a GPU's slow tier has been read once (the first slow cycle after a start, or a late read on a starved host), they
# have nothing to judge. They are pending then, not ok ("no NVLink" would tell NPD the links are fine), and they are
# not run, so a condition recalled from the state file keeps its start until the readings it is judged on arrive.
NEEDS_SLOW_READINGS = {"nvlink": CRITICAL, "fabric": CRITICAL, "pcie": WARNING}


NOT_READ_YET = "not read yet (slow tier)"


def not_read_yet(check: str) -> Verdict:
    return Verdict(check, OK, "pending", NOT_READ_YET, "", pending_level=NEEDS_SLOW_READINGS[check])
