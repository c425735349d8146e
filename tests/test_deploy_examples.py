"""The example Prometheus configuration for hosts outside Kubernetes is valid for the real promtool, selects the
job the shipped rules use, and the check itself catches a broken file."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parent.parent
CONFIG = ROOT / "deploy" / "prometheus" / "prometheus.yml"
PROMTOOL = shutil.which("promtool")


@pytest.mark.skipif(PROMTOOL is None, reason="promtool not installed (the README test command installs it)")
def test_the_scrape_config_example_passes_promtool():
    result = subprocess.run([PROMTOOL, "check", "config", str(CONFIG)], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr
    found = [line for line in result.stdout.splitlines() if "rules found" in line]
    assert found and int(found[0].split("SUCCESS: ")[1].split()[0]) >= 25, result.stdout  # the shipped rules loaded


def test_the_example_scrapes_the_job_the_rules_select():
    config = yaml.safe_load(CONFIG.read_text())
    assert [job["job_name"] for job in config["scrape_configs"]] == ["gpuwarden"]
    rules = (CONFIG.parent / config["rule_files"][0]).resolve()
    assert rules == ROOT / "alert_rules" / "gpuwarden.rules.yaml"
    assert 'job="gpuwarden"' in rules.read_text()


@pytest.mark.skipif(PROMTOOL is None, reason="promtool not installed (the README test command installs it)")
def test_promtool_catches_a_broken_copy(tmp_path):
    text = CONFIG.read_text().replace("../../alert_rules/", f"{ROOT / 'alert_rules'}/")
    (tmp_path / "good.yml").write_text(text)
    (tmp_path / "broken.yml").write_text(text.replace("scrape_timeout: 10s", "scrape_timeout: 20s"))  # > interval
    check = [PROMTOOL or "promtool", "check", "config"]
    assert subprocess.run([*check, str(tmp_path / "good.yml")], capture_output=True, timeout=60).returncode == 0
    result = subprocess.run([*check, str(tmp_path / "broken.yml")], capture_output=True, text=True, timeout=60)
    assert result.returncode != 0 and "scrape timeout greater than scrape interval" in result.stdout + result.stderr
