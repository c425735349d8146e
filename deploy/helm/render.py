"""Render the chart with the real Helm engine, with no cluster, and keep deploy/kubernetes/ in sync with it.

No `helm` binary is installable on our build machines; the PyPI package helm-sdkpy bundles Helm's Go library
(Python >= 3.12) but exposes install, not template. So this runs a real `helm install` (memory storage driver,
no wait) against a stand-in Kubernetes API on a loopback port that answers discovery and records what Helm
creates; the manifest Helm rendered is returned by the install. Everything that decides the output — values
merging, the values schema, templates, Capabilities, ordering — is Helm's own code.

Usage (in a Python 3.12 venv with helm-sdkpy, e.g. .venv-helm):
    python deploy/helm/render.py template [--values-json JSON] [--namespace NS] [--release NAME] [--no-monitoring-api]
    python deploy/helm/render.py lint      # Helm's lint, as JSON
    python deploy/helm/render.py sync      # copy alert rules and dashboards into the chart, rewrite deploy/kubernetes/
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import shutil
import sys
import tempfile
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "deploy" / "helm" / "gpuwarden"
PLAIN = ROOT / "deploy" / "kubernetes"
KUBE_VERSION = ("1", "34", "v1.34.0")

CORE = {
    ("", "v1"): [
        ("configmaps", "ConfigMap", True),
        ("secrets", "Secret", True),
        ("services", "Service", True),
        ("serviceaccounts", "ServiceAccount", True),
        ("namespaces", "Namespace", False),
    ],
    ("apps", "v1"): [("daemonsets", "DaemonSet", True), ("deployments", "Deployment", True)],
    ("networking.k8s.io", "v1"): [("networkpolicies", "NetworkPolicy", True)],
    ("rbac.authorization.k8s.io", "v1"): [
        ("clusterrolebindings", "ClusterRoleBinding", False),
        ("clusterroles", "ClusterRole", False),
    ],
}
MONITORING = {
    ("monitoring.coreos.com", "v1"): [
        ("servicemonitors", "ServiceMonitor", True),
        ("podmonitors", "PodMonitor", True),
        ("prometheusrules", "PrometheusRule", True),
    ]
}
_ITEM = re.compile(r"^/(?:api|apis/[^/]+)/[^/]+(?:/namespaces/([^/]+))?/([^/]+)(?:/([^/]+))?$")


class FakeApiServer:
    """Just enough of the Kubernetes API for `helm install --wait=false`: version, discovery, get/list/create."""

    def __init__(self, monitoring_api: bool = True) -> None:
        self.resources = {**CORE, **(MONITORING if monitoring_api else {})}
        self.objects: dict[tuple[str, str | None, str], dict[str, Any]] = {}
        api = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:
                pass

            def _send(self, code: int, body: dict[str, Any]) -> None:
                data = json.dumps(body).encode()
                self.send_response(code)
                self.send_header("content-type", "application/json")
                self.send_header("content-length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def _handle(self) -> None:
                length = int(self.headers.get("content-length") or 0)
                body = self.rfile.read(length) if length else b""
                code, answer = api.answer(self.command, self.path.split("?")[0], body)
                self._send(code, answer)

            do_GET = do_POST = do_PUT = do_PATCH = do_DELETE = _handle

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def answer(self, method: str, path: str, body: bytes) -> tuple[int, dict[str, Any]]:
        not_found = {"kind": "Status", "apiVersion": "v1", "status": "Failure", "reason": "NotFound", "code": 404}
        if path == "/version":
            return 200, {"major": KUBE_VERSION[0], "minor": KUBE_VERSION[1], "gitVersion": KUBE_VERSION[2]}
        if path == "/api":
            return 200, {"kind": "APIVersions", "versions": ["v1"], "serverAddressByClientCIDRs": []}
        if path == "/apis":
            groups = [
                {
                    "name": g,
                    "versions": [{"groupVersion": f"{g}/{v}", "version": v}],
                    "preferredVersion": {"groupVersion": f"{g}/{v}", "version": v},
                }
                for (g, v) in self.resources
                if g
            ]
            return 200, {"kind": "APIGroupList", "apiVersion": "v1", "groups": groups}
        for (group, version), resources in self.resources.items():
            if path == (f"/apis/{group}/{version}" if group else f"/api/{version}"):
                return 200, {
                    "kind": "APIResourceList",
                    "groupVersion": f"{group}/{version}" if group else version,
                    "resources": [
                        {
                            "name": name,
                            "singularName": "",
                            "namespaced": namespaced,
                            "kind": kind,
                            "verbs": ["create", "delete", "get", "list", "patch", "update"],
                        }
                        for name, kind, namespaced in resources
                    ],
                }
        match = _ITEM.match(path)
        if not match:
            return 404, not_found
        namespace, resource, name = match.groups()
        if method == "GET" and name is None:
            items = [o for (r, ns, _), o in self.objects.items() if r == resource and ns == namespace]
            return 200, {"kind": "List", "apiVersion": "v1", "metadata": {"resourceVersion": "1"}, "items": items}
        if method == "GET":
            found = self.objects.get((resource, namespace, name))
            return (200, found) if found else (404, not_found)
        if method in ("POST", "PUT"):
            obj = json.loads(body)
            obj.setdefault("metadata", {})["resourceVersion"] = "1"
            self.objects[(resource, namespace, obj["metadata"]["name"])] = obj
            return (201 if method == "POST" else 200), obj
        return 404, not_found

    def __enter__(self) -> FakeApiServer:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.shutdown()

    def kubeconfig(self, namespace: str) -> str:
        port = self.server.server_address[1]
        return (
            f"apiVersion: v1\nkind: Config\ncurrent-context: fake\n"
            f"clusters: [{{name: fake, cluster: {{server: 'http://127.0.0.1:{port}'}}}}]\n"
            f"contexts: [{{name: fake, context: {{cluster: fake, user: fake, namespace: {namespace}}}}}]\n"
            f"users: [{{name: fake, user: {{}}}}]\n"
        )


def template(
    values: dict[str, Any] | None = None,
    namespace: str = "gpuwarden",
    release: str = "gpuwarden",
    monitoring_api: bool = True,
    chart: Path = CHART,
    namespace_labels: dict[str, str] | None = None,
) -> str:
    """The manifest `helm install` renders for these values (Helm's own engine, no cluster). `namespace_labels`:
    the release namespace exists with these labels (the chart's `lookup` of it then finds it)."""
    if os.environ.get("HELM_DRIVER") != "memory":
        raise RuntimeError(
            "HELM_DRIVER=memory must be in the environment before Helm's library loads "
            "(run this file as a script, it sets it)"
        )
    from helm_sdkpy import Configuration, Install

    with FakeApiServer(monitoring_api) as api:
        if namespace_labels is not None:
            metadata = {"name": namespace, "labels": namespace_labels, "resourceVersion": "1"}
            found = {"apiVersion": "v1", "kind": "Namespace", "metadata": metadata}
            api.objects[("namespaces", None, namespace)] = found
        config = Configuration(namespace=namespace, kubeconfig=api.kubeconfig(namespace))
        release_info = asyncio.run(
            Install(config).run(release, str(chart), values=values or None, wait=False, timeout=60)
        )
    return release_info["manifest"]


def lint(chart: Path = CHART) -> dict[str, Any]:
    """Helm's own lint (renders every template with the chart's values; checks Chart.yaml and the schema)."""
    from helm_sdkpy import Configuration
    from helm_sdkpy.chart import Lint

    return asyncio.run(Lint(Configuration()).run(str(chart)))


def split_documents(manifest: str) -> list[str]:
    return [doc.strip() + "\n" for doc in re.split(r"^---\s*$", manifest, flags=re.M) if doc.strip()]


# The plain manifests are applied with kubectl or kustomize, not installed by Helm: they must not claim Helm's ownership
# (a later `helm install` would refuse to adopt them, and tools that trust the label would call them Helm's).
HELM_OWNED = re.compile(r"^(\s*)app\.kubernetes\.io/managed-by: Helm$", flags=re.M)
HELM_CHART = re.compile(r"^\s*helm\.sh/chart: \S+\n", flags=re.M)


def as_plain(doc: str) -> str:
    """A rendered document as the plain manifests carry it: managed by kustomize, no chart label."""
    return HELM_CHART.sub("", HELM_OWNED.sub(r"\1app.kubernetes.io/managed-by: kustomize", doc))


def sync() -> None:
    """Copy the single sources into the chart, then write the plain manifests from the default render."""
    shutil.copyfile(ROOT / "alert_rules" / "gpuwarden.rules.yaml", CHART / "files" / "gpuwarden.rules.yaml")
    shutil.copyfile(ROOT / "alert_rules" / "gpuwarden.recording.yaml", CHART / "files" / "gpuwarden.recording.yaml")
    shutil.copyfile(ROOT / "alert_rules" / "dcgm-compat.recording.yaml", CHART / "files" / "dcgm-compat.recording.yaml")
    shutil.copyfile(ROOT / "alert_rules" / "thresholds-of-alerts.json", CHART / "files" / "thresholds-of-alerts.json")
    dashboards = CHART / "files" / "dashboards"
    for old in dashboards.glob("*.json"):
        old.unlink()
    for source in sorted((ROOT / "grafana_dashboards").glob("*.json")):
        shutil.copyfile(source, dashboards / source.name)
    # The plain manifests' namespace enforces Pod Security `restricted` (namespace.yaml): the kernel log's privileged
    # relay and the host's /proc (hostPath, the job view's) cannot be there, so they leave them out; rendering with
    # the namespace's labels lets the chart's own check fail this sync if a default ever needs more than it admits.
    enforce = re.search(r"pod-security\.kubernetes\.io/enforce: (\S+)", (PLAIN / "namespace.yaml").read_text())
    labels = {"pod-security.kubernetes.io/enforce": enforce.group(1)} if enforce else {}
    # and for the same reason keep the state file in an emptyDir (restricted admits no hostPath)
    values = {"kernelLog": {"enabled": False}, "processes": {"hostProc": False}, "state": {"hostPath": ""}}
    core, monitoring = [], []
    for doc in map(as_plain, split_documents(template(values, namespace_labels=labels))):
        kind = re.search(r"^kind: (\S+)", doc, flags=re.M)
        is_monitoring = "apiVersion: monitoring.coreos.com/" in doc or "grafana_dashboard:" in doc
        (monitoring if is_monitoring else core).append(doc)
        assert kind, doc
    header = (
        "# Rendered from deploy/helm/gpuwarden with default values but kernelLog.enabled=false,\n"
        "# processes.hostProc=false and state.hostPath empty (namespace gpuwarden, which enforces Pod Security\n"
        "# restricted: docs/deploy.md, The kernel log, Who holds the GPU) by\n"
        "# `python deploy/helm/render.py sync`; tests/test_helm_chart.py fails when this file drifts. Edit the\n"
        "# chart, not this file.\n"
    )
    PLAIN.mkdir(exist_ok=True)
    (PLAIN / "gpuwarden.yaml").write_text(header + "---\n".join(core))
    (PLAIN / "monitoring.yaml").write_text(
        header
        + "# Needs the prometheus-operator CRDs (ServiceMonitor, PrometheusRule) and a Grafana sidecar.\n"
        + "---\n".join(monitoring)
    )


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="render.py")
    sub = parser.add_subparsers(dest="command", required=True)
    tpl = sub.add_parser("template", help="print the rendered manifest")
    tpl.add_argument("--values-json", default="{}")
    tpl.add_argument("--namespace", default="gpuwarden")
    tpl.add_argument("--namespace-labels", metavar="JSON", help="the namespace exists with these labels")
    tpl.add_argument("--release", default="gpuwarden")
    tpl.add_argument(
        "--no-monitoring-api", action="store_true", help="render for a cluster without the prometheus-operator CRDs"
    )
    sub.add_parser("sync", help="refresh the chart's files/ and deploy/kubernetes/")
    sub.add_parser("lint", help="print Helm's lint result as JSON")
    args = parser.parse_args(argv)
    try:
        if args.command == "template":
            sys.stdout.write(
                template(
                    json.loads(args.values_json),
                    args.namespace,
                    args.release,
                    not args.no_monitoring_api,
                    namespace_labels=json.loads(args.namespace_labels) if args.namespace_labels else None,
                )
            )
        elif args.command == "lint":
            print(json.dumps(lint()))
        else:
            sync()
    except Exception as exc:  # Helm's errors arrive as exceptions: one line, not a traceback
        print(f"render.py: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    # Release records stay in memory, so nothing but the chart's objects is sent. Go reads the environment once,
    # when its runtime starts, so the variable must be there before the process starts: re-exec with it.
    if os.environ.get("HELM_DRIVER") != "memory":
        os.execve(sys.executable, [sys.executable, *sys.argv], {**os.environ, "HELM_DRIVER": "memory"})
    with tempfile.TemporaryDirectory() as home:  # Helm writes its cache and config under HOME
        os.environ.setdefault("HELM_CACHE_HOME", f"{home}/cache")
        os.environ.setdefault("HELM_CONFIG_HOME", f"{home}/config")
        os.environ.setdefault("HELM_DATA_HOME", f"{home}/data")
        raise SystemExit(main(sys.argv[1:]))
