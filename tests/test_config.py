"""Configuration sources, precedence and the one-line errors (exit code 2, no traceback)."""

from __future__ import annotations

import socket
import subprocess
import sys

import pytest

from gpuwarden.config.settings import ConfigError, load_settings, options
from tests.helpers.common import free_port, sweep, write_yaml


def run_cli(*args: str, env: dict[str, str] | None = None, timeout: float = 30) -> subprocess.CompletedProcess:
    import os

    base = {k: v for k, v in os.environ.items() if not k.startswith("GPUWARDEN_")}
    return subprocess.run(
        [sys.executable, "-m", "gpuwarden", *args],
        capture_output=True,
        text=True,
        env={**base, **(env or {})},
        timeout=timeout,
    )


def test_precedence_defaults_file_env_flags(tmp_path):
    config = write_yaml(
        tmp_path / "c.yaml", {"poll": {"fast_interval": 2, "slow_interval": 30}, "log": {"level": "debug"}}
    )
    assert load_settings(None, environ={}).poll.fast_interval == 1.0
    assert load_settings(config, environ={}).poll.fast_interval == 2
    env = {"GPUWARDEN_POLL_FAST_INTERVAL": "3", "GPUWARDEN_METRICS_EXCLUDE": "a_*, b_*"}
    from_env = load_settings(config, environ=env)
    assert from_env.poll.fast_interval == 3 and from_env.poll.slow_interval == 30
    assert from_env.metrics.exclude == ("a_*", "b_*")
    from_flags = load_settings(config, environ=env, flags={"poll.fast_interval": "4"})
    assert from_flags.poll.fast_interval == 4 and from_flags.log.level == "debug"


@pytest.mark.parametrize(
    ("data", "expected"),
    [
        ({"poll": {"fast_intervl": 1}}, "unknown key 'poll.fast_intervl'; allowed here: fast_interval"),
        ({"pol": {}}, "unknown key 'pol'; allowed here: web, poll"),
        ({"poll": {"fast_interval": "soon"}}, "poll.fast_interval: Input should be a valid number"),
        ({"poll": {"fast_interval": 0.01}}, "poll.fast_interval: Input should be greater than or equal to 0.1"),
        ({"nvml": {"backend": "dcgm"}}, "nvml.backend: Input should be 'nvml' or 'sim'"),
        ({"web": {"listen_address": "10045"}}, "web.listen_address: must be HOST:PORT"),
        ({"web": {"telemetry_path": "/healthz"}}, "web.telemetry_path: must start with '/' and not clash"),
        ({"poll": {"slow_interval": 2, "fast_interval": 5}}, "poll.slow_interval must be >= poll.fast_interval"),
        ({"nvml": {"scenario": "healthy"}}, "nvml.scenario needs nvml.backend: sim"),
        (
            {"nvml": {"devices": ["0", "gpu1"]}},
            "nvml.devices: 'gpu1' is neither a GPU index (0, 1, ...) nor a GPU UUID",
        ),
        ({"nvml": {"kernel_log": "kmsg"}}, "nvml.kernel_log: 'kmsg' is neither auto, off nor an absolute path"),
        (["not", "a", "mapping"], "top level must be a mapping"),
    ],
)
def test_bad_config_is_one_line_naming_the_key(tmp_path, data, expected):
    path = write_yaml(tmp_path / "bad.yaml", data)
    with pytest.raises(ConfigError) as caught:
        load_settings(path, environ={})
    message = str(caught.value)
    assert expected in message and "\n" not in message and str(path) in message or "configuration" in message


def test_bad_yaml_syntax_names_line_and_column(tmp_path):
    path = tmp_path / "broken.yaml"
    path.write_text("poll:\n  fast_interval: [1\n")
    with pytest.raises(ConfigError, match=r"broken.yaml: .* at line \d+, column \d+; fix the YAML syntax"):
        load_settings(path, environ={})


def test_unknown_environment_variable_is_rejected():
    with pytest.raises(ConfigError, match="GPUWARDEN_POLL_FAST is not a gpuwarden setting"):
        load_settings(None, environ={"GPUWARDEN_POLL_FAST": "1"})


@pytest.mark.parametrize(
    ("args", "env", "expected"),
    [
        (["--poll.fast-interval", "0.01"], {}, "flags: poll.fast_interval: Input should be greater than or equal"),
        (["--no-such-flag"], {}, "unrecognized arguments: --no-such-flag"),
        ([], {"GPUWARDEN_LOG_LEVEL": "loud"}, "environment: log.level: Input should be"),
        (["--config", "/nonexistent.yaml"], {}, "cannot read it"),
        (["--sim", "--nvml.scenario", "no-such-scenario"], {}, "scenario 'no-such-scenario': no such file"),
        (
            ["--web.config.file", "/etc/web.yml"],
            {},
            "web config /etc/web.yml: cannot read it (No such file or directory); check the --web.config.file path",
        ),
    ],
)
def test_cli_errors_exit_2_with_one_line(args, env, expected):
    result = run_cli(*args, env=env)
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and expected in lines[0], result.stderr
    assert "Traceback" not in result.stderr


@pytest.mark.parametrize(
    ("text", "expected"),
    sweep(
        [
            (
                "name: x\nvalues: {temperature: [\n",
                "at line 3, column 1; fix the YAML syntax",
            ),  # as config files say it
            ("name: x\nvalues: {temprature: 50}\n", "unknown value 'temprature'"),
            ("name: x\nfaults: [{kind: meltdown}]\n", "faults.0.kind: Input should be"),
            ("name: x\nnode: {count: 2}\nfaults: [{kind: gpu_lost, gpu: 5}]\n", "faults.0.gpu: the node has GPUs 0-1"),
            ("name: x\nfaults: [{kind: hang}]\n", "a 'hang' fault needs 'call'"),
            ("name: x\nkernel_log: [{kind: sxid, switch: 0, sxid: 9, at: 5}]\n", "kernel_log.0.at: Input should"),
            ("name: x\nkernel_log: [{kind: xid, gpu: 1, at: -5}]\n", "a 'xid' record needs 'xid'"),
            (
                "name: x\nnode: {nvlink: none}\nkernel_log: [{kind: sxid, switch: 0, sxid: 9, at: 0}]\n",
                "an SXid needs an NVSwitch node",
            ),
            (
                "name: x\nvalues: {utilization: {square: {low: 0, high: 1, period: 0, duty: 0.5}}}\n",
                "period: Input should be greater than 0",
            ),
            (
                "name: x\nvalues: {utilization: {steps: [[10, 5], [10, 90]]}}\n",
                "steps: give [[t, value], ...] with rising times",
            ),
        ],
        lambda case: "syntax" in case[1] or "GPUs 0-1" in case[1],  # the parser's line, and a check of our own
    ),
)
def test_bad_scenario_file_exits_2_with_one_line(tmp_path, text: str, expected: str):
    path = tmp_path / "scenario.yaml"
    path.write_text(text)
    result = run_cli("--sim", "--nvml.scenario", str(path))
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2 and len(lines) == 1, result.stderr
    assert expected in lines[0] and str(path) in lines[0], lines[0]


def test_check_config(tmp_path):
    good = write_yaml(tmp_path / "good.yaml", {"nvml": {"backend": "sim", "scenario": "gpu-lost"}})
    result = run_cli("check-config", str(good))
    assert result.returncode == 0 and "ok" in result.stdout
    bad = write_yaml(tmp_path / "bad.yaml", {"web": {"listen_adress": ":1"}})
    result = run_cli("check-config", str(bad))
    assert result.returncode == 2 and "unknown key 'web.listen_adress'" in result.stderr
    assert run_cli("check-config").returncode == 2


@pytest.mark.parametrize("section, key", [("health", "thresholds_file"), ("web", "config_file")])
def test_check_config_refuses_a_config_whose_referenced_file_is_missing(tmp_path, section: str, key: str):
    """check-config says what the daemon would say at start: a named file that does not exist is one line, exit 2
    (it said ok, and the daemon then exited 2)."""
    missing = tmp_path / "absent.yaml"
    config = write_yaml(tmp_path / "config.yaml", {"nvml": {"backend": "sim"}, section: {key: str(missing)}})
    checked = run_cli("check-config", str(config))
    started = run_cli("--config", str(config))
    lines = checked.stderr.strip().splitlines()
    assert checked.returncode == 2 and len(lines) == 1 and str(missing) in lines[0], checked.stderr
    assert started.returncode == 2 and started.stderr.strip() == checked.stderr.strip()


def test_help_documents_every_option_and_version():
    result = run_cli("--help")
    assert result.returncode == 0
    for opt in options():
        assert opt.flag in result.stdout and opt.env in result.stdout
    for conventional in (
        "--web.listen-address",
        "--web.telemetry-path",
        "--web.config.file",
        "--log.level",
        "--log.format",
    ):
        assert conventional in result.stdout
    version = run_cli("--version")
    assert version.returncode == 0 and version.stdout.startswith("gpuwarden ")


def test_scenarios_subcommand_lists_shipped_scenarios():
    result = run_cli("scenarios")
    assert result.returncode == 0 and "gpu-lost" in result.stdout and "legacy-pcie" in result.stdout


def test_scenarios_into_a_closed_pipe_exits_quietly():
    """`gpuwarden scenarios | head -1`: the reader is gone before the list is written; no traceback."""
    import os

    read_end, write_end = os.pipe()
    os.close(read_end)
    try:
        done = subprocess.run(
            [sys.executable, "-m", "gpuwarden", "scenarios"], stdout=write_end, stderr=subprocess.PIPE, text=True
        )
    finally:
        os.close(write_end)
    assert done.returncode == 0 and done.stderr == ""


def test_library_missing_exits_when_configured(tmp_path):
    scenario = write_yaml(tmp_path / "missing.yaml", {"name": "missing", "faults": [{"kind": "library_missing"}]})
    result = run_cli(
        "--sim",
        "--nvml.scenario",
        str(scenario),
        "--nvml.on-missing",
        "exit",
        "--web.listen-address",
        f"127.0.0.1:{free_port()}",
    )
    assert result.returncode == 3
    assert "library_not_found" in result.stderr and "Traceback" not in result.stderr
    # it never loaded: the log says why it exits, not that a driver changed under it (issue 36)
    assert "nvml.on_missing is exit" in result.stderr and "changed under this process" not in result.stderr


def test_a_port_in_use_is_one_line_and_its_own_exit_code():
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        result = run_cli("--sim", "--web.listen-address", f"127.0.0.1:{port}")
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 4, result.stderr  # not 3, which means NVML is unusable
    assert lines == [
        f"gpuwarden: cannot listen on 127.0.0.1:{port}: address already in use; "
        "choose another --web.listen-address or stop what holds it"
    ]


def test_help_names_choices_and_never_prints_an_empty_default():
    result = run_cli("--help")
    text = " ".join(result.stdout.split())  # argparse wraps lines
    assert result.returncode == 0
    assert "Default: ." not in text and "Default: None" not in text
    assert "Log level. One of: debug, info, warn, error. Default: info." in text
    assert "One of: logfmt, json." in text and "Default: none." in text


def test_kubernetes_service_link_variables_are_ignored_with_one_line_and_others_still_fail():
    """A Service named gpuwarden makes Kubernetes inject GPUWARDEN_PORT=tcp://… and friends into every pod of the
    namespace: the exporter serves, says once what it ignored, and an unknown variable of our own still exits 2."""
    from tests.helpers.daemon import running_cli

    links = {
        "GPUWARDEN_PORT": "tcp://10.0.0.1:10045",
        "GPUWARDEN_SERVICE_HOST": "10.0.0.1",
        "GPUWARDEN_SERVICE_PORT": "10045",
        "GPUWARDEN_SERVICE_PORT_METRICS": "10045",
        "GPUWARDEN_PORT_10045_TCP": "tcp://10.0.0.1:10045",
        "GPUWARDEN_PORT_10045_TCP_ADDR": "10.0.0.1",
        "GPUWARDEN_PORT_10045_TCP_PORT": "10045",
        "GPUWARDEN_PORT_10045_TCP_PROTO": "tcp",
        "GPUWARDEN_FLEET_SERVICE_HOST": "10.0.0.2",  # the fleet Service's: not the exporter's to judge
    }
    with running_cli("--sim", env=links, ready="/readyz") as exporter:
        pass
    log = exporter.output()
    lines = [line for line in log.splitlines() if "service-link" in line]
    assert len(lines) == 1 and "GPUWARDEN_PORT_10045_TCP_ADDR" in lines[0], log
    bogus = run_cli("--sim", env={**links, "GPUWARDEN_WEB_LISTEN_ADRESS": ":1"})
    assert bogus.returncode == 2 and "GPUWARDEN_WEB_LISTEN_ADRESS is not a gpuwarden setting" in bogus.stderr


def test_the_expected_gpu_count_is_served_only_where_set():
    """nvml.expected_gpus is what GpuwardenGpuCountDropped compares with: a fact that survives restarts."""
    import httpx

    from tests.helpers.daemon import running_cli

    with running_cli("--sim", "--nvml.expected-gpus", "8") as (url, _):
        text = httpx.get(url + "/metrics", timeout=10).text
    assert "\ngpuwarden_gpus_expected 8.0\n" in text and "\ngpuwarden_gpus 8.0\n" in text
    with running_cli("--sim") as (url, _):
        assert "gpuwarden_gpus_expected" not in httpx.get(url + "/metrics", timeout=10).text


def test_the_fleet_service_ignores_its_own_service_link_variables_with_one_line():
    from tests.helpers.daemon import running_cli

    links = {"GPUWARDEN_FLEET_PORT": "tcp://10.0.0.2:10046", "GPUWARDEN_FLEET_SERVICE_HOST": "10.0.0.2"}
    with running_cli("fleet", "--prometheus-url", "http://127.0.0.1:9", env=links) as fleet:
        pass
    lines = [line for line in fleet.output().splitlines() if "service-link" in line]
    assert len(lines) == 1 and "GPUWARDEN_FLEET_SERVICE_HOST" in lines[0], lines


def test_a_settings_field_of_several_types_is_refused_where_it_is_declared():
    """`int | str` from an environment string would be a guess: the model is refused, not the input; one type or
    None is fine."""
    import dataclasses

    from gpuwarden.config.typed import build

    @dataclasses.dataclass(frozen=True)
    class Ambiguous:
        size: int | str = 1

    @dataclasses.dataclass(frozen=True)
    class Optional:
        size: int | None = None

    with pytest.raises(TypeError, match="Ambiguous.size: a setting is one type or None"):
        build(Ambiguous, {})
    assert build(Optional, {"size": "3"}).size == 3 and build(Optional, {}).size is None


def test_the_simulator_listens_on_loopback_unless_an_address_is_given(tmp_path, monkeypatch):
    """A simulated node on a laptop is for that machine: it listened on every interface (issue 36). Any source that
    names an address (flag, environment, config file) still wins; a real node keeps :10045."""
    from gpuwarden.cli.main import settings_from_argv

    monkeypatch.delenv("GPUWARDEN_WEB_LISTEN_ADDRESS", raising=False)
    assert settings_from_argv(["--sim"]).web.listen_address == "127.0.0.1:10045"
    assert settings_from_argv([]).web.listen_address == ":10045"
    assert settings_from_argv(["--sim", "--web.listen-address", ":10045"]).web.listen_address == ":10045"
    config = write_yaml(tmp_path / "c.yaml", {"web": {"listen_address": "0.0.0.0:9100"}})
    assert settings_from_argv(["--sim", "--config", str(config)]).web.listen_address == "0.0.0.0:9100"
    monkeypatch.setenv("GPUWARDEN_WEB_LISTEN_ADDRESS", ":9200")
    assert settings_from_argv(["--sim"]).web.listen_address == ":9200"
