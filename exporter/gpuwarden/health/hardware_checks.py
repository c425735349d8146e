"""Health checks of hardware faults: a lost GPU, ECC, row remapping, XIDs, NVLink and the NVSwitch fabric."""

from __future__ import annotations

from gpuwarden.health.context import CRITICAL, OK, WARNING, CheckContext
from gpuwarden.health.history import NVLINK_SUM
from gpuwarden.model.families import (
    ECC_ERRORS_TOTAL,
    FABRIC_HEALTH,
    FABRIC_STATE,
    NVLINK_ERRORS_TOTAL,
    NVLINK_UP,
    REMAPPED_ROWS_FAILED,
    REMAPPED_ROWS_PENDING,
    RETIRED_PAGES,
    RETIRED_PAGES_PENDING,
)
from gpuwarden.model.snapshot import Verdict


def check_gpu_lost(c: CheckContext) -> Verdict:
    return c.verdict(OK, "up", "gpu_up 1")  # a lost GPU is judged before the checks run


def check_ecc(c: CheckContext) -> Verdict:
    uncorrected = c.values.get((ECC_ERRORS_TOTAL.name, ("uncorrected",)))
    if uncorrected:
        return c.verdict(CRITICAL, f"{uncorrected:.0f} uncorrected (volatile)", "0")
    return c.verdict(OK, f"{uncorrected or 0:.0f} uncorrected", "0")


def check_row_remap(c: CheckContext) -> Verdict:
    limits, values = c.thresholds, c.values
    if values.get((REMAPPED_ROWS_FAILED.name, ())):
        return c.verdict(CRITICAL, "remap failed", "no failure")
    retired = sum(values.get((RETIRED_PAGES.name, (cause,)), 0) for cause in ("single_bit", "double_bit"))
    if retired >= limits.retired_pages_limit:
        observed = f"{retired:.0f} retired pages"
        return c.verdict(CRITICAL, observed, f"< {limits.retired_pages_limit}", detail="page_retirement")
    if values.get((REMAPPED_ROWS_PENDING.name, ())):
        return c.verdict(WARNING, "row remap pending", "none pending")
    if values.get((RETIRED_PAGES_PENDING.name, ())):  # pre-Ampere GPUs retire pages instead of remapping rows
        return c.verdict(WARNING, "page retirement pending", "none pending", detail="page_retirement")
    return c.verdict(OK, "none pending", "none pending")


# What an XID code means, for the finding's text (NVIDIA's XID catalog; codes not listed are shown by number).
XID_NAMES = {
    13: "graphics engine exception",
    31: "GPU memory page fault",
    43: "GPU stopped processing",
    45: "preemptive cleanup",
    48: "double-bit ECC error",
    61: "internal micro-controller breakpoint",
    62: "internal micro-controller halt",
    63: "ECC page retirement or row remap recorded",
    64: "ECC page retirement or row remap failure",
    68: "video processor exception",
    74: "NVLink error",
    79: "GPU has fallen off the bus",
    92: "high single-bit ECC error rate",
    94: "contained ECC error",
    95: "uncontained ECC error",
    119: "GSP RPC timeout",
    120: "GSP error",
}


def xid_text(codes: list[int]) -> str:
    """'XID 48 (double-bit ECC error), XID 154': the number for the catalog, the name for the reader."""
    return ", ".join(f"XID {code} ({XID_NAMES[code]})" if code in XID_NAMES else f"XID {code}" for code in codes)


def check_xid(c: CheckContext) -> Verdict:
    limits = c.thresholds
    window = f"none in {limits.xid_window_s} s"
    recent = {
        code: last for (uuid, code), (_, last) in c.xid.items() if uuid == c.uuid and c.now - last < limits.xid_window_s
    }
    critical = sorted(code for code in recent if code in limits.xid_critical)
    if critical:
        return c.verdict(CRITICAL, xid_text(critical), window)
    warning = sorted(code for code in recent if code in limits.xid_warning)
    if warning:
        return c.verdict(WARNING, xid_text(warning), window)
    return c.verdict(OK, "no critical XID", window)


def check_nvlink(c: CheckContext) -> Verdict:
    limits, values, history = c.thresholds, c.values, c.history
    links = {labels[0]: value for (name, labels), value in values.items() if name == NVLINK_UP.name}
    seen_up = c.evaluator.links_seen_up.setdefault(c.uuid, set())
    seen_up.update(link for link, up in links.items() if up)
    # a link that was never up in our history may simply be unused, unless discovery found its remote end (a peer
    # GPU or an NVSwitch): then it is wired, and down is a fault even if it went down before this exporter started
    expected = seen_up | c.wired_links
    down = sorted((link for link, up in links.items() if not up and link in expected), key=int)
    if c.sustained("nvlink_down", bool(down), limits.nvlink_down_for_s):
        return c.verdict(CRITICAL, f"link {', '.join(down)} down", "all links up")
    for kind in ("replay", "recovery"):
        if history.rate((NVLINK_SUM, (kind,)), c.now, 900):
            named = sorted(
                {
                    labels[0]
                    for (name, labels), value in values.items()
                    if name == NVLINK_ERRORS_TOTAL.name and labels[1] == kind and value
                },
                key=int,
            )
            return c.verdict(WARNING, f"{kind} errors on link {', '.join(named)}", "none in 15 m")
    crc = history.rate((NVLINK_SUM, ("crc_flit",)), c.now, limits.nvlink_crc_for_s)
    if crc is not None and crc > limits.nvlink_crc_per_second:
        # the sum over links: a conservative reading of the per-link threshold of the alert rule
        return c.verdict(WARNING, f"CRC {crc:.0f}/s over all links", f"<= {limits.nvlink_crc_per_second:g}/s")
    if down:
        return c.pending("nvlink_down", f"link {', '.join(down)} down", "all links up", limits.nvlink_down_for_s)
    return c.verdict(OK, f"{sum(links.values()):.0f} of {len(links)} up" if links else "no NVLink", "")


FABRIC_FAULTS = ("route_unhealthy", "incorrect_configuration", "registration_failed")  # CUDA jobs fail: critical
FABRIC_DEGRADED = ("degraded_bandwidth", "route_recovery", "access_timeout_recovery", "gfm_disconnected")


def check_fabric(c: CheckContext) -> Verdict:
    """The NVSwitch fabric (readers/fabric.py): not set up for fabric_setup_for_s, or an unhealthy route, a wrong
    configuration or a failed registration, is critical (CUDA cannot start or jobs fail on the GPU); degraded
    bandwidth or a recovery for fabric_degraded_for_s is a warning, and so is an SXid an NVSwitch of the node logged
    within xid_window_s (the kernel log): every GPU of an HGX baseboard routes through every switch, and a fatal
    SXid reaches the fabric's own state when Fabric Manager acts on it. A GPU without NVSwitch has no fabric rows."""
    limits = c.thresholds
    states = [labels[0] for (name, labels), value in c.values.items() if name == FABRIC_STATE.name and value]
    held = {labels[0] for (name, labels), value in c.values.items() if name == FABRIC_HEALTH.name and value}
    if not states:
        return c.verdict(OK, "no NVSwitch fabric", "")
    faults = [f for f in FABRIC_FAULTS if f in held]
    if faults:
        return c.verdict(CRITICAL, f"fabric {', '.join(faults)}", "a healthy fabric")
    state = states[0]
    unready = state != "completed"
    if c.sustained("fabric_unready", unready, limits.fabric_setup_for_s):
        return c.verdict(CRITICAL, f"fabric {state}: CUDA cannot start on this GPU", "fabric completed")
    if unready:
        return c.pending("fabric_unready", f"fabric {state}", "fabric completed", limits.fabric_setup_for_s)
    return _fabric_set_up(c, held)


def _fabric_set_up(c: CheckContext, held: set[str]) -> Verdict:
    """A fabric that is set up, with no fault: degraded for fabric_degraded_for_s, or an SXid logged within
    xid_window_s, is a warning (check_fabric)."""
    limits = c.thresholds
    degraded = [d for d in FABRIC_DEGRADED if d in held]
    if c.sustained("fabric_degraded", bool(degraded), limits.fabric_degraded_for_s):
        return c.verdict(WARNING, f"fabric {', '.join(degraded)}", "a healthy fabric")
    recent = [(switch, code) for switch, code, last in c.sxids if c.now - last < limits.xid_window_s]
    if recent:
        logged = ", ".join(f"SXid {code} on NVSwitch {switch}" for switch, code in recent)
        return c.verdict(WARNING, f"{logged} (kernel log)", f"no SXid in {limits.xid_window_s} s", detail="sxid")
    if degraded:
        observed = f"fabric {', '.join(degraded)}"
        return c.pending("fabric_degraded", observed, "a healthy fabric", limits.fabric_degraded_for_s, WARNING)
    return c.verdict(OK, "fabric completed, healthy", "")
