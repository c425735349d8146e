"""dcgm-exporter's default fields, mapped to gpuwarden's series: the migration table (docs/migration-from-dcgm.md)
and the opt-in recording rules (alert_rules/dcgm-compat.recording.yaml) that rebuild dcgm-named series in dcgm's
units and labels, so that dashboards and alerts written for dcgm-exporter keep working during a migration.

The field list is dcgm-exporter's etc/default-counters.csv (26 active rows, 4.8.x); the units are the ones it
exports. A development tool: `python alert_rules/generate.py` writes the rule file; tests/test_dcgm_compat.py checks
the file, the table and, in promtool (alert_rules/tests/dcgm-compat.test.yaml), the values.
"""

from __future__ import annotations

from dataclasses import dataclass

import yaml

from gpuwarden.health.checks import XID_NAMES

SELECTOR = 'job="gpuwarden"'
LABELS_RECORD = "gpuwarden:dcgm_labels:info"
XID_LATEST = "gpuwarden:xid_latest:timestamp_seconds"
MIB = 1024 * 1024
WINDOW_OF = 'gpuwarden_gpm_window_seconds_total{job="gpuwarden"}'
WINDOW = "1m"  # rates for dcgm's per-second and 0-1 fields: dcgm samples every 30 s by default
SLOW_READ = 'gpuwarden_last_collect_timestamp_seconds{job="gpuwarden",tier="slow"}'
POWER_WINDOWS = ("1m", "4m")  # the first with two reads in it: 1m at scrape intervals up to ~30 s, 4m up to 60 s+


def average_power(energy: str, slow_read: str, window: str) -> str:
    """Average watts over `window` from the energy counter, right at any scrape interval: its increase divided by the
    time between the two reads it came from (the slow tier's own timestamp, read in the same cycle), not by the time
    between the scrapes. The counter is read every slow interval (15 s: 3 ms a call on H100): with 15 s scrapes each
    scrape saw the last read, 0-15 s old, so rate(...[1m]) over ~45 s of scrapes counted 30-60 s of energy and read
    497-735 W for 585-635 W (issue 48). Both series are scraped together, so increase() and delta() extrapolate them
    alike and the quotient is the exact mean between the reads; none where the window holds only one read."""
    return f"increase({energy}[{window}]) / on (job, instance) group_left () (delta({slow_read}[{window}]) > 0)"


def power() -> str:
    """The compat power: the mean over 1m where that window holds two reads, else over 4m."""
    energy = _s("gpuwarden_energy_joules_total")
    return " or ".join(f"({average_power(energy, SLOW_READ, window)})" for window in POWER_WINDOWS)


@dataclass(frozen=True)
class Field:
    dcgm: str
    unit: str  # as dcgm-exporter exports it
    gpuwarden: str  # what gpuwarden has instead (a family or an expression), or "none"
    expr: str | None  # the compat value, per (instance, uuid); None: no compat series
    note: str = ""
    group: str = ""  # the metrics.enable_groups group gpuwarden exports the source series in, if not by default


def _s(name: str, **labels: str) -> str:
    """`name` with gpuwarden's selector and `labels` as equality matchers."""
    matchers = "".join(f',{key}="{value}"' for key, value in labels.items())
    return f"{name}{{{SELECTOR}{matchers}}}"


def _ratio(numerator: str, denominator: str) -> str:
    return f"rate({numerator}[{WINDOW}]) / rate({denominator}[{WINDOW}])"


def _xid_value() -> str:
    """The code of each GPU's latest XID as a value (dcgm's gauge, its code also in `err_code`), for the XIDs
    gpuwarden's catalog names."""
    codes = " or ".join(f'{XID_LATEST}{{xid="{code}"}} * 0 + {code}' for code in sorted(XID_NAMES))
    return f'max without (xid) (label_replace({codes}, "err_code", "$1", "xid", "(.*)"))'


FIELDS: tuple[Field, ...] = (
    Field(
        "DCGM_FI_DEV_SM_CLOCK",
        "MHz",
        'gpuwarden_clock_hertz{clock="sm"} (Hz)',
        f"max without (clock) ({_s('gpuwarden_clock_hertz', clock='sm')}) / 1e6",
    ),
    Field(
        "DCGM_FI_DEV_MEM_CLOCK",
        "MHz",
        'gpuwarden_clock_hertz{clock="memory"} (Hz)',
        f"max without (clock) ({_s('gpuwarden_clock_hertz', clock='memory')}) / 1e6",
        group="clocks_detail",
    ),
    Field("DCGM_FI_DEV_GPU_TEMP", "°C", "gpuwarden_temperature_celsius", _s("gpuwarden_temperature_celsius")),
    Field(
        "DCGM_FI_DEV_MEMORY_TEMP",
        "°C",
        "gpuwarden_memory_temperature_celsius",
        _s("gpuwarden_memory_temperature_celsius"),
    ),
    Field(
        "DCGM_FI_DEV_POWER_USAGE",
        "W",
        "gpuwarden_energy_joules_total's increase over the time between its reads "
        '(gpuwarden_last_collect_timestamp_seconds{tier="slow"}): the exact mean over 1m (4m at scrape intervals '
        "past ~30 s); gpuwarden_power_usage_watts is the driver's 1 s reading (metrics group point_samples)",
        power(),
        "not rate(gpuwarden_energy_joules_total[1m]): the counter is read every slow interval, so a rate over the "
        "scrapes' time misreads by up to a read interval's energy (497-735 W for 585-635 W at 15 s)",
    ),
    Field(
        "DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION",
        "mJ (counter)",
        "gpuwarden_energy_joules_total (J)",
        f"{_s('gpuwarden_energy_joules_total')} * 1000",
        "read every slow interval: for power read DCGM_FI_DEV_POWER_USAGE, not a short rate of this",
    ),
    Field(
        "DCGM_FI_DEV_GPU_UTIL",
        "% (0-100)",
        "rate(gpuwarden_busy_seconds_total) / rate(gpuwarden_utilization_sampled_seconds_total): every sample of "
        "the window, where dcgm reads one",
        f"100 * {_ratio(_s('gpuwarden_busy_seconds_total'), _s('gpuwarden_utilization_sampled_seconds_total'))}",
    ),
    Field(
        "DCGM_FI_DEV_MEM_COPY_UTIL",
        "% (0-100)",
        "gpuwarden_memory_bandwidth_utilization_ratio (0-1)",
        f"100 * {_s('gpuwarden_memory_bandwidth_utilization_ratio')}",
        group="point_samples",
    ),
    Field(
        "DCGM_FI_DEV_ENC_UTIL",
        "% (0-100)",
        'rate(gpuwarden_video_busy_seconds_total{engine="encoder"})',
        f"100 * max without (engine) (rate({_s('gpuwarden_video_busy_seconds_total', engine='encoder')}[{WINDOW}]))",
        group="video",
    ),
    Field(
        "DCGM_FI_DEV_DEC_UTIL",
        "% (0-100)",
        'rate(gpuwarden_video_busy_seconds_total{engine="decoder"})',
        f"100 * max without (engine) (rate({_s('gpuwarden_video_busy_seconds_total', engine='decoder')}[{WINDOW}]))",
        group="video",
    ),
    Field(
        "DCGM_FI_PROF_GR_ENGINE_ACTIVE",
        "ratio (0-1)",
        "rate(gpuwarden_gpm_graphics_active_seconds_total) / rate(gpuwarden_gpm_window_seconds_total)",
        _ratio(_s("gpuwarden_gpm_graphics_active_seconds_total"), _s("gpuwarden_gpm_window_seconds_total")),
        group="gpm_detail",
    ),
    Field(
        "DCGM_FI_PROF_PIPE_TENSOR_ACTIVE",
        "ratio (0-1)",
        'rate(gpuwarden_gpm_pipe_active_seconds_total{pipe="tensor"}) / rate(gpuwarden_gpm_window_seconds_total)',
        f"max without (pipe) (rate({_s('gpuwarden_gpm_pipe_active_seconds_total', pipe='tensor')}[{WINDOW}])) "
        f"/ rate({WINDOW_OF}[{WINDOW}])",
    ),
    Field(
        "DCGM_FI_PROF_DRAM_ACTIVE",
        "ratio (0-1)",
        "rate(gpuwarden_gpm_dram_active_seconds_total) / rate(gpuwarden_gpm_window_seconds_total)",
        _ratio(_s("gpuwarden_gpm_dram_active_seconds_total"), _s("gpuwarden_gpm_window_seconds_total")),
    ),
    Field(
        "DCGM_FI_DEV_FB_FREE",
        "MiB",
        "gpuwarden_memory_free_bytes (bytes)",
        f"{_s('gpuwarden_memory_free_bytes')} / {MIB}",
        group="memory_detail",
    ),
    Field(
        "DCGM_FI_DEV_FB_USED",
        "MiB",
        "gpuwarden_memory_used_bytes (bytes)",
        f"{_s('gpuwarden_memory_used_bytes')} / {MIB}",
    ),
    Field(
        "DCGM_FI_DEV_FB_RESERVED",
        "MiB",
        "gpuwarden_memory_reserved_bytes (bytes)",
        f"{_s('gpuwarden_memory_reserved_bytes')} / {MIB}",
        group="memory_detail",
    ),
    Field(
        "DCGM_FI_DEV_XID_ERRORS",
        "the last XID's code (gauge), err_code and err_msg labels",
        "gpuwarden_xid_errors_total{xid} and gpuwarden_xid_last_timestamp_seconds{xid}: every XID, not the last",
        f"max without (xid) ({_xid_value()})",
        "the compat series gives the latest XID's code for the XIDs gpuwarden's catalog names; a last-value gauge "
        "hides every XID but the last (NVIDIA/dcgm-exporter#190): move alerts to GpuwardenXidCritical",
    ),
    Field(
        "DCGM_FI_DEV_PCIE_REPLAY_COUNTER",
        "count",
        "gpuwarden_pcie_replay_errors_total",
        _s("gpuwarden_pcie_replay_errors_total"),
    ),
    Field(
        "DCGM_FI_DEV_CORRECTABLE_REMAPPED_ROWS",
        "count",
        'gpuwarden_remapped_rows{cause="correctable"}',
        f"max without (cause) ({_s('gpuwarden_remapped_rows', cause='correctable')})",
        group="memory_detail",
    ),
    Field(
        "DCGM_FI_DEV_UNCORRECTABLE_REMAPPED_ROWS",
        "count",
        'gpuwarden_remapped_rows{cause="uncorrectable"}',
        f"max without (cause) ({_s('gpuwarden_remapped_rows', cause='uncorrectable')})",
        group="memory_detail",
    ),
    Field(
        "DCGM_FI_DEV_ROW_REMAP_FAILURE", "0/1", "gpuwarden_remapped_rows_failed", _s("gpuwarden_remapped_rows_failed")
    ),
    Field(
        "DCGM_FI_DEV_NVLINK_BANDWIDTH_TOTAL",
        "B/s",
        "rate(gpuwarden_nvlink_bytes_total) summed over direction",
        f"sum without (direction) (rate({_s('gpuwarden_nvlink_bytes_total')}[{WINDOW}]))",
    ),
    Field(
        "DCGM_FI_PROF_PCIE_TX_BYTES",
        "B/s",
        'rate(gpuwarden_pcie_bytes_total{direction="tx"})',
        f"max without (direction) (rate({_s('gpuwarden_pcie_bytes_total', direction='tx')}[{WINDOW}]))",
    ),
    Field(
        "DCGM_FI_PROF_PCIE_RX_BYTES",
        "B/s",
        'rate(gpuwarden_pcie_bytes_total{direction="rx"})',
        f"max without (direction) (rate({_s('gpuwarden_pcie_bytes_total', direction='rx')}[{WINDOW}]))",
    ),
    Field(
        "DCGM_FI_DEV_VGPU_LICENSE_STATUS",
        "0/1",
        "none",
        None,
        "vGPU guests are not gpuwarden's: it runs on bare-metal and passthrough nodes",
    ),
    Field(
        "DCGM_FI_DRIVER_VERSION",
        "a label on every series",
        "gpuwarden_driver_info{driver_version} (one series per node)",
        None,
        "the compat series carry it as the label DCGM_FI_DRIVER_VERSION",
    ),
)

# dcgm's labels → where the compat series take them from
LABELS = (
    ("gpu", "gpu (the same index)"),
    ("UUID", "uuid"),
    ("pci_bus_id", "gpuwarden_gpu_info{pci_bus_id}"),
    ("modelName", "gpuwarden_gpu_info{name}"),
    ("Hostname / hostname", "the scrape's `node` label (gpuwarden puts no host name on its series)"),
    ("device (nvidiaN)", "none: NVML gives no device minor; `gpu` is the index"),
    ("namespace, pod, container", "gpuwarden_gpu_allocation (one container per GPU; under time-slicing the first)"),
    ("DCGM_FI_DRIVER_VERSION", "gpuwarden_driver_info{driver_version}"),
)


def _labels_record() -> str:
    """One series per GPU carrying dcgm's labels, value 1: every compat series is multiplied by it."""
    info = _s("gpuwarden_gpu_info")
    named = f'label_replace(label_replace({info}, "modelName", "$1", "name", "(.*)"), "UUID", "$1", "uuid", "(.*)")'
    named = f'label_replace(label_replace({named}, "Hostname", "$1", "node", "(.*)"), "hostname", "$1", "node", "(.*)")'
    driver = f'label_replace({_s("gpuwarden_driver_info")}, "DCGM_FI_DRIVER_VERSION", "$1", "driver_version", "(.*)")'
    ids = (
        f"max without (name, serial, vbios_version, compute_capability) ({named}) "
        f"* on (instance) group_left (DCGM_FI_DRIVER_VERSION) max by (instance, DCGM_FI_DRIVER_VERSION) ({driver})"
    )
    pod = f"topk by (instance, uuid) (1, {_s('gpuwarden_gpu_allocation')})"
    return f"({ids} * on (instance, uuid) group_left (namespace, pod, container) {pod}) or on (instance, uuid) {ids}"


def groups_needed() -> list[str]:
    """The metrics.enable_groups every compat series needs (the rest come from gpuwarden's default series)."""
    return sorted({f.group for f in FIELDS if f.group})


def rules() -> list[dict]:
    """The compat recording rules: the labels carrier, the latest XID, then one rule per field that has one."""
    latest = _s("gpuwarden_xid_last_timestamp_seconds")
    out = [
        {"record": LABELS_RECORD, "expr": _labels_record()},
        {
            "record": XID_LATEST,
            "expr": f"{latest} == on (instance, uuid) group_left () max by (instance, uuid) ({latest})",
        },
    ]
    carried = "UUID, pci_bus_id, modelName, Hostname, hostname, DCGM_FI_DRIVER_VERSION, namespace, pod, container"
    for field in FIELDS:
        if field.expr is None:
            continue
        out.append(
            {
                "record": field.dcgm,
                "expr": f"({field.expr}) * on (instance, uuid) group_left ({carried}) {LABELS_RECORD}",
            }
        )
    return out


HEADER = (
    "# Generated by `python alert_rules/generate.py` from alert_rules/dcgm_compat.py: do not edit.\n"
    "# Opt-in, for a migration from dcgm-exporter (docs/migration-from-dcgm.md): dcgm-exporter's default fields, in\n"
    "# its units and labels, rebuilt from gpuwarden's series. Load it beside gpuwarden.rules.yaml; remove it once no\n"
    "# dashboard or alert reads DCGM_* names.\n"
)


def rules_yaml() -> str:
    return HEADER + yaml.safe_dump(
        {"groups": [{"name": "gpuwarden-dcgm-compat", "rules": rules()}]}, sort_keys=False, width=120
    )


def table() -> str:
    """The migration table (Markdown), every default field a row."""
    lines = ["| dcgm-exporter field | its unit | gpuwarden | compat series | note |", "|---|---|---|---|---|"]
    for f in FIELDS:
        compat = "no" if not f.expr else f"with `{f.group}`" if f.group else "yes"
        lines.append(f"| `{f.dcgm}` | {f.unit} | {f.gpuwarden} | {compat} | {f.note} |")
    return "\n".join(lines) + "\n"
