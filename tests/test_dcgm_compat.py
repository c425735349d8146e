"""The dcgm-exporter migration path (issue 36 point 10): every default field of dcgm-exporter in the migration table,
the opt-in compat rule file as generated, and every compat series in real Prometheus over the simulator, in dcgm's
units and labels (promtool checks exact values: alert_rules/tests/dcgm-compat.test.yaml)."""

from __future__ import annotations

from pathlib import Path

import pytest

from alert_rules import dcgm_compat
from tests.helpers.common import wait_for
from tests.helpers.stack import PROMETHEUS, stack

ROOT = Path(__file__).resolve().parent.parent

# dcgm-exporter 4.8's etc/default-counters.csv, its 26 active rows (DCGM_FI_DRIVER_VERSION is a label on every series)
DCGM_DEFAULTS = {
    "DCGM_FI_DEV_SM_CLOCK", "DCGM_FI_DEV_MEM_CLOCK", "DCGM_FI_DEV_GPU_TEMP", "DCGM_FI_DEV_MEMORY_TEMP",
    "DCGM_FI_DEV_POWER_USAGE", "DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION", "DCGM_FI_DEV_GPU_UTIL",
    "DCGM_FI_DEV_MEM_COPY_UTIL", "DCGM_FI_DEV_ENC_UTIL", "DCGM_FI_DEV_DEC_UTIL", "DCGM_FI_PROF_GR_ENGINE_ACTIVE",
    "DCGM_FI_PROF_PIPE_TENSOR_ACTIVE", "DCGM_FI_PROF_DRAM_ACTIVE", "DCGM_FI_DEV_FB_FREE", "DCGM_FI_DEV_FB_USED",
    "DCGM_FI_DEV_FB_RESERVED", "DCGM_FI_DEV_XID_ERRORS", "DCGM_FI_DEV_PCIE_REPLAY_COUNTER",
    "DCGM_FI_DEV_CORRECTABLE_REMAPPED_ROWS", "DCGM_FI_DEV_UNCORRECTABLE_REMAPPED_ROWS", "DCGM_FI_DEV_ROW_REMAP_FAILURE",
    "DCGM_FI_DEV_NVLINK_BANDWIDTH_TOTAL", "DCGM_FI_PROF_PCIE_TX_BYTES", "DCGM_FI_PROF_PCIE_RX_BYTES",
    "DCGM_FI_DEV_VGPU_LICENSE_STATUS", "DCGM_FI_DRIVER_VERSION",
}  # fmt: skip


def test_the_table_covers_every_default_field_and_says_why_where_there_is_none() -> None:
    assert {f.dcgm for f in dcgm_compat.FIELDS} == DCGM_DEFAULTS
    for field in dcgm_compat.FIELDS:
        assert field.expr or field.note, f"{field.dcgm}: no compat series and no reason given"
    doc = (ROOT / "docs" / "migration-from-dcgm.md").read_text()
    assert f"--metrics.enable-groups {','.join(dcgm_compat.groups_needed())}" in doc
    assert dcgm_compat.table() in doc  # the page shows the table the rules are built from
    for label, source in dcgm_compat.LABELS:
        assert f"| `{label}` | {source} |" in doc


def test_the_compat_rule_file_is_the_generated_one() -> None:
    committed = (ROOT / "alert_rules" / "dcgm-compat.recording.yaml").read_text()
    assert committed == dcgm_compat.rules_yaml(), "run: python alert_rules/generate.py"


@pytest.mark.slow
@pytest.mark.skipif(PROMETHEUS is None, reason="Debian's prometheus (the README test command installs it)")
def test_every_compat_series_comes_from_real_prometheus_in_dcgms_units_and_labels(tmp_path: Path) -> None:
    with stack(tmp_path) as parts:
        # GPM on H100, NVLink over NVSwitch, an XID 48 and remapped rows; the groups the migration page names
        parts.exporter("ecc-uncorrectable", "--metrics.enable-groups", ",".join(dcgm_compat.groups_needed()))
        parts.start_prometheus(dcgm_compat.rules_yaml().replace("gpuwarden-dcgm-compat", "compat"), node_labels=True)
        records = [f.dcgm for f in dcgm_compat.FIELDS if f.expr]
        # every record answered (a rate needs two scrapes in its window; XID_ERRORS the GPU with the XID)
        wait_for(lambda: all(parts.query(name) for name in records), timeout=90, step=1)
        gpus = len(parts.query('gpuwarden_gpu_info{job="gpuwarden"}'))
        for name in records:
            rows = parts.query(name)
            want = 1 if name == "DCGM_FI_DEV_XID_ERRORS" else gpus
            assert len(rows) == want, (name, len(rows))
            for row in rows:
                labels = row["metric"]
                assert labels["UUID"] == labels["uuid"] and labels["Hostname"] == labels["node"], (name, labels)
                assert labels["modelName"].startswith("NVIDIA") and labels["DCGM_FI_DRIVER_VERSION"], (name, labels)
        # units: MiB against bytes, MHz against Hz (within the simulator's noise between a scrape and an evaluation)
        for dcgm, raw, scale in (
            ("DCGM_FI_DEV_FB_USED", "gpuwarden_memory_used_bytes", 2**20),
            ("DCGM_FI_DEV_SM_CLOCK", 'max without (clock) (gpuwarden_clock_hertz{clock="sm"})', 1e6),
            ("DCGM_FI_DEV_MEM_CLOCK", 'max without (clock) (gpuwarden_clock_hertz{clock="memory"})', 1e6),
            ("DCGM_FI_DEV_FB_FREE", "gpuwarden_memory_free_bytes", 2**20),
        ):
            off = f"abs(max by (uuid) ({dcgm}) * {scale} / on (uuid) max by (uuid) ({raw}) - 1)"
            assert all(float(r["value"][1]) < 0.05 for r in parts.query(off)), (dcgm, parts.query(off))
        (xid,) = parts.query("DCGM_FI_DEV_XID_ERRORS")
        assert xid["value"][1] == "48" and xid["metric"]["err_code"] == "48"
