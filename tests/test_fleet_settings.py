"""`gpuwarden fleet`'s settings on config/typed.py: flags over environment over defaults, and every bad flag or
variable one line naming the flag or variable that set it and what is allowed, exit 2 from the command line."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from gpuwarden.commandline import ConfigError
from gpuwarden.fleet.settings import FleetSettings, environment_names, parse

URL = ["--prometheus-url", "http://prom:9090"]


@pytest.mark.parametrize(
    ("argv", "environ", "expected"),
    [
        (
            [],
            {},
            "--prometheus-url is required (or GPUWARDEN_FLEET_PROMETHEUS_URL), e.g. --prometheus-url "
            "http://prometheus:9090",
        ),
        (["--prometheus-url", "prom:9090"], {}, "--prometheus-url: must be an http(s) URL"),
        ([*URL, "--query-timeout", "0"], {}, "--query-timeout: Input should be greater than 0 (got '0')"),
        ([*URL, "--query-timeout", "soon"], {}, "--query-timeout: Input should be a valid number (got 'soon')"),
        ([*URL, "--idle-ratio", "1"], {}, "--idle-ratio: Input should be less than 1 (got '1')"),
        # an integer bound as the integer it is, not 1.07374e+09
        (
            [*URL, "--max-answer-bytes", str(2 * 1024**3)],
            {},
            "--max-answer-bytes: Input should be less than or equal to 1073741824",
        ),
        ([*URL, "--max-answer-series", "5e4"], {}, "--max-answer-series: Input should be a valid integer"),
        ([*URL, "--recording-rules", "on"], {}, "--recording-rules: Input should be 'auto' or 'off' (got 'on')"),
        ([*URL, "--currency", "DOLLARS!!"], {}, "--currency: must be 1 to 8 characters"),
        ([*URL, "--max-window", "1w"], {}, "--max-window: must be a duration like 30m, 6h or 7d (got '1w')"),
        ([*URL, "--node-label", "node-name"], {}, "--node-label: must be a Prometheus label name"),
        ([*URL, "--selector", '{job="gpuwarden"}'], {}, "--selector: must be label matchers without braces"),
        ([*URL, "--web.listen-address", "10046"], {}, "--web.listen-address: must be HOST:PORT"),
        # a bad value from the environment is named by its variable, not by a flag nobody passed
        (URL, {"GPUWARDEN_FLEET_CACHE_TTL": "-1"}, "GPUWARDEN_FLEET_CACHE_TTL: Input should be greater than or equal"),
        (URL, {"GPUWARDEN_FLEET_LISTEN_ADDRESS": "any"}, "GPUWARDEN_FLEET_LISTEN_ADDRESS: must be HOST:PORT"),
        (URL, {"GPUWARDEN_FLEET_WEB_CONFIG_FILE": ""}, "GPUWARDEN_FLEET_WEB_CONFIG_FILE: Input should be a valid path"),
        (
            URL,
            {"GPUWARDEN_FLEET_QUERY_TIMOUT": "3"},
            "environment: GPUWARDEN_FLEET_QUERY_TIMOUT is not a gpuwarden fleet setting; known: ",
        ),
        ([*URL, "--query-timout", "3"], {}, "unrecognized arguments: --query-timout 3"),
    ],
)
def test_bad_input_is_one_line_naming_where_it_came_from(argv: list[str], environ: dict[str, str], expected: str):
    with pytest.raises(ConfigError) as caught:
        parse(argv, environ)
    line = str(caught.value)
    assert line.startswith(expected) and "\n" not in line, line


def test_flags_over_environment_over_defaults_converted_to_their_types():
    environ = {
        "GPUWARDEN_FLEET_PROMETHEUS_URL": "https://thanos:10902/",
        "GPUWARDEN_FLEET_QUERY_TIMEOUT": "not a number",  # overridden by the flag: never checked
        "GPUWARDEN_FLEET_MAX_ANSWER_SERIES": "2000",
        "GPUWARDEN_FLEET_WEB_CONFIG_FILE": "/etc/gpuwarden/web.yml",
        "GPUWARDEN_FLEET_PORT": "tcp://10.0.0.2:10046",  # Kubernetes' service link: not ours, not an error
    }
    settings = parse(["--query-timeout", "2.5", "--recording-rules", "off"], environ)
    assert settings.prometheus_url == "https://thanos:10902"  # the trailing slash dropped
    assert settings.query_timeout == 2.5 and settings.max_answer_series == 2000
    assert settings.recording_rules == "off" and settings.web_config_file == Path("/etc/gpuwarden/web.yml")
    assert settings.currency == "USD" and settings.listen_address == ":10046"  # defaults
    assert (settings.host, settings.port) == ("0.0.0.0", 10046)
    assert isinstance(settings, FleetSettings)
    assert set(environment_names()) >= {"GPUWARDEN_FLEET_PROMETHEUS_URL", "GPUWARDEN_FLEET_LISTEN_ADDRESS"}


def fleet_cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    base = {k: v for k, v in os.environ.items() if not k.startswith("GPUWARDEN_")}
    return subprocess.run(
        [sys.executable, "-m", "gpuwarden", "fleet", *args],
        capture_output=True,
        text=True,
        env={**base, **(env or {})},
        timeout=60,
    )


@pytest.mark.parametrize(
    ("args", "env", "expected"),
    [
        (
            [*URL, "--max-concurrent-queries", "0"],
            {},
            "gpuwarden fleet: --max-concurrent-queries: Input should be greater than or equal to 1 (got '0')",
        ),
        (
            URL,
            {"GPUWARDEN_FLEET_STALE_AFTER": "0"},
            "gpuwarden fleet: GPUWARDEN_FLEET_STALE_AFTER: Input should be greater than 0 (got '0')",
        ),
    ],
)
def test_the_command_exits_2_with_the_one_line(args: list[str], env: dict[str, str], expected: str):
    result = fleet_cli(*args, env=env)
    assert result.returncode == 2, result.stderr
    assert result.stderr.strip() == expected and result.stdout == ""


def test_help_lists_each_flag_with_its_default_and_variable():
    result = fleet_cli("--help")
    assert result.returncode == 0, result.stderr
    text = " ".join(result.stdout.split())
    assert "--recording-rules RECORDING_RULES" in text and "One of: auto, off. Default: auto." in text
    for variable in environment_names():
        assert f"Env: {variable}." in text, variable
