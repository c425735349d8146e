"""Write the rule files from the code (a development tool, not part of the package): `python alert_rules/generate.py`.

- alert_rules/gpuwarden.rules.yaml from the alert rules' model (exporter/gpuwarden/health/rules.py, its thresholds
  from exporter/gpuwarden/health/thresholds.py);
- alert_rules/gpuwarden.recording.yaml from the fleet's recording rules (exporter/gpuwarden/fleet/recording.py);
- alert_rules/dcgm-compat.recording.yaml, the opt-in dcgm-exporter names (alert_rules/dcgm_compat.py);
- `--fill-test-annotations`: the rendered annotations of every expected alert into alert_rules/tests/, from what
  promtool renders (needs promtool).

tests/test_alert_rules.py and tests/test_fleet.py fail when a committed file differs from this output; the tests
that start Prometheus load the rules through these functions too.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import yaml

from gpuwarden.fleet import recording
from gpuwarden.health.rules import build
from gpuwarden.health.rules_file import alert_rules_yaml

try:
    from alert_rules import dcgm_compat
except ImportError:  # run as a script: its folder is on the path, the repository root is not
    import dcgm_compat

HERE = Path(__file__).resolve().parent
RULES_FILE = HERE / "gpuwarden.rules.yaml"
RECORDING_FILE = HERE / "gpuwarden.recording.yaml"
TESTS_FILE = HERE / "tests" / "gpuwarden.test.yaml"
DCGM_COMPAT_FILE = HERE / "dcgm-compat.recording.yaml"


TESTS_HEADER = """\
# promtool unit tests for alert_rules/gpuwarden.rules.yaml: every alert fires when it should, with its labels and
# its rendered annotations, and stays silent on near misses. Run as shipped, from the repository root:
#   promtool test rules alert_rules/tests/*.yaml
# After a change to an annotation: python alert_rules/generate.py --fill-test-annotations (needs promtool).
"""
_GOT = re.compile(
    r"name: (?P<name>.*?),\s*alertname: (?P<alert>\w+), time: (?P<time>\S+?),.*?got:\[(?P<got>.*?)\n\s*\]", re.S
)
_PAIR = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')


def _seconds(duration: str) -> int:
    units = {"d": 86400, "h": 3600, "m": 60, "s": 1}
    return sum(int(n) * units[u] for n, u in re.findall(r"(\d+)([dhms])", str(duration)))


def fill_test_annotations(promtool: str = "promtool") -> int:
    """Write each expected alert's rendered annotations into the shipped test file, from what promtool renders:
    the file then passes `promtool test rules` as shipped, wording included."""
    import json
    import subprocess

    data = yaml.safe_load(TESTS_FILE.read_text(encoding="utf-8"))
    for test in data["tests"]:  # start from none, so promtool reports every expected alert with its annotations
        for check in test["alert_rule_test"]:
            for alert in check.get("exp_alerts") or []:
                alert.pop("exp_annotations", None)
    TESTS_FILE.write_text(TESTS_HEADER + yaml.safe_dump(data, sort_keys=False, width=120), encoding="utf-8")
    result = subprocess.run([promtool, "test", "rules", str(TESTS_FILE)], capture_output=True, text=True)
    output = result.stdout + result.stderr  # promtool reports failures on stderr
    rendered: dict[tuple[str, str, int], list[tuple[dict[str, str], dict[str, str]]]] = {}
    for match in _GOT.finditer(output):
        entries = []
        for labels, rendered_text in re.findall(r"Labels:\{(.*?)\}\s*Annotations:\{(.*?)\},?\n", match["got"] + "\n"):
            parse = lambda text: {k: json.loads(f'"{v}"') for k, v in _PAIR.findall(text)}  # noqa: E731
            entries.append((parse(labels), parse(rendered_text)))
        rendered[(match["name"], match["alert"], _seconds(match["time"]))] = entries
    for test in data["tests"]:
        for check in test["alert_rule_test"]:
            for alert in check.get("exp_alerts") or []:
                wanted = {**alert["exp_labels"], "alertname": check["alertname"]}
                key = (test["name"], check["alertname"], _seconds(check["eval_time"]))
                found = [a for labels, a in rendered.get(key, []) if labels == {k: str(v) for k, v in wanted.items()}]
                if len(found) != 1:
                    raise SystemExit(f"no rendered annotations for {key} {wanted}: does the test fire as expected?")
                alert["exp_annotations"] = found[0]
    TESTS_FILE.write_text(TESTS_HEADER + yaml.safe_dump(data, sort_keys=False, width=120), encoding="utf-8")
    print(f"wrote {TESTS_FILE}")
    return 0


THRESHOLD_MAP_FILE = HERE / "threshold-alerts.yaml"


def threshold_map() -> dict[str, dict[str, list[str]]]:
    """Which alert each threshold reaches, found by moving it: `threshold` (the number the alert's expression ends
    on is the value itself), `for` (the alert's `for:` is the value in seconds), or `other` (it changes the rules in
    another way, so the chart cannot apply it to the shipped rules). A field that changes no rule is listed with
    empty lists: it tunes the exporter's verdicts alone. The Helm chart's `thresholds` value reads this map."""
    import dataclasses

    from gpuwarden.health.rules_file import TRAILING_THRESHOLD
    from gpuwarden.health.thresholds import DEFAULT, Thresholds

    def rendered(t: Thresholds) -> dict[str, tuple[str, str | None, int]]:
        out = {}
        for group in build(t):
            for rule in group.rules:
                match = TRAILING_THRESHOLD.search(rule.expr)
                body = rule.expr[: match.start()] if match else rule.expr
                out[rule.alert] = (body, match.group(2) if match else None, rule.for_s)
        return out

    base = rendered(DEFAULT)
    result: dict[str, dict[str, list[str]]] = {}
    for field in dataclasses.fields(Thresholds):
        value = getattr(DEFAULT, field.name)
        if isinstance(value, bool) or not isinstance(value, int | float):
            continue
        moved = None
        for new in (value + 1, value - 1) if isinstance(value, int) else (value * 0.99, value * 1.01):
            try:
                candidate = dataclasses.replace(DEFAULT, **{field.name: new})
                candidate.validate()
            except ValueError:
                continue
            moved = new, rendered(candidate)
            break
        if moved is None:
            raise SystemExit(f"threshold_map: {field.name} cannot be moved within its checks")
        new, after = moved
        entry: dict[str, list[str]] = {"threshold": [], "for": [], "other": []}
        for alert, (body, number, for_s) in after.items():
            old_body, old_number, old_for = base[alert]
            if body != old_body:
                entry["other"].append(alert)
            elif number != old_number:
                entry["threshold" if float(number or "nan") == new else "other"].append(alert)
            if for_s != old_for:
                entry["for" if for_s == new else "other"].append(alert)
        result[field.name] = entry
    return result


def recording_rules_yaml(
    selector: str = 'job="gpuwarden"', interval_s: int = recording.INTERVAL_S, rate_window: str = "5m"
) -> str:
    rules = recording.rules(selector, rate_window=rate_window)
    groups = [
        {"name": name, "interval": f"{interval_s}s", "rules": [r for r in rules if r["record"] in records]}
        for name, records in recording.GROUPS.items()
    ]
    placed = sum(len(group["rules"]) for group in groups)
    assert placed == len(rules), "a recording rule in no group of recording.GROUPS"
    document = {"groups": groups}
    header = (
        "# Generated by `python alert_rules/generate.py`: do not edit. Recording rules for `gpuwarden fleet`\n"
        "# (docs/fleet.md, Recording rules): load them beside gpuwarden.rules.yaml. The interval is part of the\n"
        "# contract: the fleet service integrates the recorded rates with it (--recording-interval).\n"
    )
    return header + yaml.safe_dump(document, sort_keys=False, width=120)


def main(argv: list[str]) -> int:
    if argv == ["--fill-test-annotations"]:
        return fill_test_annotations()
    if argv:
        print("usage: python alert_rules/generate.py [--fill-test-annotations]", file=sys.stderr)
        return 2
    RULES_FILE.write_text(alert_rules_yaml(build()), encoding="utf-8")
    RECORDING_FILE.write_text(recording_rules_yaml(), encoding="utf-8")
    DCGM_COMPAT_FILE.write_text(dcgm_compat.rules_yaml(), encoding="utf-8")
    header = "# Generated by `python alert_rules/generate.py` (threshold_map): do not edit. Read by the Helm chart.\n"
    THRESHOLD_MAP_FILE.write_text(header + yaml.safe_dump(threshold_map(), sort_keys=True), encoding="utf-8")
    print(f"wrote {RULES_FILE}, {RECORDING_FILE}, {DCGM_COMPAT_FILE} and {THRESHOLD_MAP_FILE}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
