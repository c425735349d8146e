"""node-problem-detector's custom-plugin config, checked as NPD checks it (NPD is not installable here): the
fields its config types define (pkg/custompluginmonitor/types/config.go), its validation (a rule's timeout not above
the global one; a permanent rule's condition declared with its healthy reason and message), and each rule's command
line parsed by gpuwarden's own npd-plugin parser."""

from __future__ import annotations

from typing import Any

NPD_PLUGIN_CONFIG_FIELDS = {
    "invoke_interval",
    "timeout",
    "max_output_length",
    "concurrency",
    "enable_message_change_based_condition_update",
    "skip_initial_status",
}
NPD_TOP_FIELDS = {"plugin", "pluginConfig", "source", "metricsReporting", "conditions", "rules"}
NPD_RULE_FIELDS = {"type", "condition", "reason", "path", "args", "timeout", "invoke_interval"}


def _seconds(duration: str) -> float:
    assert duration.endswith("s") and duration[:-1].isdigit(), duration
    return float(duration[:-1])


def check_npd_config(config: dict[str, Any]) -> set[str]:
    """Assert `config` is one NPD would load and run; returns the condition families its rules report."""
    from gpuwarden.remediation.npd import build_parser

    assert set(config) <= NPD_TOP_FIELDS and config["plugin"] == "custom"
    plugin_config = config["pluginConfig"]
    assert set(plugin_config) <= NPD_PLUGIN_CONFIG_FIELDS
    global_timeout = _seconds(plugin_config["timeout"])
    assert global_timeout <= 5 and plugin_config["max_output_length"] == 80
    declared = {c["type"]: c for c in config["conditions"]}
    assert all(set(c) == {"type", "reason", "message"} for c in config["conditions"])
    covered = set()
    for rule in config["rules"]:
        assert set(rule) <= NPD_RULE_FIELDS and rule["type"] in ("permanent", "temporary")
        assert rule["type"] == "temporary" or rule["condition"] in declared
        assert _seconds(rule.get("timeout", plugin_config["timeout"])) <= global_timeout
        assert rule["path"] == "/usr/local/bin/gpuwarden"  # where the image's pip install puts the command
        assert rule["args"][0] == "npd-plugin"
        args = build_parser().parse_args(rule["args"][1:])
        assert args.timeout < global_timeout  # the plugin gives up before NPD kills it
        covered.add(args.condition)
    return covered
