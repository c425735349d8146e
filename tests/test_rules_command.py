"""`gpuwarden rules --thresholds FILE`: a site's thresholds file, the one the exporter reads, rendered into the alert
rules its Prometheus loads; the pages and the exporter's verdicts then judge a reading by the same number."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from gpuwarden.health.rules import build
from gpuwarden.health.rules_file import alert_rules_yaml
from gpuwarden.health.thresholds import load_thresholds
from tests.helpers.common import poll_series, values, write_yaml

PROMTOOL = shutil.which("promtool")
needs_promtool = pytest.mark.skipif(PROMTOOL is None, reason="promtool not installed (the README test command does)")


def gpuwarden(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "gpuwarden", *args], capture_output=True, text=True, timeout=60)


def fires_at_six_minutes(rules_file: Path, temperature: float, tmp: Path) -> tuple[bool, str]:
    """Whether GpuwardenTemperatureHigh fires on a GPU held at `temperature` for 6 minutes, as promtool evaluates the
    rule file: a test that expects no alert fails, naming the alert it got, exactly when one fires."""
    test = write_yaml(
        tmp / f"{rules_file.stem}.test.yaml",
        {
            "rule_files": [str(rules_file)],
            "evaluation_interval": "1m",
            "tests": [
                {
                    "interval": "1m",
                    "input_series": [
                        {
                            "series": 'gpuwarden_temperature_celsius{job="gpuwarden",instance="n1:10045",gpu="0",'
                            'uuid="GPU-0"}',
                            "values": f"{temperature}x10",
                        }
                    ],
                    "alert_rule_test": [{"eval_time": "6m", "alertname": "GpuwardenTemperatureHigh", "exp_alerts": []}],
                }
            ],
        },
    )
    result = subprocess.run([PROMTOOL, "test", "rules", str(test)], capture_output=True, text=True, timeout=60)
    output = result.stdout + result.stderr
    return result.returncode != 0 and "alertname: GpuwardenTemperatureHigh" in output, output


@needs_promtool
def test_a_sites_thresholds_reach_both_the_pages_and_the_exporters_verdicts(sim, tmp_path):
    thresholds = write_yaml(
        tmp_path / "thresholds.yaml", {"temperature_warning_celsius": 70, "temperature_warning_for_s": 60}
    )
    site_rules, shipped_rules = tmp_path / "site.rules.yaml", tmp_path / "shipped.rules.yaml"
    made = gpuwarden("rules", "--thresholds", str(thresholds), "--out", str(site_rules))
    assert made.returncode == 0, made.stderr
    assert gpuwarden("rules", "--out", str(shipped_rules)).returncode == 0
    assert subprocess.run([PROMTOOL, "check", "rules", str(site_rules)], capture_output=True).returncode == 0
    # the file is the model's rules for those thresholds, nothing else
    assert yaml.safe_load(site_rules.read_text()) == yaml.safe_load(
        alert_rules_yaml(build(load_thresholds(thresholds)))
    )
    # a GPU at 75 °C, between the site's 70 and the default 83: the exporter warns with the site's file, not without
    scenario = {"node": {"count": 1}, "values": {"temperature": 75}}
    judged = {}
    for name, health in (("site", {"thresholds_file": str(thresholds)}), ("shipped", {})):
        _, polls = poll_series(sim, scenario, 70, health=health)  # 70 s of a manual clock, past the 60 s `for`
        assert values(polls[-1], "gpuwarden_temperature_celsius", gpu="0") == [75]
        judged[name] = values(polls[-1], "gpuwarden_health", gpu="0", check="temperature")
    assert judged == {"site": [1], "shipped": [0]}  # warning with the site's thresholds, ok with the defaults
    # and the pages agree: the site's rules page at 75 °C, the shipped ones do not
    site_fires, output = fires_at_six_minutes(site_rules, 75, tmp_path)
    assert site_fires, output
    shipped_fires, output = fires_at_six_minutes(shipped_rules, 75, tmp_path)
    assert not shipped_fires, output


def test_bad_input_is_one_line_and_exit_2(tmp_path):
    unknown = write_yaml(tmp_path / "typo.yaml", {"temperature_warning_c": 70})
    cases = {
        ("--thresholds", str(unknown)): "unknown key 'temperature_warning_c'",
        ("--thresholds", str(tmp_path / "missing.yaml")): "check the --thresholds path",
        ("--out", str(tmp_path / "no-such-dir" / "rules.yaml")): "check the --out path",
        ("--bogus",): "unrecognized arguments: --bogus",
    }
    for args, expected in cases.items():
        result = gpuwarden("rules", *args)
        lines = result.stderr.strip().splitlines()
        assert result.returncode == 2 and len(lines) == 1 and expected in lines[0], (args, result.stderr)
    assert not (tmp_path / "no-such-dir").exists()
    helped = gpuwarden("rules", "--help")
    assert helped.returncode == 0 and "--thresholds" in helped.stdout
    assert gpuwarden("check-config", "--help").returncode == 0  # was "cannot read --help"
