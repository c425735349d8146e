"""The Helm chart, rendered by the real Helm engine (helm-sdkpy's bundled Helm library, see deploy/helm/render.py),
validated against the Kubernetes OpenAPI schemas, and held to the deployment policy.

What is stood in for: the Kubernetes API server (render.py's loopback stand-in answers discovery and records what
Helm creates; no cluster runs here). Helm needs Python >= 3.12, so it runs in its own venv (.venv-helm, made by the
README's test command); the prometheus-operator kinds have no schemas in kubernetes-validate and get structural
checks, and the PrometheusRule is checked by promtool.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from functools import cache
from pathlib import Path
from typing import Any

import pytest
import yaml

pytestmark = pytest.mark.slow  # end-to-end: real servers, Prometheus or Helm

ROOT = Path(__file__).resolve().parents[1]
CHART = ROOT / "deploy" / "helm" / "gpuwarden"
RENDER = ROOT / "deploy" / "helm" / "render.py"
KUBERNETES_VERSION = "1.34"


def helm_python() -> str:
    configured = os.environ.get("GPUWARDEN_HELM_PYTHON") or str(ROOT / ".venv-helm" / "bin" / "python")
    if not Path(configured).exists():
        message = (
            f"no Python with helm-sdkpy at {configured}: run the README's test command (it makes "
            ".venv-helm with Python 3.12) or set GPUWARDEN_HELM_PYTHON"
        )
        if os.environ.get("CI"):
            pytest.fail(message)
        pytest.skip(message)
    return configured


def run_render(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([helm_python(), str(RENDER), *args], capture_output=True, text=True, timeout=120, cwd=ROOT)


@cache
def _render_cached(values_json: str, monitoring_api: bool) -> tuple[dict[str, Any], ...]:
    args = ["template", "--values-json", values_json]
    if not monitoring_api:
        args.append("--no-monitoring-api")
    result = run_render(*args)
    assert result.returncode == 0, result.stderr
    return tuple(doc for doc in yaml.safe_load_all(result.stdout) if doc)


def render(values: dict[str, Any] | None = None, monitoring_api: bool = True) -> list[dict[str, Any]]:
    return list(_render_cached(json.dumps(values or {}, sort_keys=True), monitoring_api))


def one(objects: list[dict[str, Any]], kind: str) -> dict[str, Any]:
    found = [o for o in objects if o["kind"] == kind]
    assert len(found) == 1, f"expected one {kind}, got {len(found)}"
    return found[0]


def kinds(objects: list[dict[str, Any]]) -> list[str]:
    return sorted(o["kind"] for o in objects)


def container(objects: list[dict[str, Any]], name: str = "gpuwarden") -> dict[str, Any]:
    (found,) = [c for c in one(objects, "DaemonSet")["spec"]["template"]["spec"]["containers"] if c["name"] == name]
    return found


FLEET_PASSWORD = "fleet-password"
FLEET_HASH = "$2b$04$o.BvFAQHUp0wJW549VjTVeYX5cV2zlyp8nox2sKKcJXqb7c2SDkIq"  # bcrypt of FLEET_PASSWORD, cost 4
# the exporter serving TLS from a Secret's certificate
TLS = {
    "enabled": True,
    "tls": True,
    "tlsSecret": "gpuwarden-tls",
    "config": {
        "tls_server_config": {"cert_file": "/etc/gpuwarden/tls/tls.crt", "key_file": "/etc/gpuwarden/tls/tls.key"}
    },
}
VARIANTS = {
    "defaults": {},
    "pod-attribution": {
        "podResources": {"enabled": True},
        "runtimeClassName": "nvidia",
        "priorityClassName": "system-node-critical",
    },
    "process-attribution": {
        "processes": {"hostProc": True, "perPidSeries": True, "maxPidSeries": 8},
    },
    "job-view-pod-api": {"jobs": {"podApi": {"enabled": True}}},
    "no-host-proc": {"processes": {"hostProc": False}},
    "tls-and-basic-auth": {
        "webConfig": {
            **TLS,
            "config": {
                **TLS["config"],
                "basic_auth_users": {"prometheus": "$2b$12$hNf2lSsxfm0.i4a.1kVpSOVyBCfIB51VRjgBUyv6kdnyTlgWj81Ay"},
            },
        },
        "serviceMonitor": {
            "basicAuth": {
                "username": {"name": "scrape-auth", "key": "user"},
                "password": {"name": "scrape-auth", "key": "password"},
            },
            "tlsConfig": {"insecureSkipVerify": True},
        },
    },
    "podmonitor": {"podMonitor": {"enabled": True}, "service": {"enabled": False}},
    "fleet": {
        "fleet": {
            "enabled": True,
            "prometheusURL": "http://prometheus-operated.monitoring:9090",
            "pricePerGpuHour": 3.2,
        }
    },
    "fleet-with-tls-basic-auth-and-policy": {
        "fleet": {
            "enabled": True,
            "prometheusURL": "http://prometheus-operated.monitoring:9090",
            "webConfig": {**TLS, "config": {**TLS["config"], "basic_auth_users": {"sre": FLEET_HASH}}},
        },
        "networkPolicy": {"fleet": {"from": [{"namespaceSelector": {"matchLabels": {"team": "sre"}}}]}},
    },
    "npd": {"npd": {"enabled": True}},
    "npd-with-tls-and-basic-auth": {
        "npd": {"enabled": True, "debounce": 3, "pluginArgs": ["--auth.username=npd"]},
        "webConfig": TLS,
    },
    "nothing-optional": {
        "serviceMonitor": {"enabled": False},
        "prometheusRule": {"enabled": False},
        "dashboards": {"enabled": False},
        "serviceAccount": {"create": False},
        "kernelLog": {"enabled": False},
        "processes": {"hostProc": False},
        "networkPolicy": {"enabled": False},
    },
}
RELAY = "kernel-log-relay"


# -- schemas --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_every_core_object_validates_against_the_kubernetes_schemas(variant: str) -> None:
    """Against the version the stand-in API reports, an older supported one and the newest schemas bundled."""
    import kubernetes_validate

    objects = render(VARIANTS[variant])
    checked = 0
    for version in ("1.30", KUBERNETES_VERSION, kubernetes_validate.latest_version()):
        for obj in objects:
            if obj["apiVersion"].startswith("monitoring.coreos.com/"):
                continue
            kubernetes_validate.validate(obj, version, strict=True)  # raises with the path on failure
            checked += 1
    assert checked >= 6


def validate_crd_objects(objects: list[dict[str, Any]], tmp_path: Path) -> subprocess.CompletedProcess[str]:
    """prometheus-operator objects against the CRD schemas (npm @kubernetes-models/prometheus-operator, in
    .npm-crds, run by Node.js: the README's test command installs both)."""
    folder = ROOT / ".npm-crds"
    node = shutil.which("node")
    if node is None or not (folder / "node_modules" / "@kubernetes-models" / "prometheus-operator").is_dir():
        message = "no Node.js or no .npm-crds: run the README's test command"
        if os.environ.get("CI"):
            pytest.fail(message)
        pytest.skip(message)
    data = tmp_path / "objects.json"
    data.write_text(json.dumps(objects))
    # ESM resolves packages from the script's folder: run a copy placed inside the install folder, replaced whole
    # (write_text truncates first: node on another xdist worker then ran an empty script, status 0 and no output)
    runnable = folder / "crd_validate.mjs"
    partial = folder / f"crd_validate.{os.getpid()}.partial"
    partial.write_text((ROOT / "tests" / "crd_validate.mjs").read_text())
    partial.replace(runnable)
    return subprocess.run([node, str(runnable), str(data)], capture_output=True, text=True, timeout=60)


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_operator_objects_validate_against_the_crd_schemas(variant: str, tmp_path: Path) -> None:
    objects = [o for o in render(VARIANTS[variant]) if o["apiVersion"].startswith("monitoring.coreos.com/")]
    if not objects:
        return
    result = validate_crd_objects(objects, tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.count("ok ") == len(objects)


def test_the_crd_check_catches_a_broken_object(tmp_path: Path) -> None:
    rule = json.loads(json.dumps(one(render(), "PrometheusRule")))
    rule["spec"]["groups"][0]["rules"][0]["for"] = "5 minutes"
    monitor = json.loads(json.dumps(one(render(), "ServiceMonitor")))
    monitor["spec"]["endpoints"][0]["scheme"] = "gopher"
    result = validate_crd_objects([rule, monitor], tmp_path)
    assert result.returncode == 1
    assert "invalid PrometheusRule" in result.stdout and "invalid ServiceMonitor" in result.stdout


def test_a_broken_object_is_caught_by_the_schema_check() -> None:
    import kubernetes_validate

    daemonset = json.loads(json.dumps(one(render(), "DaemonSet")))
    daemonset["spec"]["template"]["spec"]["containers"][0]["securityContext"]["runAsNonroot"] = True  # typo
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(daemonset, KUBERNETES_VERSION, strict=True)


def test_helm_lint_reports_no_warnings_or_errors() -> None:
    result = run_render("lint")
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert report["TotalChartsLinted"] == 1 and not report["Errors"]
    assert all(message["Severity"] < 2 for message in report["Messages"]), report  # 1 = info


def test_bad_values_are_refused_naming_the_field() -> None:
    result = run_render("template", "--values-json", json.dumps({"podResources": {"enabeld": True}}))
    assert result.returncode == 1
    assert "enabeld" in result.stderr and "Traceback" not in result.stderr
    result = run_render("template", "--values-json", json.dumps({"port": "10045"}))
    assert result.returncode == 1 and "/port" in result.stderr


# -- policy ---------------------------------------------------------------------------------------------------


def test_default_install_objects() -> None:
    assert kinds(render()) == [
        "ConfigMap",
        "ConfigMap",
        "ConfigMap",
        "DaemonSet",
        "NetworkPolicy",
        "PrometheusRule",
        "Service",
        "ServiceAccount",
        "ServiceMonitor",
    ]


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_security_settings(variant: str) -> None:
    objects = render(VARIANTS[variant])
    pod = one(objects, "DaemonSet")["spec"]["template"]["spec"]
    ctr = container(objects)
    kernel_log = VARIANTS[variant].get("kernelLog", {}).get("enabled", True)
    for other in pod["containers"]:  # NPD's sidecar too: no privilege, no capability, a read-only root
        if other["name"] == RELAY:
            continue  # the one privileged container: below
        assert other["securityContext"]["allowPrivilegeEscalation"] is False
        assert (
            other["securityContext"]["capabilities"] == {"drop": ["ALL"]} and not other["securityContext"]["privileged"]
        )
    relays = [c for c in pod["containers"] if c["name"] == RELAY]
    if kernel_log:
        # privileged for the device and CAP_SYSLOG, and nothing else: no port, a read-only root, /dev/kmsg read-only,
        # the pipe its one writable mount; the exporter reads the pipe from a read-only mount
        (relay,) = relays
        assert relay["securityContext"]["privileged"] is True and relay["securityContext"]["readOnlyRootFilesystem"]
        assert "ports" not in relay and relay["args"][0] == "kernel-log-relay"
        mounts = {m["name"]: m for m in relay["volumeMounts"]}
        assert set(mounts) == {"kmsg", "kernel-log"} and mounts["kmsg"]["readOnly"] is True
        volumes = {v["name"]: v for v in pod["volumes"]}
        assert volumes["kmsg"]["hostPath"] == {"path": "/dev/kmsg", "type": "CharDevice"}
        assert volumes["kernel-log"]["emptyDir"]["medium"] == "Memory"
        assert "--nvml.kernel-log=/run/gpuwarden/kmsg/kmsg.fifo" in ctr["args"]
        assert next(m for m in ctr["volumeMounts"] if m["name"] == "kernel-log")["readOnly"] is True
    else:
        assert not relays and "--nvml.kernel-log=off" in ctr["args"]
    assert pod["hostPID"] is False and pod["hostIPC"] is False and pod["hostNetwork"] is False
    assert pod["automountServiceAccountToken"] is False
    assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    security = ctr["securityContext"]
    assert security["allowPrivilegeEscalation"] is False
    assert security["readOnlyRootFilesystem"] is True
    assert security["privileged"] is False
    assert security["capabilities"] == {"drop": ["ALL"]}
    assert "add" not in security["capabilities"]
    if VARIANTS[variant].get("podResources", {}).get("enabled"):
        # the kubelet socket is root-only: UID 0, but still no capabilities and a read-only mount
        assert pod["securityContext"]["runAsUser"] == 0 and pod["securityContext"]["runAsNonRoot"] is False
        mount = next(m for m in ctr["volumeMounts"] if m["name"] == "pod-resources")
        assert mount["readOnly"] is True
        assert "--pods.attribution" in ctr["args"]
    else:
        assert pod["securityContext"]["runAsNonRoot"] is True and pod["securityContext"]["runAsUser"] != 0
        host_paths = {v["name"] for v in pod["volumes"] if "hostPath" in v}
        # the host's /proc and pod logs only when asked for, read-only, still non-root and without hostPID
        # the job view's (processes.hostProc, on by default)
        expected = {"host-proc", "pod-logs"} if VARIANTS[variant].get("processes", {}).get("hostProc", True) else set()
        # the state file's directory, the exporter's one writable host path (test below)
        expected |= {"state"}
        if VARIANTS[variant].get("npd"):
            expected |= {"npd-state"}  # NPD's debounce counts on the host's tmpfs (/run), written by NPD alone
        if kernel_log:
            expected |= {"kmsg"}  # the relay's alone (above)
        assert host_paths == expected
        assert all(m["readOnly"] is True for m in ctr["volumeMounts"] if m["name"] in host_paths - {"state"})
        assert "--no-pods.attribution" in ctr["args"]
    # no GPU is requested: the exporter must not take GPUs away from the scheduler
    for section in ("requests", "limits"):
        assert not any(k.startswith("nvidia.com/") for k in ctr["resources"].get(section, {}))


def test_the_state_file_lives_on_a_host_path_the_exporter_owns_or_in_an_emptydir() -> None:
    """Issue 48: a replaced pod must not forget what pages or drains. The state file's host directory is mounted
    writable at the path the exporter is told; where the exporter runs as non-root, an init container with CAP_CHOWN
    alone makes the kubelet's root-owned directory the exporter's (its user and group, as the values set them); as
    root (pod attribution) there is none; with no host path (the plain manifests) an emptyDir."""

    def parts(values: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any], list[dict[str, Any]]]:
        objects = render(values)
        pod = one(objects, "DaemonSet")["spec"]["template"]["spec"]
        volume = next(v for v in pod["volumes"] if v["name"] == "state")
        owners = [c for c in pod.get("initContainers", []) if c["name"] == "state-owner"]
        return container(objects), volume, owners

    ctr, volume, (owner,) = parts({})
    assert "--health.state-file=/var/lib/gpuwarden/state.json" in ctr["args"]
    mount = next(m for m in ctr["volumeMounts"] if m["name"] == "state")
    assert mount["mountPath"] == "/var/lib/gpuwarden" and not mount.get("readOnly")
    assert volume["hostPath"] == {"path": "/var/lib/gpuwarden", "type": "DirectoryOrCreate"}
    assert owner["command"] == ["chown", "10045:10045", "/var/lib/gpuwarden"]
    security = owner["securityContext"]
    assert security["capabilities"] == {"drop": ["ALL"], "add": ["CHOWN"]} and security["runAsUser"] == 0
    assert security["allowPrivilegeEscalation"] is False and security["readOnlyRootFilesystem"] is True
    assert [m["name"] for m in owner["volumeMounts"]] == ["state"]
    _, _, (owner,) = parts({"podSecurityContext": {"runAsUser": 2000}, "securityContext": {"runAsGroup": 3000}})
    assert owner["command"][1] == "2000:3000"
    _, volume, owners = parts({"podResources": {"enabled": True}})  # root already: nothing to chown
    assert volume["hostPath"]["path"] == "/var/lib/gpuwarden" and owners == []
    _, volume, owners = parts({"state": {"hostPath": "/srv/gpuwarden"}})
    assert volume["hostPath"]["path"] == "/srv/gpuwarden" and owners
    ctr, volume, owners = parts({"state": {"hostPath": ""}})
    assert volume == {"name": "state", "emptyDir": {"sizeLimit": "1Mi"}} and owners == []
    assert "--health.state-file=/var/lib/gpuwarden/state.json" in ctr["args"]
    result = run_render("template", "--values-json", json.dumps({"state": {"hostPath": "var/lib"}}))
    assert result.returncode != 0 and "hostPath" in result.stderr


def test_a_namespace_that_refuses_privileged_containers_fails_the_install_in_one_line() -> None:
    """The relay is privileged, the host's /proc a hostPath: a namespace enforcing Pod Security baseline or
    restricted would let the DaemonSet make no pod at all, silently. The install fails instead, naming the ways out;
    with both off, or in a privileged namespace, it installs."""
    for level in ("baseline", "restricted"):
        labels = json.dumps({"pod-security.kubernetes.io/enforce": level})
        result = run_render("template", "--values-json", "{}", "--namespace-labels", labels)
        assert result.returncode == 1 and f"enforces Pod Security {level}" in result.stderr, result.stderr
        assert "kernelLog.enabled=false" in result.stderr and len(result.stderr.strip().splitlines()) == 1
        no_relay = json.dumps({"kernelLog": {"enabled": False}})
        result = run_render("template", "--values-json", no_relay, "--namespace-labels", labels)
        assert result.returncode == 1 and "processes.hostProc=false" in result.stderr, result.stderr
        off_values = json.dumps(PLAIN_VALUES)
        off = run_render("template", "--values-json", off_values, "--namespace-labels", labels)
        assert off.returncode == 0 and f"name: {RELAY}" not in off.stdout  # (the dashboards name it in a description)
    privileged = json.dumps({"pod-security.kubernetes.io/enforce": "privileged"})
    assert f"name: {RELAY}" in run_render("template", "--values-json", "{}", "--namespace-labels", privileged).stdout


def test_scheduling_probes_resources_and_rollout() -> None:
    objects = render()
    daemonset = one(objects, "DaemonSet")
    pod = daemonset["spec"]["template"]["spec"]
    ctr = pod["containers"][0]
    assert pod["nodeSelector"] == {"nvidia.com/gpu.present": "true"}
    assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in pod["tolerations"]
    assert "runtimeClassName" not in pod
    assert daemonset["spec"]["updateStrategy"]["type"] == "RollingUpdate"
    assert ctr["livenessProbe"]["httpGet"]["path"] == "/healthz"
    assert ctr["readinessProbe"]["httpGet"]["path"] == "/readyz"
    assert ctr["startupProbe"]["httpGet"]["path"] == "/healthz"
    # the probes have a listener of their own (plain HTTP whatever the main port serves), named by the args
    ports = {port["name"]: port["containerPort"] for port in ctr["ports"]}
    assert f"--web.probe-listen-address=:{ports['probes']}" in ctr["args"]
    for probe in ("livenessProbe", "readinessProbe", "startupProbe"):
        assert ctr[probe]["httpGet"]["port"] == "probes" and ctr[probe]["httpGet"]["scheme"] == "HTTP"
    clash = run_render("template", "--values-json", json.dumps({"probePort": 10045}))
    assert clash.returncode != 0 and "probePort must differ from port" in clash.stderr
    without = container(render({"probePort": 0}))
    assert not any(a.startswith("--web.probe-listen-address") for a in without["args"])
    assert [p["name"] for p in without["ports"]] == ["metrics"] and without["livenessProbe"]["httpGet"][
        "port"
    ] == "metrics"
    assert {"name": "NVIDIA_DRIVER_CAPABILITIES", "value": "utility"} in ctr["env"]

    # sized from the measured pod (PSS 92 MiB with the JSON API on 1x H200, 99 MiB on 2x): the request covers it, the
    # limit leaves headroom
    def mib(quantity: str) -> int:
        assert quantity.endswith("Mi")
        return int(quantity[:-2])

    assert 99 < mib(ctr["resources"]["requests"]["memory"]) <= mib(ctr["resources"]["limits"]["memory"])
    assert "cpu" not in ctr["resources"].get("limits", {})
    values_text = (CHART / "values.yaml").read_text()
    assert "92 MiB" in values_text and "docs/validation/2026-11-28-h200-pod-memory" in values_text  # its source


def test_variants_switch_what_they_say() -> None:
    on = render(VARIANTS["pod-attribution"])
    pod = one(on, "DaemonSet")["spec"]["template"]["spec"]
    assert pod["runtimeClassName"] == "nvidia" and pod["priorityClassName"] == "system-node-critical"
    volume = next(v for v in pod["volumes"] if v["name"] == "pod-resources")
    assert volume["hostPath"] == {"path": "/var/lib/kubelet/pod-resources", "type": "Directory"}

    tls = render(VARIANTS["tls-and-basic-auth"])
    ctr = container(tls)
    assert all(ctr[p]["httpGet"]["scheme"] == "HTTP" for p in ("livenessProbe", "readinessProbe"))  # probe port
    main_port_probes = container(render({**VARIANTS["tls-and-basic-auth"], "probePort": 0}))
    assert all(main_port_probes[p]["httpGet"]["scheme"] == "HTTPS" for p in ("livenessProbe", "readinessProbe"))
    assert "--web.config.file=/etc/gpuwarden/web/web-config.yml" in ctr["args"]
    secret = one(tls, "Secret")
    assert (
        yaml.safe_load(secret["stringData"]["web-config.yml"]) == VARIANTS["tls-and-basic-auth"]["webConfig"]["config"]
    )
    endpoint = one(tls, "ServiceMonitor")["spec"]["endpoints"][0]
    assert endpoint["scheme"] == "https" and endpoint["basicAuth"]["username"]["name"] == "scrape-auth"

    podmonitor = render(VARIANTS["podmonitor"])
    assert "ServiceMonitor" not in kinds(podmonitor) and "Service" not in kinds(podmonitor)
    endpoint = one(podmonitor, "PodMonitor")["spec"]["podMetricsEndpoints"][0]
    assert endpoint["port"] == "metrics"

    processes = container(render(VARIANTS["process-attribution"]))
    assert "--processes.proc-root=/host/proc" in processes["args"]
    assert "--processes.max-pid-series=8" in processes["args"]
    defaults = container(render())["args"]  # the job view on by default: the host's /proc, no per-PID series
    assert "--processes.proc-root=/host/proc" in defaults and "--processes.per-pid-series" not in defaults
    assert not any(a.startswith("--processes.") for a in container(render(VARIANTS["no-host-proc"]))["args"])
    assert not any(a.startswith("--pods.api") for a in defaults)

    bare = render(VARIANTS["nothing-optional"])
    assert kinds(bare) == ["ConfigMap", "DaemonSet", "Service"]
    assert one(bare, "DaemonSet")["spec"]["template"]["spec"]["serviceAccountName"] == "default"

    extra = render({"extraArgs": ["--metrics.exclude=gpuwarden_nvlink_errors_total"]})
    assert "--metrics.exclude=gpuwarden_nvlink_errors_total" in container(extra)["args"]


def test_fleet_deployment() -> None:
    from gpuwarden.fleet.settings import parse

    objects = render(VARIANTS["fleet"])
    (deployment,) = (o for o in objects if o["kind"] == "Deployment")
    pod = deployment["spec"]["template"]["spec"]
    ctr = pod["containers"][0]
    assert pod["securityContext"]["runAsNonRoot"] is True and pod["automountServiceAccountToken"] is False
    assert ctr["securityContext"]["readOnlyRootFilesystem"] is True
    assert ctr["securityContext"]["capabilities"] == {"drop": ["ALL"]}
    assert ctr["args"][0] == "fleet"
    settings = parse(ctr["args"][1:], environ={})  # gpuwarden's own parser accepts the flags
    assert settings.prometheus_url == "http://prometheus-operated.monitoring:9090"
    assert settings.node_label == "node" and settings.price_per_gpu_hour == 3.2
    assert settings.selector == 'job="gpuwarden"'
    assert ctr["readinessProbe"]["httpGet"]["path"] == "/readyz"
    # selectors never mix the exporter's pods and the fleet's
    fleet_service = next(o for o in objects if o["kind"] == "Service" and o["metadata"]["name"].endswith("-fleet"))
    exporter_service = next(o for o in objects if o["kind"] == "Service" and o is not fleet_service)
    daemonset = one(objects, "DaemonSet")
    fleet_pod_labels = deployment["spec"]["template"]["metadata"]["labels"].items()
    exporter_pod_labels = daemonset["spec"]["template"]["metadata"]["labels"].items()
    assert not set(exporter_service["spec"]["selector"].items()) <= set(fleet_pod_labels)
    assert not set(daemonset["spec"]["selector"]["matchLabels"].items()) <= set(fleet_pod_labels)
    assert set(fleet_service["spec"]["selector"].items()) <= set(fleet_pod_labels)
    assert not set(deployment["spec"]["selector"]["matchLabels"].items()) <= set(exporter_pod_labels)
    missing = run_render("template", "--values-json", json.dumps({"fleet": {"enabled": True}}))
    assert missing.returncode == 1 and "fleet.prometheusURL is required" in missing.stderr


def test_without_the_operator_crds_no_monitoring_objects_are_rendered() -> None:
    objects = render(monitoring_api=False)
    assert not any(o["apiVersion"].startswith("monitoring.coreos.com/") for o in objects)
    assert "DaemonSet" in kinds(objects)


def test_the_exporter_accepts_the_rendered_config_and_args(tmp_path: Path) -> None:
    """The ConfigMap's file and the container's flags go through gpuwarden's own parser."""
    from gpuwarden.cli.main import settings_from_argv

    for variant in VARIANTS.values():
        objects = render(variant)
        config_map = next(o for o in objects if o["kind"] == "ConfigMap" and "gpuwarden.yaml" in o["data"])
        config_file = tmp_path / "gpuwarden.yaml"
        config_file.write_text(config_map["data"]["gpuwarden.yaml"])
        args = [
            a.replace("/etc/gpuwarden/config/gpuwarden.yaml", str(config_file))
            for a in container(objects)["args"]
            if not a.startswith("--web.config.file")
        ]
        settings = settings_from_argv(args)
        assert settings.web.port == 10045 and settings.web.probe_port == 10047
        assert settings.log.format == "json"
        assert settings.pods.attribution is bool(variant.get("podResources", {}).get("enabled"))
        hosted = variant.get("processes", {}).get("hostProc", True)  # the job view is on by default
        assert (settings.processes.proc_root == Path("/host/proc")) is hosted
        pod_api = variant.get("jobs", {}).get("podApi", {}).get("enabled", False)
        assert (settings.pods.api_server == "in-cluster") is pod_api
        if pod_api:  # the token and CA the projected volume mounts, and nothing more than `get` on pods
            mounts = {m["mountPath"] for m in container(objects)["volumeMounts"]}
            assert settings.pods.api_token_file.parent.as_posix() in mounts
            (role,) = [
                o for o in objects if o["kind"] == "ClusterRole" and o["metadata"]["name"].endswith("pod-reader")
            ]
            assert role["rules"] == [{"apiGroups": [""], "resources": ["pods"], "verbs": ["get"]}]


def test_scrape_objects_select_the_pods_and_label_the_node() -> None:
    objects = render()
    service = one(objects, "Service")
    pod_labels = one(objects, "DaemonSet")["spec"]["template"]["metadata"]["labels"]
    assert set(service["spec"]["selector"].items()) <= set(pod_labels.items())
    assert service["spec"]["ports"][0]["targetPort"] == container(objects)["ports"][0]["name"] == "metrics"
    # a pod failing /readyz (its node's driver down) stays an endpoint, so Prometheus scrapes its nvml_up 0 and
    # GpuwardenNvmlDown can fire: the endpoints controller drops not-ready pods otherwise
    assert container(objects)["readinessProbe"]["httpGet"]["path"] == "/readyz"
    assert service["spec"]["publishNotReadyAddresses"] is True
    monitor = one(objects, "ServiceMonitor")
    assert set(monitor["spec"]["selector"]["matchLabels"].items()) <= set(service["metadata"]["labels"].items())
    endpoint = monitor["spec"]["endpoints"][0]
    assert endpoint["port"] == service["spec"]["ports"][0]["name"]
    assert {
        "sourceLabels": ["__meta_kubernetes_pod_node_name"],
        "targetLabel": "node",
        "action": "replace",
    } in endpoint["relabelings"]


@pytest.mark.parametrize("release", ["gpuwarden", "gpu-mon"])
def test_job_label_matches_the_rules_selector_whatever_the_release(release: str) -> None:
    """The operator names the job after the Service (release-dependent); the rules select job="gpuwarden"."""
    from gpuwarden.health.rules import SELECTOR

    result = run_render(
        "template", "--release", release, "--values-json", json.dumps({"podMonitor": {"enabled": False}})
    )
    assert result.returncode == 0, result.stderr
    objects = [o for o in yaml.safe_load_all(result.stdout) if o]
    job = next(
        r for r in one(objects, "ServiceMonitor")["spec"]["endpoints"][0]["relabelings"] if r["targetLabel"] == "job"
    )["replacement"]
    assert f'job="{job}"' == SELECTOR
    assert one(objects, "Service")["metadata"]["name"] != "gpuwarden" or release == "gpuwarden"
    rules = one(objects, "PrometheusRule")["spec"]["groups"]
    assert all(SELECTOR in r["expr"] for g in rules for r in g["rules"] if "gpuwarden_" in r["expr"])
    pod_monitor = one(render({"podMonitor": {"enabled": True}}), "PodMonitor")
    assert {"targetLabel": "job", "replacement": job, "action": "replace"} in pod_monitor["spec"][
        "podMetricsEndpoints"
    ][0]["relabelings"]


# -- one source of truth ----------------------------------------------------------------------------------------


def test_chart_files_are_copies_of_the_sources() -> None:
    """Runs without Helm: the chart's files/ must be byte-for-byte alert_rules/ and grafana_dashboards/."""
    fix = "run: .venv-helm/bin/python deploy/helm/render.py sync"
    copied = (
        "gpuwarden.rules.yaml",
        "gpuwarden.recording.yaml",
        "dcgm-compat.recording.yaml",
        "thresholds-of-alerts.json",
    )
    for name in copied:
        assert (CHART / "files" / name).read_bytes() == (ROOT / "alert_rules" / name).read_bytes(), fix
    sources = {p.name: p.read_bytes() for p in (ROOT / "grafana_dashboards").glob("*.json")}
    copies = {p.name: p.read_bytes() for p in (CHART / "files" / "dashboards").glob("*.json")}
    assert copies == sources, fix


def test_prometheus_rule_equals_alert_rules_and_passes_promtool(tmp_path: Path) -> None:
    source = yaml.safe_load((ROOT / "alert_rules" / "gpuwarden.rules.yaml").read_text())
    recording = yaml.safe_load((ROOT / "alert_rules" / "gpuwarden.recording.yaml").read_text())
    rule = one(render(), "PrometheusRule")
    assert rule["spec"]["groups"] == source["groups"] + recording["groups"]  # the alerts, then the fleet's records
    alone = one(render({"prometheusRule": {"recordingRules": False}}), "PrometheusRule")
    assert alone["spec"]["groups"] == source["groups"]
    compat = yaml.safe_load((ROOT / "alert_rules" / "dcgm-compat.recording.yaml").read_text())
    migrating = one(render({"prometheusRule": {"dcgmCompat": True}}), "PrometheusRule")  # opt-in
    assert migrating["spec"]["groups"] == source["groups"] + recording["groups"] + compat["groups"]

    base = "https://runbooks.example.internal/gpu"
    moved = one(render({"prometheusRule": {"runbookBaseURL": base}}), "PrometheusRule")
    urls = [r["annotations"]["runbook_url"] for g in moved["spec"]["groups"] for r in g["rules"] if "alert" in r]
    assert urls and all(u.startswith(base + "#gpuwarden") for u in urls)

    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.fail("promtool missing: the README's test command installs Debian's prometheus package")
    path = tmp_path / "rules.yaml"
    path.write_text(yaml.safe_dump({"groups": moved["spec"]["groups"]}))
    check = subprocess.run([promtool, "check", "rules", str(path)], capture_output=True, text=True)
    assert check.returncode == 0, check.stdout + check.stderr


def test_dashboard_configmaps_equal_the_dashboards() -> None:
    objects = render({"dashboards": {"label": "grafana_dashboard", "labelValue": "1", "folder": "GPU"}})
    maps = [o for o in objects if o["kind"] == "ConfigMap" and o["metadata"]["labels"].get("grafana_dashboard")]
    by_key = {key: value for cm in maps for key, value in cm["data"].items()}
    sources = {p.name: p.read_text() for p in (ROOT / "grafana_dashboards").glob("*.json")}
    assert set(by_key) == set(sources)
    for name, text in sources.items():
        assert json.loads(by_key[name]) == json.loads(text)
    assert all(cm["metadata"]["annotations"]["grafana_folder"] == "GPU" for cm in maps)
    assert all(cm["metadata"]["labels"]["grafana_dashboard"] == "1" for cm in maps)


# their namespace enforces Pod Security restricted: no privileged relay, no hostPath
PLAIN_VALUES = {"kernelLog": {"enabled": False}, "processes": {"hostProc": False}, "state": {"hostPath": ""}}


def test_plain_manifests_are_the_default_render() -> None:
    rendered = render(PLAIN_VALUES)
    plain = [
        doc
        for name in ("gpuwarden.yaml", "monitoring.yaml")
        for doc in yaml.safe_load_all((ROOT / "deploy" / "kubernetes" / name).read_text())
        if doc
    ]
    key = lambda o: (o["kind"], o["metadata"]["name"])  # noqa: E731
    assert sorted(plain, key=key) == sorted(map(as_plain, rendered), key=key), (
        "deploy/kubernetes/ drifted from the chart: run .venv-helm/bin/python deploy/helm/render.py sync"
    )
    # applied by kubectl or kustomize: they claimed Helm's ownership (issue 36)
    text = "".join(
        (ROOT / "deploy" / "kubernetes" / name).read_text() for name in ("gpuwarden.yaml", "monitoring.yaml")
    )
    assert "managed-by: Helm" not in text and "helm.sh/chart" not in text
    assert text.count("app.kubernetes.io/managed-by: kustomize") >= len(plain)


def test_the_plain_manifests_fit_their_namespaces_pod_security_level() -> None:
    """deploy/kubernetes/namespace.yaml enforces Pod Security `restricted`: every pod the plain manifests make must
    pass it, or the API server makes none (the kernel log's privileged relay, rendered by default, would have). The
    restricted profile's pod and container checks, on the objects as applied."""
    namespace = yaml.safe_load((ROOT / "deploy" / "kubernetes" / "namespace.yaml").read_text())
    assert namespace["metadata"]["labels"]["pod-security.kubernetes.io/enforce"] == "restricted"
    objects = [o for o in yaml.safe_load_all((ROOT / "deploy" / "kubernetes" / "gpuwarden.yaml").read_text()) if o]
    pods = [o["spec"]["template"]["spec"] for o in objects if o["kind"] in ("DaemonSet", "Deployment")]
    assert pods
    for pod in pods:
        assert not any(pod.get(host) for host in ("hostNetwork", "hostPID", "hostIPC"))
        assert not [v["name"] for v in pod.get("volumes", []) if "hostPath" in v]
        pod_context = pod.get("securityContext", {})
        assert pod_context.get("seccompProfile", {}).get("type") in ("RuntimeDefault", "Localhost")
        for ctr in pod["containers"] + pod.get("initContainers", []):
            context = ctr.get("securityContext", {})
            where = ctr["name"]
            assert not context.get("privileged") and context.get("allowPrivilegeEscalation") is False, where
            assert context.get("runAsNonRoot", pod_context.get("runAsNonRoot")) is True, where
            assert context.get("runAsUser", pod_context.get("runAsUser")) != 0, where
            assert "ALL" in context.get("capabilities", {}).get("drop", []), where
            assert set(context.get("capabilities", {}).get("add", [])) <= {"NET_BIND_SERVICE"}, where


def as_plain(obj: Any) -> Any:
    """What deploy/helm/render.py's as_plain does to a rendered object's text, on the parsed object."""
    if isinstance(obj, dict):
        return {
            k: ("kustomize" if k == "app.kubernetes.io/managed-by" and v == "Helm" else as_plain(v))
            for k, v in obj.items()
            if k != "helm.sh/chart"
        }
    if isinstance(obj, list):
        return [as_plain(v) for v in obj]
    return obj


def test_kustomize_builds_the_plain_manifests() -> None:
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("kubectl (with kustomize) is not on this machine")
    built = subprocess.run(
        [kubectl, "kustomize", str(ROOT / "deploy" / "kubernetes")], capture_output=True, text=True, check=True
    ).stdout
    objects = [o for o in yaml.safe_load_all(built) if o]
    assert kinds(objects) == sorted(kinds(render()) + ["Namespace"])
    namespace = one(objects, "Namespace")
    assert all(
        o["metadata"].get("namespace") == namespace["metadata"]["name"] for o in objects if o["kind"] != "Namespace"
    )


if __name__ == "__main__":  # pragma: no cover
    sys.exit(pytest.main([__file__, "-q"]))


def test_rules_can_be_disabled_and_tuned_per_alert_without_a_fork(tmp_path: Path) -> None:
    """kube-prometheus-stack's manner: disable by name, override a severity; a threshold and its `for:` are set once
    in `thresholds`, for the exporter and its rules. The result is what promtool accepts, and the threshold set is
    the one that fires."""
    values = {
        "thresholds": {"temperature_warning_celsius": 85, "temperature_warning_for_s": 600},
        "prometheusRule": {
            "rules": {
                "disabled": {"GpuwardenMemoryNearlyFull": True, "GpuwardenUnderutilized": True},
                "overrides": {"GpuwardenNvlinkReplayRecovery": {"severity": "info"}},
            }
        },
    }
    groups = one(render(values), "PrometheusRule")["spec"]["groups"]
    rules = {r["alert"]: r for g in groups for r in g["rules"] if "alert" in r}  # the recording rules have none
    default = {
        r["alert"]: r for g in one(render(), "PrometheusRule")["spec"]["groups"] for r in g["rules"] if "alert" in r
    }
    assert set(default) - set(rules) == {"GpuwardenMemoryNearlyFull", "GpuwardenUnderutilized"}
    hot = rules["GpuwardenTemperatureHigh"]
    assert hot["expr"].endswith("> 85") and hot["for"] == "10m" and hot["annotations"]["threshold"] == "85"
    assert rules["GpuwardenNvlinkReplayRecovery"]["labels"]["severity"] == "info"
    untouched = set(rules) - {"GpuwardenTemperatureHigh", "GpuwardenNvlinkReplayRecovery"}
    assert all(rules[name] == default[name] for name in untouched)

    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.fail("promtool missing: the README's test command installs Debian's prometheus package")
    (tmp_path / "rules.yaml").write_text(yaml.safe_dump({"groups": groups}))
    check = subprocess.run([promtool, "check", "rules", str(tmp_path / "rules.yaml")], capture_output=True, text=True)
    assert check.returncode == 0, check.stdout + check.stderr
    rendered = (
        hot["annotations"]["description"]
        .replace("{{ $labels.gpu }}", "1")
        .replace("{{ $labels.uuid }}", "G1")
        .replace("{{ with $labels.node }}{{ . }}{{ else }}{{ $labels.instance }}{{ end }}", "n1")
        .replace("{{ $value }}", "86")
    )
    test = {
        "rule_files": ["rules.yaml"],
        "evaluation_interval": "1m",
        "tests": [
            {
                "interval": "1m",
                "input_series": [
                    {"series": 'gpuwarden_temperature_celsius{job="gpuwarden",instance="n1",gpu="0",uuid="G0"}',
                     "values": "84x20"},
                    {"series": 'gpuwarden_temperature_celsius{job="gpuwarden",instance="n1",gpu="1",uuid="G1"}',
                     "values": "86x20"},
                ],
                "alert_rule_test": [
                    {"eval_time": "8m", "alertname": "GpuwardenTemperatureHigh", "exp_alerts": []},  # for: 10m
                    {"eval_time": "15m", "alertname": "GpuwardenTemperatureHigh", "exp_alerts": [
                        {"exp_labels": {"job": "gpuwarden", "instance": "n1", "gpu": "1", "uuid": "G1",
                                        "severity": "warning"},
                         "exp_annotations": {**hot["annotations"], "description": rendered}}]},
                ],
            }
        ],
    }  # fmt: skip
    (tmp_path / "test.yaml").write_text(yaml.safe_dump(test))
    ran = subprocess.run(
        [promtool, "test", "rules", "--ignore-unknown-fields", "test.yaml"],
        capture_output=True,
        text=True,
        cwd=tmp_path,
    )
    if "unknown long flag" in ran.stderr:  # older promtool
        ran = subprocess.run([promtool, "test", "rules", "test.yaml"], capture_output=True, text=True, cwd=tmp_path)
    assert ran.returncode == 0, ran.stdout + ran.stderr


def test_thresholds_set_once_give_the_exporters_file_and_rules_that_agree_with_gpuwarden_rules(tmp_path: Path) -> None:
    """Every threshold the chart can apply, moved at once: the ConfigMap's thresholds file is what the exporter
    loads, and the PrometheusRule's alerts are what `gpuwarden rules --thresholds` renders from that same file."""
    import dataclasses

    from gpuwarden.health.rules import build
    from gpuwarden.health.rules_file import alert_rules_yaml
    from gpuwarden.health.thresholds import DEFAULT, load_thresholds

    shipped = json.loads((ROOT / "alert_rules" / "thresholds-of-alerts.json").read_text())
    mapping = {field: reach for field, reach in shipped.items() if field != "_generated"}
    settable = [
        f
        for f, reach in mapping.items()
        if not reach["other"] and (reach["threshold"] or reach["for"] or reach["keep_firing"])
    ]
    moved = {}
    for field in settable:
        value = getattr(DEFAULT, field)
        if isinstance(value, float):
            moved[field] = round(value * 1.01, 4)
        else:
            moved[field] = value + (60 if field.endswith("_s") else 1)  # durations by a minute, counts and °C by one
    dataclasses.replace(DEFAULT, **moved).validate()  # a combination the exporter accepts
    objects = render({"thresholds": moved})
    (config,) = [o["data"] for o in objects if o["kind"] == "ConfigMap" and "gpuwarden.yaml" in o["data"]]
    exporter_file = yaml.safe_load(config["gpuwarden.yaml"])["health"]["thresholds_file"]
    assert exporter_file == "/etc/gpuwarden/config/thresholds.yaml"
    thresholds_file = tmp_path / "thresholds.yaml"
    thresholds_file.write_text(config["thresholds.yaml"])
    exporter = load_thresholds(thresholds_file)  # what the exporter judges by
    assert all(getattr(exporter, f) == v for f, v in moved.items())
    want = yaml.safe_load(alert_rules_yaml(build(exporter)))["groups"]
    shipped = {g["name"] for g in want}  # the chart adds the fleet's recording groups where asked
    chart = [g for g in one(objects, "PrometheusRule")["spec"]["groups"] if g["name"] in shipped]
    assert chart == want
    assert chart != yaml.safe_load(alert_rules_yaml(build(DEFAULT)))["groups"]  # the values did reach the rules


@pytest.mark.parametrize(
    ("values", "message"),
    [
        (
            {"thresholds": {"temperature_criticl_celsius": 92}},
            "thresholds.temperature_criticl_celsius: not a gpuwarden",
        ),
        ({"thresholds": {"utilization_low_ratio": 0.3}}, "GpuwardenUnderutilized beyond a number"),
        (
            {"prometheusRule": {"rules": {"overrides": {"GpuwardenTemperatureHigh": {"threshold": 85}}}}},
            "set thresholds.temperature_warning_celsius instead",
        ),
        (
            {"prometheusRule": {"rules": {"overrides": {"GpuwardenGpuLost": {"for": "5m"}}}}},
            "set thresholds.gpu_lost_for_s instead",
        ),
        (
            {"thresholds": {"gpu_lost_for_s": 120}, "config": {"health": {"thresholds_file": "/x.yaml"}}},
            "config.health.thresholds_file and thresholds: set one",
        ),
    ],
)
def test_a_threshold_that_would_split_pages_from_verdicts_is_refused_with_the_fix(values: dict, message: str) -> None:
    result = run_render("template", "--values-json", json.dumps(values))
    assert result.returncode != 0 and message in result.stderr, result.stderr[-1500:]


def test_a_misspelt_alert_name_fails_the_render() -> None:
    bad = json.dumps({"prometheusRule": {"rules": {"disabled": {"GpuwardenMemoryNearlyFul": True}}}})
    result = run_render("template", "--values-json", bad)
    assert result.returncode != 0 and "no alert named GpuwardenMemoryNearlyFul" in result.stderr, result.stderr
    over = json.dumps({"prometheusRule": {"rules": {"overrides": {"GpuwardenNvlinkDown": {"threshold": 3}}}}})
    result = run_render("template", "--values-json", over)
    assert result.returncode != 0 and "has no single threshold" in result.stderr, result.stderr


def test_the_config_block_is_schema_checked_from_the_exporters_own_settings() -> None:
    """A typo in `config:` is refused by the install, not rendered into a ConfigMap that crash-loops every pod."""
    sys.path.insert(0, str(ROOT / "deploy" / "helm"))
    try:
        import config_schema
    finally:
        sys.path.pop(0)
    text = (CHART / "values.schema.json").read_text(encoding="utf-8")
    assert config_schema.render(text) == text, "run: python deploy/helm/config_schema.py"
    ok = run_render("template", "--values-json", json.dumps({"config": {"nvml": {"expected_gpus": 8}}}))
    assert ok.returncode == 0, ok.stderr
    for bad, words in (
        ({"config": {"poll": {"fast_intervall": 1}}}, "fast_intervall"),
        ({"config": {"pol": {"fast_interval": 1}}}, "pol"),
        ({"config": {"poll": {"fast_interval": "fast"}}}, "fast_interval"),
        ({"config": {"poll": {"fast_interval": 0.01}}}, "fast_interval"),
        ({"config": {"log": {"format": "xml"}}}, "format"),
    ):
        result = run_render("template", "--values-json", json.dumps(bad))
        assert result.returncode != 0 and "schema" in result.stderr and words in result.stderr, (bad, result.stderr)


def test_pod_monitor_takes_tls_basic_auth_and_relabelings() -> None:
    values = {
        "serviceMonitor": {"enabled": False},
        "podMonitor": {
            "enabled": True,
            "additionalLabels": {"release": "kube-prometheus-stack"},
            "tlsConfig": {"ca": {"secret": {"name": "gpuwarden-ca", "key": "ca.crt"}}, "serverName": "gpuwarden"},
            "basicAuth": {
                "username": {"name": "gpuwarden-scrape", "key": "username"},
                "password": {"name": "gpuwarden-scrape", "key": "password"},
            },
            "relabelings": [{"targetLabel": "cluster", "replacement": "gpu-a"}],
            "metricRelabelings": [{"sourceLabels": ["__name__"], "regex": "gpuwarden_nvlink_errors_total",
                                   "action": "drop"}],
        },
    }  # fmt: skip
    monitor = one(render(values), "PodMonitor")
    assert monitor["metadata"]["labels"]["release"] == "kube-prometheus-stack"
    endpoint = monitor["spec"]["podMetricsEndpoints"][0]
    assert endpoint["tlsConfig"]["serverName"] == "gpuwarden"
    assert endpoint["basicAuth"]["password"] == {"name": "gpuwarden-scrape", "key": "password"}
    labels = [r["targetLabel"] for r in endpoint["relabelings"]]
    assert labels == ["node", "job", "cluster"]  # the chart's own first: node names stay in pages
    assert endpoint["metricRelabelings"][0]["action"] == "drop"


def test_network_policy_admits_only_the_listed_scrapers_to_the_metrics_port() -> None:
    # on by default: any source, but to the metrics port alone (the probe port is closed to pods; the kubelet probes
    # from the node, which NetworkPolicy always admits), so no scrape breaks where the CNI enforces it
    default = one(render(), "NetworkPolicy")
    (rule,) = default["spec"]["ingress"]
    assert "from" not in rule and rule["ports"] == [{"port": "metrics", "protocol": "TCP"}]
    assert "NetworkPolicy" not in kinds(render({"networkPolicy": {"enabled": False}}))
    peers = [{"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}}]
    policy = one(render({"networkPolicy": {"enabled": True, "from": peers}}), "NetworkPolicy")
    pods = one(render(), "DaemonSet")["spec"]["template"]["metadata"]["labels"]
    selector = policy["spec"]["podSelector"]["matchLabels"]
    assert selector.items() <= pods.items()  # it selects the exporter's pods
    (rule,) = policy["spec"]["ingress"]
    assert rule["from"] == peers and rule["ports"] == [{"port": "metrics", "protocol": "TCP"}]
    assert policy["spec"]["policyTypes"] == ["Ingress"]


def test_the_fleet_gets_its_own_network_policy_selecting_its_pods_alone() -> None:
    objects = render(VARIANTS["fleet-with-tls-basic-auth-and-policy"])
    policies = {o["metadata"]["name"]: o for o in objects if o["kind"] == "NetworkPolicy"}
    deployment, daemonset = one(objects, "Deployment"), one(objects, "DaemonSet")
    fleet_pods = deployment["spec"]["template"]["metadata"]["labels"].items()
    exporter_pods = daemonset["spec"]["template"]["metadata"]["labels"].items()
    fleet = policies.pop(deployment["metadata"]["name"])
    (exporter,) = policies.values()
    assert fleet["spec"]["podSelector"]["matchLabels"].items() <= fleet_pods
    assert not fleet["spec"]["podSelector"]["matchLabels"].items() <= exporter_pods
    assert not exporter["spec"]["podSelector"]["matchLabels"].items() <= fleet_pods
    (rule,) = fleet["spec"]["ingress"]
    assert rule["from"] == [{"namespaceSelector": {"matchLabels": {"team": "sre"}}}]
    port = deployment["spec"]["template"]["spec"]["containers"][0]["ports"][0]["name"]
    assert rule["ports"] == [{"port": port, "protocol": "TCP"}]


def test_the_fleets_basic_auth_and_tls_come_from_a_secret_and_its_probes_stay_open(tmp_path: Path) -> None:
    """The chart's fleet web-config, rendered, mounted and passed as --web.config.file, is one the fleet loads; the
    fleet then refuses an unauthenticated reader (401) and answers the credentials and the probes (the CLI over
    the rendered Secret's file, TLS left out: its certificate is a Secret the test does not have)."""
    from gpuwarden.config.web import load_web_config
    from gpuwarden.fleet.settings import parse

    objects = render(VARIANTS["fleet-with-tls-basic-auth-and-policy"])
    deployment = one(objects, "Deployment")
    pod = deployment["spec"]["template"]["spec"]
    ctr = pod["containers"][0]
    settings = parse(ctr["args"][1:], environ={})
    assert str(settings.web_config_file) == "/etc/gpuwarden/web/web-config.yml"
    mounts = {m["name"]: m["mountPath"] for m in ctr["volumeMounts"]}
    assert mounts["web-config"] == "/etc/gpuwarden/web" and mounts["tls"] == "/etc/gpuwarden/tls"
    volumes = {v["name"]: v["secret"]["secretName"] for v in pod["volumes"] if "secret" in v}
    secret = next(o for o in objects if o["kind"] == "Secret" and o["metadata"]["name"] == volumes["web-config"])
    assert ctr["livenessProbe"]["httpGet"]["scheme"] == ctr["readinessProbe"]["httpGet"]["scheme"] == "HTTPS"
    web = yaml.safe_load(secret["stringData"]["web-config.yml"])
    assert web["basic_auth_users"] == {"sre": FLEET_HASH} and "tls_server_config" in web
    assert "checksum/web-config" in deployment["spec"]["template"]["metadata"]["annotations"]
    # an existing Secret (the exporter's, say) instead: none rendered, that one mounted
    shared = render({"fleet": {**VARIANTS["fleet"]["fleet"], "webConfig": {"enabled": True, "existingSecret": "x"}}})
    assert not [o for o in shared if o["kind"] == "Secret"]
    (volume,) = [v for v in one(shared, "Deployment")["spec"]["template"]["spec"]["volumes"] if "secret" in v]
    assert volume["secret"]["secretName"] == "x"
    nothing = run_render(
        "template",
        "--values-json",
        json.dumps({"fleet": {**VARIANTS["fleet"]["fleet"], "webConfig": {"enabled": True}}}),
    )
    assert nothing.returncode == 1 and "fleet.webConfig.enabled needs fleet.webConfig.config" in nothing.stderr

    del web["tls_server_config"]
    (tmp_path / "web-config.yml").write_text(yaml.safe_dump(web))
    assert load_web_config(tmp_path / "web-config.yml").basic_auth_users == {"sre": FLEET_HASH}
    _fleet_answers_only_with_the_password(tmp_path / "web-config.yml")


def _fleet_answers_only_with_the_password(web_config: Path) -> None:
    import httpx

    from tests.helpers.fake_prometheus import FakePrometheus
    from tests.helpers.stack import running_cli

    backend = FakePrometheus()
    try:
        with running_cli("fleet", "--prometheus-url", backend.url, "--web.config.file", str(web_config)) as (url, _):
            assert httpx.get(url + "/api/v1/fleet", timeout=30).status_code == 401
            assert httpx.get(url + "/metrics", timeout=30).status_code == 401
            assert httpx.get(url + "/api/v1/fleet", auth=("sre", FLEET_PASSWORD), timeout=30).status_code == 200
            assert httpx.get(url + "/healthz", timeout=30).status_code == 200
    finally:
        backend.close()


def test_the_runbooks_kubectl_commands_match_what_the_chart_deploys() -> None:
    """The runbooks' kubectl commands name the chart's namespace, pod labels and port as rendered (the nvidia-smi,
    dmesg and lspci commands need a GPU host and are not run here: docs/runbooks.md says so)."""
    objects = render()
    daemonset = one(objects, "DaemonSet")
    labels = daemonset["spec"]["template"]["metadata"]["labels"]
    ports = {p["name"]: p["containerPort"] for p in container(objects)["ports"]}
    text = (ROOT / "docs" / "runbooks.md").read_text(encoding="utf-8")
    commands = re.findall(r"`(kubectl [^`]+)`", text)
    assert len(commands) >= 3, commands
    for command in commands:
        if namespace := re.search(r"-n (\S+)", command):
            assert namespace.group(1) == daemonset["metadata"]["namespace"], command
        if selector := re.search(r"-l (\S+)=(\S+)", command):
            assert labels.get(selector.group(1)) == selector.group(2), (command, labels)
        if forward := re.search(r"port-forward \S+ (\d+)", command):
            assert int(forward.group(1)) == ports["metrics"], (command, ports)
    assert "not run by the tests" in text  # the untestable commands are listed as such


# -- node-problem-detector (npd.enabled) ---------------------------------------------------------------------------


def npd_config(objects: list[dict[str, Any]]) -> dict[str, Any]:
    (config_map,) = [o for o in objects if o["kind"] == "ConfigMap" and o["metadata"]["name"].endswith("-npd")]
    return json.loads(config_map["data"]["gpuwarden-npd.json"])


def test_npd_is_off_by_default_and_on_renders_the_shipped_config_with_a_token_for_npd_alone() -> None:
    from tests.helpers.npd import check_npd_config

    assert not [o for o in render() if o["metadata"]["name"].endswith("-npd")]
    containers = [c["name"] for c in one(render(), "DaemonSet")["spec"]["template"]["spec"]["containers"]]
    assert containers == ["gpuwarden", RELAY]
    objects = render(VARIANTS["npd"])
    config = npd_config(objects)
    assert config == json.loads((ROOT / "deploy" / "npd" / "gpuwarden-npd.json").read_text())  # one config
    assert check_npd_config(config) == {"hardware", "nvlink", "fabric", "thermal", "driver"}
    pod = one(objects, "DaemonSet")["spec"]["template"]["spec"]
    npd = container(objects, "node-problem-detector")
    assert npd["image"] == container(objects)["image"]  # NPD runs where `gpuwarden npd-plugin` exists
    assert npd["command"][0] == "/npd/node-problem-detector"
    (init,) = [c for c in pod["initContainers"] if c["name"] == "npd-binary"]
    assert init["image"].startswith("registry.k8s.io/node-problem-detector/") and init["command"][0] == "cp"
    token = "/var/run/secrets/kubernetes.io/serviceaccount"
    assert pod["automountServiceAccountToken"] is False
    assert token in {m["mountPath"] for m in npd["volumeMounts"]}
    assert token not in {m["mountPath"] for m in container(objects).get("volumeMounts", [])}  # the exporter: none
    state = next(v for v in pod["volumes"] if v["name"] == "npd-state")
    assert state["hostPath"] == {"path": "/run/gpuwarden/npd", "type": "DirectoryOrCreate"}  # survives the pod
    (binding,) = [o for o in objects if o["kind"] == "ClusterRoleBinding"]
    assert binding["roleRef"]["name"] == "system:node-problem-detector"
    assert binding["subjects"][0]["name"] == pod["serviceAccountName"]


def test_npd_rules_follow_the_exporters_web_config_and_extra_flags() -> None:
    from gpuwarden.remediation.npd import build_parser
    from tests.helpers.npd import check_npd_config

    objects = render(VARIANTS["npd-with-tls-and-basic-auth"])
    config = npd_config(objects)
    check_npd_config(config)
    for rule in config["rules"]:
        args = build_parser().parse_args(rule["args"][1:])
        assert args.exporter_url == "https://127.0.0.1:10045" and args.debounce == 3 and args.username == "npd"
        assert str(args.web_config) == "/etc/gpuwarden/web/web-config.yml"
    mounts = {m["mountPath"] for m in container(objects, "node-problem-detector")["volumeMounts"]}
    assert {"/etc/gpuwarden/web", "/etc/gpuwarden/tls"} <= mounts  # the web-config's certificate is readable there


def test_npd_values_are_checked() -> None:
    result = run_render("template", "--values-json", json.dumps({"npd": {"enabled": True, "debounce": 0}}))
    assert result.returncode != 0 and "debounce" in result.stdout + result.stderr


def test_security_context_and_extra_volumes_can_be_set_and_the_hardening_stays() -> None:
    """A site's policy adds to the pod's and the exporter's securityContext, and mounts what it needs (issue 36: the
    chart could set neither); what it does not name keeps the chart's hardening."""
    values = {
        "podSecurityContext": {"fsGroup": 10045},
        "securityContext": {"seLinuxOptions": {"type": "spc_t"}},
        "extraVolumes": [{"name": "ca", "configMap": {"name": "site-ca"}}],
        "extraVolumeMounts": [{"name": "ca", "mountPath": "/etc/ssl/site", "readOnly": True}],
    }
    pod = one(render(values), "DaemonSet")["spec"]["template"]["spec"]
    exporter = next(c for c in pod["containers"] if c["name"] == "gpuwarden")
    assert pod["securityContext"]["fsGroup"] == 10045 and pod["securityContext"]["runAsNonRoot"] is True
    assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    context = exporter["securityContext"]
    assert context["seLinuxOptions"] == {"type": "spc_t"}
    assert context["readOnlyRootFilesystem"] is True and context["allowPrivilegeEscalation"] is False
    assert context["capabilities"] == {"drop": ["ALL"]}
    assert {"name": "ca", "configMap": {"name": "site-ca"}} in pod["volumes"]
    assert {"name": "ca", "mountPath": "/etc/ssl/site", "readOnly": True} in exporter["volumeMounts"]
    # the defaults render the same hardening, and nothing extra
    default = one(render(), "DaemonSet")["spec"]["template"]["spec"]
    plain = next(c for c in default["containers"] if c["name"] == "gpuwarden")
    assert plain["securityContext"] == {key: value for key, value in context.items() if key != "seLinuxOptions"}
    assert "fsGroup" not in default["securityContext"] and all(v["name"] != "ca" for v in default["volumes"])


# kube-prometheus-stack's defaults (its values.yaml: prometheus.prometheusSpec.*SelectorNilUsesHelmValues true makes
# each selector `matchLabels: {release: <its release>}`; the Grafana sidecar watches `grafana_dashboard: "1"`)
KPS_RELEASE = "kube-prometheus-stack"
KPS_SELECTORS = {
    "ServiceMonitor": {"release": KPS_RELEASE},
    "PodMonitor": {"release": KPS_RELEASE},
    "PrometheusRule": {"release": KPS_RELEASE},
}


def selected(obj: dict[str, Any], match_labels: dict[str, str]) -> bool:
    labels = obj["metadata"].get("labels") or {}
    return all(labels.get(key) == value for key, value in match_labels.items())


def test_the_default_install_is_selected_by_kube_prometheus_stacks_default_selectors() -> None:
    """The README's `helm install` loaded none of the 31 alerts and 36 records into kube-prometheus-stack: only the
    ServiceMonitor could get its `release` label (issue 36). One value, releaseLabel, labels all of them."""
    for values, monitor in (({}, "ServiceMonitor"), ({"podMonitor": {"enabled": True}}, "PodMonitor")):
        objects = render(values)
        for kind in (monitor, "PrometheusRule"):
            assert selected(one(objects, kind), KPS_SELECTORS[kind]), kind
        dashboards = [o for o in objects if o["kind"] == "ConfigMap" and "grafana_dashboard" in o["metadata"]["labels"]]
        assert dashboards and all(selected(d, {"grafana_dashboard": "1", "release": KPS_RELEASE}) for d in dashboards)
    # another release's name, or none; an object's own additionalLabels still win for that object
    renamed = render({"releaseLabel": "monitoring", "serviceMonitor": {"additionalLabels": {"team": "gpu"}}})
    assert one(renamed, "ServiceMonitor")["metadata"]["labels"]["release"] == "monitoring"
    assert one(renamed, "ServiceMonitor")["metadata"]["labels"]["team"] == "gpu"
    assert one(renamed, "PrometheusRule")["metadata"]["labels"]["release"] == "monitoring"
    bare = render({"releaseLabel": ""})
    assert "release" not in one(bare, "ServiceMonitor")["metadata"]["labels"]
    overridden = render({"prometheusRule": {"additionalLabels": {"release": "rules-only"}}})
    assert one(overridden, "PrometheusRule")["metadata"]["labels"]["release"] == "rules-only"
    # the plain manifests carry it too (they are the default render: test_plain_manifests_are_the_default_render)
    plain = (ROOT / "deploy" / "kubernetes" / "monitoring.yaml").read_text()
    assert plain.count(f"release: {KPS_RELEASE}") >= 3
