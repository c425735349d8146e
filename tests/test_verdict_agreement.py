"""Page and verdict agree at every threshold: one table (alert_rules/agreement.py) judged by promtool on the shipped
rules and by the exporter's own evaluator (health/evaluator.py) on the same readings, one step past the threshold, at
it and one step short of it. An alert that mirrors a verdict cannot be added without a row."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from alert_rules import agreement, generate
from alert_rules.promtool_series import samples
from gpuwarden.health.checks import CHECKS
from gpuwarden.health.evaluator import HealthEvaluator
from gpuwarden.health.rules import build
from gpuwarden.health.thresholds import DEFAULT
from gpuwarden.model.families import FAMILIES
from gpuwarden.model.snapshot import GpuInfo, GpuSnapshot, NvlinkFacts, Sample, Verdict

ROOT = Path(__file__).resolve().parent.parent
PROMTOOL = shutil.which("promtool")
RANK = {"ok": 0, "pending": 0, "info": 1, "warning": 2, "critical": 3}
UUID = agreement.GPU_LABELS["uuid"]
WIRED = NvlinkFacts(agreement.LINKS, tuple((link, f"0000:{0x40 + link:02X}:00.0") for link in range(agreement.LINKS)))


def gpu_at(readings: agreement.Readings, values: list, poll: int) -> GpuSnapshot:
    """The GPU as the exporter publishes it at `poll`, every tier read."""
    now = float(poll * agreement.INTERVAL_S)
    return GpuSnapshot(
        index=0,
        uuid=UUID,
        up=readings.up,
        stale=False,
        lost_reason=None if readings.up else "GPU is lost",
        hardware_error=None,
        info=GpuInfo(name=agreement.MODEL, nvlink=WIRED),
        samples=tuple(
            Sample(s.name, tuple(s.labels.get(label, "") for label in FAMILIES[s.name].labels), float(v[poll]))
            for s, v in values
        ),
        updated_at=dict.fromkeys(("static", "fast", "slow"), now),
    )


def run(evaluator: HealthEvaluator, row: agreement.Row, value: float, polls: range) -> dict[int, Verdict]:
    """The verdicts of the row's check at each poll of `polls` (the readings held from poll 0)."""
    readings = row.readings(value)
    check = agreement.rule(row.alert).verdict
    values = [(s, samples([agreement.run(s, polls.stop * agreement.INTERVAL_S)])) for s in readings.series if s.per_gpu]
    at = row.at_s
    xid = {(UUID, code): (1, float(at - age)) for code, age in readings.xids}
    kernel = {("sxid", agreement.SWITCH, code): (1, float(at - age)) for code, age in readings.sxids}
    out = {}
    for poll in polls:
        now = float(poll * agreement.INTERVAL_S)
        verdicts = evaluator.evaluate([gpu_at(readings, values, poll)], xid, now, kernel=kernel)[UUID]
        out[poll] = next(v for v in verdicts if v.check == check)
    return out


def judge(row: agreement.Row, value: float) -> Verdict:
    """The exporter's verdict on the row's readings, polled every scrape interval from 0 to the judgement time."""
    last = row.at_s // agreement.INTERVAL_S
    return run(HealthEvaluator(DEFAULT), row, value, range(last + 1))[last]


@pytest.mark.parametrize(
    ("row", "value", "fires"),
    [(row, value, fires) for row in agreement.TABLE for value, fires in row.points()],
    ids=[f"{row.alert}-{value:g}" for row in agreement.TABLE for value, _ in row.points()],
)
def test_the_exporters_verdict_reaches_the_pages_severity_exactly_where_the_page_fires(row, value, fires):
    severity = agreement.rule(row.alert).severity
    verdict = judge(row, value)
    assert (RANK[verdict.severity] >= RANK[severity]) == fires, (row.alert, value, fires, verdict)


def test_a_restart_during_sustained_thermal_throttling_keeps_the_critical_tier_until_the_window_is_watched_again():
    """The state file recalls the page's condition (health/state_file.py): while the successor has not watched
    thermal_page_window_s, its verdict is pending at critical (npd-plugin and slurm-healthcheck: unknown, never
    healthy); once watched, critical again at once, where a start without the memory waits thermal_page_for_s."""
    row = next(r for r in agreement.TABLE if r.alert == "GpuwardenThermalThrottling")
    before = HealthEvaluator(DEFAULT)
    first = row.at_s // agreement.INTERVAL_S
    assert run(before, row, 1.0, range(first + 1))[first].level == 2
    after, forgetful = HealthEvaluator(DEFAULT), HealthEvaluator(DEFAULT)
    after.recall(before.memory())
    window = DEFAULT.thermal_page_window_s // agreement.INTERVAL_S
    restarted = range(first + 8, first + 8 + window + 2)  # back after a 2-minute gap, the counter kept counting
    recalled, fresh = run(after, row, 1.0, restarted), run(forgetful, row, 1.0, restarted)
    assert recalled[restarted[0]].severity == "pending" and recalled[restarted[0]].pending_level == 2
    # once the window is watched: critical at once with the memory; without it the page's 10 m must pass again
    assert recalled[restarted[-1]].level == 2 and fresh[restarted[-1]].level < 2


def test_every_alert_with_a_verdict_has_a_row_and_every_other_alert_says_why_it_has_none():
    alerts = {r.alert: r for g in build() for r in g.rules}
    rows = {row.alert for row in agreement.TABLE}
    with_verdict = {name for name, r in alerts.items() if r.verdict}
    assert with_verdict == rows, (
        "rows missing",
        with_verdict - rows,
        "rows for alerts without one",
        rows - with_verdict,
    )
    assert set(alerts) - with_verdict == set(agreement.NO_VERDICT), "declare Rule.verdict or say why in NO_VERDICT"
    assert {alerts[name].verdict for name in with_verdict} <= set(CHECKS)
    # every page is in the table unless it has no verdict to agree with
    pages = {name for name, r in alerts.items() if r.severity == "critical"}
    assert pages - rows <= set(agreement.NO_VERDICT)


def test_every_threshold_row_judges_one_step_each_side_of_the_declared_threshold():
    for row in agreement.TABLE:
        points = row.points()
        assert any(fires for _, fires in points) and not all(fires for _, fires in points), row.alert
        declared = agreement.rule(row.alert).threshold
        if row.boundary is None:
            assert declared is not None, f"{row.alert}: no declared threshold; give the row its boundary"


def test_the_committed_promtool_side_is_the_tables():
    committed = yaml.safe_load(generate.VERDICTS_TESTS_FILE.read_text())
    assert committed == agreement.promtool_tests(), "run `python alert_rules/generate.py`"


@pytest.mark.slow  # promtool over 73 readings of up to an hour
@pytest.mark.skipif(PROMTOOL is None, reason="promtool not installed (the README test command installs it)")
def test_promtool_judges_the_shipped_rules_on_the_same_readings():
    result = subprocess.run(
        [PROMTOOL, "test", "rules", str(generate.VERDICTS_TESTS_FILE.relative_to(ROOT))],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert result.returncode == 0 and "SUCCESS" in result.stdout, result.stdout + result.stderr
