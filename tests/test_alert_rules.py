"""The alert rules: generated from the thresholds, valid, unit-tested with promtool, each with a runbook."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from alert_rules import generate, restarts
from gpuwarden.health import rules

ROOT = Path(__file__).resolve().parent.parent
RULES = ROOT / "alert_rules" / "gpuwarden.rules.yaml"
TESTS = ROOT / "alert_rules" / "tests" / "gpuwarden.test.yaml"
RUNBOOKS = ROOT / "docs" / "runbooks.md"
PROMTOOL = shutil.which("promtool")
needs_promtool = pytest.mark.skipif(PROMTOOL is None, reason="promtool not installed (the README test command does)")


def loaded() -> list[dict]:
    """The alerts (the file's recording rules, which alerts read instead of a day of raw samples, are not)."""
    return [rule for group in yaml.safe_load(RULES.read_text())["groups"] for rule in group["rules"] if "alert" in rule]


def test_committed_rules_match_the_thresholds():
    assert RULES.read_text() == generate.alert_rules_yaml(rules.build()), "run `python alert_rules/generate.py`"
    # the map the chart's `thresholds` value reads (deploy/helm: prometheusrule.yaml)
    assert generate.THRESHOLD_MAP_FILE.read_text() == generate.threshold_map_json(), (
        "run `python alert_rules/generate.py`"
    )
    shipped_map = json.loads(generate.THRESHOLD_MAP_FILE.read_text())["temperature_critical_celsius"]
    critical = {"threshold": ["GpuwardenTemperatureCritical"], "for": [], "keep_firing": [], "other": []}
    assert shipped_map == critical


def moved(value: object) -> object:
    """A value one step from `value`, of its type."""
    if isinstance(value, tuple):
        return (*value, 999)  # an XID list with one more code
    if isinstance(value, str):
        return value + "|Nothing"
    return value + 1 if isinstance(value, int) else value * 1.01


def test_every_rule_declares_exactly_the_thresholds_it_reads():
    """Each field moved one step: the rules that change are the ones whose declarations name it, and in the way they
    declare (the number the expression ends on, `for:`, `keep_firing_for`, or otherwise). The threshold map the chart
    reads is built from the declarations (issue 51: no probing in the generator)."""
    import dataclasses

    from gpuwarden.health.rules_file import TRAILING_THRESHOLD
    from gpuwarden.health.thresholds import DEFAULT, Thresholds

    def rendered(t: Thresholds) -> dict[str, tuple[str, str | None, int, int]]:
        out = {}
        for rule in (r for g in rules.build(t) for r in g.rules):
            match = TRAILING_THRESHOLD.search(rule.expr)
            body = rule.expr[: match.start()] if match else rule.expr
            out[rule.alert] = (body, match.group(2) if match else None, rule.for_s, rule.keep_firing_s)
        return out

    base = rendered(DEFAULT)
    observed = {}
    for field in dataclasses.fields(Thresholds):
        new = moved(getattr(DEFAULT, field.name))
        candidate = dataclasses.replace(DEFAULT, **{field.name: new})
        candidate.validate()
        reach: dict[str, list[str]] = {"threshold": [], "for": [], "keep_firing": [], "other": []}
        for alert, (body, number, for_s, keep_s) in rendered(candidate).items():
            old_body, old_number, old_for, old_keep = base[alert]
            if body != old_body:
                reach["other"].append(alert)
                continue
            if number != old_number:
                reach["threshold" if float(number or "nan") == float(f"{new:g}") else "other"].append(alert)
            if for_s != old_for:
                reach["for" if for_s == new else "other"].append(alert)
            if keep_s != old_keep:
                reach["keep_firing" if keep_s == new else "other"].append(alert)
        observed[field.name] = reach
    assert observed == generate.threshold_map()


@needs_promtool
def test_every_yaml_in_alert_rules_is_a_rule_file_promtool_accepts():
    """`promtool check rules alert_rules/*.yaml`, the glob a `rule_files:` entry over the folder takes: only rule
    files carry .yaml there (the chart's threshold map is JSON)."""
    result = subprocess.run(
        f"{PROMTOOL} check rules alert_rules/*.yaml", shell=True, cwd=ROOT, capture_output=True, text=True
    )
    assert result.returncode == 0, result.stdout + result.stderr
    checked = sorted(p.name for p in (ROOT / "alert_rules").glob("*.yaml"))
    assert len(checked) >= 3
    assert all(f"Checking alert_rules/{name}" in result.stdout for name in checked), result.stdout


@needs_promtool
def test_promtool_check_rules_is_clean():
    result = subprocess.run([PROMTOOL, "check", "rules", str(RULES)], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr
    every = sum(len(group["rules"]) for group in yaml.safe_load(RULES.read_text())["groups"])  # alerts and records
    assert f"SUCCESS: {every} rules found" in result.stdout


@pytest.mark.slow  # promtool over every alert's unit tests
@needs_promtool
def test_the_shipped_unit_tests_pass_as_an_sre_runs_them():
    """Exactly docs/alerting.md's command, from the repository root: rules, labels and rendered annotations."""
    result = subprocess.run(
        "promtool test rules alert_rules/tests/*.yaml", shell=True, cwd=ROOT, capture_output=True, text=True
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS" in result.stdout
    expected = [
        alert for test in yaml.safe_load(TESTS.read_text())["tests"] for check in test["alert_rule_test"]
        for alert in check["exp_alerts"]
    ]  # fmt: skip
    assert expected and all(alert.get("exp_annotations", {}).get("description") for alert in expected)


def test_the_generated_promtool_tests_are_committed_as_generated():
    """The restart, fresh-Prometheus and verdict-agreement tests (alert_rules/restarts.py, agreement.py)."""
    for path, text in generate.generated_tests().items():
        assert path.read_text() == text, f"{path.name}: run `python alert_rules/generate.py`"


def test_every_page_for_a_lasting_fault_has_a_restart_test():
    """A new page cannot ship without its 2-minute-gap tests (both restart styles), or a reason it has none."""
    pages = {r.alert for g in rules.build() for r in g.rules if r.severity == "critical"}
    tested = {fault.alert for fault in restarts.FAULTS}
    assert pages - tested == set(restarts.NOT_HELD), "add the page to restarts.FAULTS"
    assert tested <= pages
    named = {test["name"].split(":")[0] for test in yaml.safe_load(generate.RESTARTS_TESTS_FILE.read_text())["tests"]}
    assert named == tested


def test_every_alert_has_a_firing_test_and_a_silent_healthy_case():
    tests = yaml.safe_load(TESTS.read_text())["tests"]
    fired = {check["alertname"] for test in tests for check in test["alert_rule_test"] if check["exp_alerts"]}
    names = {rule["alert"] for rule in loaded()}
    assert names <= fired, names - fired
    healthy = next(test for test in tests if test["name"].startswith("a healthy node"))
    assert {check["alertname"] for check in healthy["alert_rule_test"] if not check["exp_alerts"]} == names


def test_conventions_severity_annotations_runbooks():
    runbook_headings = set(re.findall(r"^## (Gpuwarden\w+)$", RUNBOOKS.read_text(), re.M))
    for rule in loaded():
        name = rule["alert"]
        assert re.fullmatch(r"Gpuwarden[A-Z][A-Za-z]+", name)
        assert rule["labels"]["severity"] in ("critical", "warning", "info")
        annotations = rule["annotations"]
        assert annotations["summary"].endswith(".") and "{{" not in annotations["summary"]
        node_level = ("GpuwardenGpuCountDropped", "GpuwardenExporterAbsent")
        assert "{{ $labels." in annotations["description"] or name in node_level
        assert annotations["runbook_url"].endswith(f"runbooks.md#{name.lower()}")
        assert name in runbook_headings, f"docs/runbooks.md has no section for {name}"
    descriptions = {rule["alert"]: rule["annotations"]["description"] for rule in loaded()}
    assert "RMA" in descriptions["GpuwardenRowRemapFailure"]
    assert "cordon" in descriptions["GpuwardenEccUncorrectable"]
    assert "never" not in descriptions["GpuwardenMemoryNearlyFull"]


def test_memory_and_utilization_never_page():
    severities = {rule["alert"]: rule["labels"]["severity"] for rule in loaded()}
    assert severities["GpuwardenMemoryNearlyFull"] != "critical"
    assert severities["GpuwardenUnderutilized"] == "info"
    assert severities["GpuwardenPowerCapSustained"] == "info"


def test_rules_follow_overridden_thresholds():
    from gpuwarden.health.thresholds import Thresholds

    text = generate.alert_rules_yaml(
        rules.build(Thresholds(temperature_warning_celsius=80, temperature_warning_for_s=600))
    )
    rule = next(
        r for g in yaml.safe_load(text)["groups"] for r in g["rules"] if r["alert"] == "GpuwardenTemperatureHigh"
    )
    assert rule["expr"].endswith("> 80") and rule["for"] == "10m"


def test_the_words_name_the_thresholds_they_template_and_keep_prometheus_own():
    """Descriptions are templates over the thresholds (health/alerts.toml): a moved threshold is in the page's words,
    in its unit, and what Prometheus renders ({{ $value }}, {{ $labels.gpu }}) passes through untouched."""
    import dataclasses

    from gpuwarden.health.thresholds import DEFAULT

    def descriptions(t: object) -> dict[str, str]:
        return {r.alert: r.description for g in rules.build(t) for r in g.rules}

    shipped = descriptions(DEFAULT)
    tuned = descriptions(
        dataclasses.replace(
            DEFAULT, gpu_count_memory_s=2 * 86400, thermal_page_window_s=900, memory_temperature_margin_celsius=7.5
        )
    )
    assert "the most seen in the last 24h)" in shipped["GpuwardenGpuCountDropped"]
    assert "the most seen in the last 48h)" in tuned["GpuwardenGpuCountDropped"]
    assert "of the last 10m in thermal slowdown" in shipped["GpuwardenThermalThrottling"]
    assert "of the last 15m in thermal slowdown" in tuned["GpuwardenThermalThrottling"]
    assert "within 5 °C of its limit" in shipped["GpuwardenMemoryTemperatureHigh"]
    assert "within 7.5 °C of its limit" in tuned["GpuwardenMemoryTemperatureHigh"]
    assert shipped["GpuwardenMemoryTemperatureHigh"].startswith(f"The HBM of {rules.GPU} is at {{{{ $value }}}} °C")
    assert "stopped first{{ end }}." in shipped["GpuwardenCollectiveHang"]
    unchanged = set(shipped) - {
        "GpuwardenGpuCountDropped",
        "GpuwardenThermalThrottling",
        "GpuwardenMemoryTemperatureHigh",
    }
    assert all(shipped[name] == tuned[name] for name in unchanged)


@pytest.mark.parametrize(
    ("change", "line"),
    [
        (
            ("the driver is not loaded", "the driver is {nvml_down_for} not loaded"),
            "alerts.toml: GpuwardenNvmlDown: unknown placeholder {nvml_down_for}; use {GPU}, {NODE}",
        ),
        (
            ("nvlink -s`; plan a drain", "nvlink -s`; plan a drain within {NODE|duration}"),
            "alerts.toml: GpuwardenFabricDegraded: unknown placeholder {NODE|duration}",
        ),
        (
            ('for = "persistence_off_for_s"', 'for = "persistence_of_for_s"'),
            "alerts.toml: GpuwardenPersistenceModeOff: no threshold named 'persistence_of_for_s'",
        ),
        (
            (
                '[GpuwardenPcieReplaysHigh]\nseverity = "warning"',
                '[GpuwardenPcieReplaysHigh]\nseverity = "warning"\nfro = 60',
            ),
            "alerts.toml: GpuwardenPcieReplaysHigh: unknown key 'fro'",
        ),
        (
            ("[GpuwardenPersistenceModeOff]", "[GpuwardenPersistenceModeOf]"),
            "alerts.toml: GpuwardenPersistenceModeOff: no table for this alert of group gpuwarden-configuration",
        ),
        (
            (
                "[GpuwardenPersistenceModeOff]",
                '[GpuwardenFanBroken]\nseverity = "warning"\n\n[GpuwardenPersistenceModeOff]',
            ),
            "alerts.toml: GpuwardenFanBroken: declared, but no rule group has its expression",
        ),
    ],
)
def test_a_mistake_in_alerts_toml_fails_in_one_line_naming_the_alert(change: tuple[str, str], line: str):
    """The declarations are data: a misspelt placeholder, field or key, or an alert declared on one side only, stops
    the rules' build with one line naming the alert, rather than shipping a page that reads `{nvml_down_for}`."""
    import tomllib

    from gpuwarden.health.rules_model import ALERTS_FILE

    text = ALERTS_FILE.read_text(encoding="utf-8")
    assert text.count(change[0]) == 1
    with pytest.raises(rules.DeclarationError) as raised:
        rules.build(alerts=tomllib.loads(text.replace(*change)))
    assert str(raised.value).startswith(line) and "\n" not in str(raised.value)


def test_lasting_conditions_are_evaluated_less_often_until_a_threshold_is_tuned_shorter():
    """A group is evaluated every 10, 5 or 2 minutes where the shortest of its conditions holds two evaluations of
    that interval if the group pages, one if it only opens tickets or informs (issues 38 and 51: CPU at 10,000
    nodes); a threshold tuned below that puts its group on a shorter interval, down to the server's."""
    from gpuwarden.health.thresholds import Thresholds

    def intervals(**tuned: int) -> dict[str, str | None]:
        text = generate.alert_rules_yaml(rules.build(Thresholds(**tuned)))
        return {g["name"]: g.get("interval") for g in yaml.safe_load(text)["groups"]}

    shipped = intervals()
    # tickets and information over 10 minutes or more: every 10 minutes
    assert shipped[rules.SUSTAINED_GROUP] == shipped["gpuwarden-capacity"] == "10m"
    assert shipped["gpuwarden-configuration"] == "10m"
    # tickets over 5 minutes, and a page over 10: every 5 minutes
    assert shipped["gpuwarden-thermal-power"] == shipped["gpuwarden-thermal-page"] == "5m"
    # pages over 5 minutes: every 2 minutes
    assert shipped["gpuwarden-interconnect"] == "2m"
    # pages on shorter or instant conditions: the server's interval
    assert shipped["gpuwarden-thermal-critical"] is shipped["gpuwarden-availability"] is None
    assert shipped["gpuwarden-fabric-faults"] is None
    # states that last until a reset or a replacement, compared at an instant: every 2 minutes, whatever is tuned
    assert shipped["gpuwarden-memory-health"] == "2m"
    tuned = intervals(nvlink_crc_for_s=120, memory_for_s=300, thermal_slowdown_for_s=180, fabric_setup_for_s=420)
    assert tuned[rules.SUSTAINED_GROUP] == tuned["gpuwarden-thermal-power"] == "2m"  # one evaluation fits
    assert tuned["gpuwarden-capacity"] == "5m"
    assert tuned["gpuwarden-configuration"] == "10m" and tuned["gpuwarden-interconnect"] == "2m"  # untouched
    assert tuned["gpuwarden-memory-health"] == "2m"
    # a ticket's condition shorter than the shortest tier, a page's shorter than two: the server's interval
    assert intervals(pcie_replays_for_s=60)[rules.SUSTAINED_GROUP] is None
    assert intervals(nvlink_down_for_s=200)["gpuwarden-interconnect"] is None
    assert intervals(thermal_page_for_s=300)["gpuwarden-thermal-page"] == "2m"


def test_shipped_alertmanager_config_is_valid():
    amtool = shutil.which("amtool")
    if amtool is None:
        pytest.skip("amtool not installed (the README test command installs prometheus-alertmanager)")
    result = subprocess.run(
        [amtool, "check-config", str(ROOT / "deploy" / "alertmanager" / "alertmanager.yml")],
        capture_output=True,
        text=True,
    )
    assert result.returncode == 0 and "SUCCESS" in result.stdout, result.stdout + result.stderr
    config = str(ROOT / "deploy" / "alertmanager" / "alertmanager.yml")
    for labels, receiver in (
        (["severity=critical", "alertname=GpuwardenGpuLost"], "gpu-oncall"),
        (["severity=warning", "alertname=GpuwardenTemperatureHigh"], "gpu-tickets"),
        (["severity=info", "alertname=GpuwardenUnderutilized"], "blackhole"),
        # the cluster's other alerts are not discarded: they reach its own default receiver
        (["severity=critical", "alertname=KubeNodeNotReady"], "cluster-default"),
        (["severity=info", "alertname=Watchdog"], "cluster-default"),
    ):
        routed = subprocess.run(
            [amtool, "config", "routes", "test", f"--config.file={config}", *labels], capture_output=True, text=True
        )
        assert routed.stdout.strip() == receiver, (labels, routed.stdout, routed.stderr)
