"""The container image: the Dockerfile built with buildah, then run with podman the way the plain manifests' DaemonSet
runs it (its user, read-only root filesystem, dropped capabilities, no privilege escalation, memory limit, config
volume, /tmp emptyDir, arguments and environment), serving /metrics and the probes.

Stood in for:
- the `python:3.12-slim` base: no image registry is reachable here, so the base is built from Debian's own packages
  (mmdebstrap; Python as a venv at /usr/local, where the official image keeps its Python), trusting this host's CA
  bundle (a machine behind a TLS-intercepting proxy reaches PyPI only with it). The Dockerfile takes the base as
  `--build-arg PYTHON_IMAGE`;
- the NVIDIA container runtime and a GPU: the image runs the simulator (`--sim`);
- the kubelet: podman, given the DaemonSet's settings by `run_arguments` below.

Runtime choices forced by the build machines (cgroup v1 with a v2 hierarchy mounted, no CAP_SYS_RESOURCE): RUN steps
use buildah's chroot isolation, containers run under runc with the cgroupfs manager, and the container's ulimits are
set at or below the host's (crun refuses hybrid cgroups; podman's default RLIMIT_NOFILE is above the host's hard
limit).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import tempfile
import tomllib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from tests.helpers.common import free_port
from tests.helpers.stack import wait_ready

pytestmark = [pytest.mark.slow, pytest.mark.serial]  # builds a Debian base and the image: about 1.5 min

ROOT = Path(__file__).resolve().parent.parent
MANIFESTS = ROOT / "deploy" / "kubernetes" / "gpuwarden.yaml"
TOOLS = ("buildah", "podman", "runc", "mmdebstrap")
IMAGE = "localhost/gpuwarden:test"
MIRROR = "http://deb.debian.org/debian"
HOST_CA_BUNDLE = Path("/etc/ssl/certs/ca-certificates.crt")
ULIMITS = ["--ulimit", "nofile=16384:16384", "--ulimit", "nproc=4096:4096"]


def _missing() -> str | None:
    absent = [tool for tool in TOOLS if shutil.which(tool) is None]
    if absent:
        return f"needs {', '.join(absent)} (the README's test command installs them from Debian's packages)"
    if os.geteuid() != 0:
        return "needs root: mmdebstrap builds the base in root mode, podman runs rootful"
    return None


def _run(*command: str, timeout: float = 600) -> str:
    result = subprocess.run(command, capture_output=True, text=True, timeout=timeout, check=False)
    assert result.returncode == 0, f"{' '.join(command[:4])}... failed: {result.stderr[-3000:]}"
    return result.stdout


def _codename() -> str:
    release = dict(line.split("=", 1) for line in Path("/etc/os-release").read_text().splitlines() if "=" in line)
    return release.get("VERSION_CODENAME", "bookworm").strip('"') or "bookworm"


def _manifest(kind: str) -> dict[str, Any]:
    return next(d for d in yaml.safe_load_all(MANIFESTS.read_text()) if d and d["kind"] == kind)


def storage_driver(path: Path) -> str:
    """overlay, except where `path` itself lies on an overlay (a CI machine that is a container): the kernel refuses
    an overlay upper directory there, and vfs (whole copies of each layer, slower) works anywhere."""
    mounts = [line.split() for line in Path("/proc/mounts").read_text().splitlines()]
    resolved = str(path.resolve())
    under = [m for m in mounts if resolved == m[1] or resolved.startswith(m[1].rstrip("/") + "/")]
    return "vfs" if max(under, key=lambda m: len(m[1]))[2] == "overlay" else "overlay"


class Containers:
    """buildah and podman over a storage of the test's own, removed afterwards."""

    def __init__(self, storage: Path) -> None:
        self.storage = storage
        driver = storage_driver(storage)
        common = ["--root", str(storage / "root"), "--runroot", str(storage / "run"), "--storage-driver", driver]
        self.buildah = ["buildah", *common]
        self.podman = ["podman", *common, "--runtime", "runc", "--cgroup-manager", "cgroupfs"]

    def build_base(self) -> str:
        """A Python base from Debian's packages: python3 and its venv module, a venv at /usr/local."""
        codename = _codename()
        tarball = self.storage / "base.tar"
        _run(
            "mmdebstrap", "--quiet", "--mode=root", "--variant=minbase", "--include=python3,python3-venv",
            '--customize-hook=chroot "$1" python3 -m venv /usr/local',
            f"--customize-hook=copy-in {HOST_CA_BUNDLE} /etc/ssl/certs",
            '--customize-hook=rm -rf "$1"/var/lib/apt/lists/* "$1"/usr/share/doc "$1"/usr/share/man',
            codename, str(tarball), MIRROR,
        )  # fmt: skip
        base = f"localhost/gpuwarden-test/python:{codename}"
        _run(
            *self.podman, "import", "--quiet",
            "--change", f"ENV PIP_CERT={HOST_CA_BUNDLE}",
            "--change", "ENV PATH=/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
            str(tarball), base,
        )  # fmt: skip
        tarball.unlink()
        return base

    def build_image(self, base: str, version: str) -> None:
        _run(
            *self.buildah, "bud", "--quiet", "--isolation", "chroot", "--network", "host", "--layers=false",
            "--build-arg", f"PYTHON_IMAGE={base}", "--build-arg", f"VERSION={version}",
            "--tag", IMAGE, "--file", str(ROOT / "Dockerfile"), str(ROOT),
        )  # fmt: skip

    def inspect(self, what: str) -> dict[str, Any]:
        return json.loads(_run(*self.podman, "inspect", what))[0]

    def remove_all(self) -> None:
        subprocess.run([*self.podman, "rm", "--all", "--force", "--time", "0"], capture_output=True, check=False)
        subprocess.run([*self.podman, "rmi", "--all", "--force"], capture_output=True, check=False)
        subprocess.run([*self.buildah, "rm", "--all"], capture_output=True, check=False)
        for line in reversed(Path("/proc/mounts").read_text().splitlines()):  # left over by a failed build
            mountpoint = line.split()[1]
            if mountpoint.startswith(str(self.storage)):
                subprocess.run(["umount", "-l", mountpoint], capture_output=True, check=False)
        shutil.rmtree(self.storage, ignore_errors=True)


def _megabytes(quantity: str) -> str:
    number, unit = re.fullmatch(r"(\d+)(Mi|Gi)", quantity).groups()  # type: ignore[union-attr]
    return f"{int(number) * (1024 if unit == 'Gi' else 1)}m"


def run_arguments(config_dir: Path, ports: dict[str, int]) -> list[str]:
    """`podman run` arguments for the DaemonSet's exporter container as the kubelet would start it, listening on
    loopback ports of this host instead of the pod's (host network: the tests' HTTP goes to loopback)."""
    pod = _manifest("DaemonSet")["spec"]["template"]["spec"]
    container = next(c for c in pod["containers"] if c["name"] == "gpuwarden")
    security = {**pod["securityContext"], **container["securityContext"]}
    arguments = ["--network", "host", *ULIMITS, "--user", f"{security['runAsUser']}:{security['runAsGroup']}"]
    if security["readOnlyRootFilesystem"]:
        arguments += ["--read-only", "--read-only-tmpfs=false"]  # only what the pod mounts is writable
    arguments += [f"--cap-drop={cap}" for cap in security["capabilities"]["drop"]]
    if security["allowPrivilegeEscalation"] is False:
        arguments += ["--security-opt", "no-new-privileges"]
    assert not security.get("privileged")
    arguments += ["--memory", _megabytes(container["resources"]["limits"]["memory"])]
    volumes = {v["name"]: v for v in pod["volumes"]}
    for mount in container["volumeMounts"]:
        volume = volumes[mount["name"]]
        if "configMap" in volume:
            arguments += ["--volume", f"{config_dir}:{mount['mountPath']}:ro"]
        elif "emptyDir" in volume:
            arguments += ["--tmpfs", f"{mount['mountPath']}:size={_megabytes(volume['emptyDir']['sizeLimit'])}"]
        else:
            raise AssertionError(f"the test does not know how to mount volume {mount['name']}: {volume}")
    arguments += [f"--env={e['name']}={e['value']}" for e in container.get("env", [])]
    listen = {"--web.listen-address": ports["metrics"], "--web.probe-listen-address": ports["probes"]}
    flags = [
        f"{a.split('=', 1)[0]}=127.0.0.1:{listen[a.split('=', 1)[0]]}" if a.split("=", 1)[0] in listen else a
        for a in container["args"]
    ]
    return [*arguments, IMAGE, *flags, "--sim"]


@pytest.fixture(scope="module")
def containers() -> Iterator[Containers]:
    if reason := _missing():
        pytest.skip(reason)
    storage = Path(tempfile.mkdtemp(prefix="gw-img-"))  # short: podman's sockets live under the run root
    parts = Containers(storage)
    try:
        version = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
        parts.build_image(parts.build_base(), version)
        yield parts
    finally:
        parts.remove_all()


def test_image_runs_as_the_daemonset_runs_it_and_serves_metrics_and_probes(
    containers: Containers, tmp_path: Path
) -> None:
    config_dir = tmp_path / "config"
    config_dir.mkdir()
    for name, text in _manifest("ConfigMap")["data"].items():
        (config_dir / name).write_text(text)
    ports = {"metrics": free_port(), "probes": free_port()}
    name = "gpuwarden-image-test"
    _run(*containers.podman, "run", "--detach", "--name", name, *run_arguments(config_dir, ports))
    try:
        wait_ready(f"http://127.0.0.1:{ports['probes']}/readyz", timeout=120)
        assert httpx.get(f"http://127.0.0.1:{ports['probes']}/healthz", timeout=5).status_code == 200
        text = httpx.get(f"http://127.0.0.1:{ports['metrics']}/metrics", timeout=10).text
        families = {f.name: f for f in text_string_to_metric_families(text)}
        gpus = families["gpuwarden_gpus"].samples[0].value
        assert gpus > 0 and gpus == sum(s.value == 1 for s in families["gpuwarden_gpu_up"].samples)
        version = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
        assert families["gpuwarden_build_info"].samples[0].labels["version"] == version
        # the process is the manifest's user, not root, and nothing outside /tmp is writable
        state = containers.inspect(name)
        pod_user = _manifest("DaemonSet")["spec"]["template"]["spec"]["securityContext"]["runAsUser"]
        assert _run(*containers.podman, "exec", name, "id", "-u").strip() == str(pod_user)
        probe = "import pathlib; pathlib.Path('/usr/local/x').write_text('x')"
        written = subprocess.run([*containers.podman, "exec", name, "python", "-c", probe], capture_output=True)
        assert written.returncode != 0 and b"Read-only file system" in written.stderr
        # the mounted config was read: its `log.format: json` makes every line JSON
        logged = subprocess.run([*containers.podman, "logs", name], capture_output=True, text=True)
        logs = logged.stdout + logged.stderr
        lines = [json.loads(line) for line in logs.splitlines() if line.strip()]
        assert lines and not [line for line in lines if line.get("level") in ("error", "critical")], logs
        assert state["State"]["Running"]
    finally:
        grace = _manifest("DaemonSet")["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
        subprocess.run([*containers.podman, "stop", "--time", str(grace), name], capture_output=True, check=False)
    # SIGTERM ends it cleanly within the pod's grace period (137 would be the kill after it)
    assert containers.inspect(name)["State"]["ExitCode"] == 0


def test_image_has_the_manifest_user_labels_and_no_build_tools(containers: Containers) -> None:
    config = containers.inspect(IMAGE)["Config"]
    pod = _manifest("DaemonSet")["spec"]["template"]["spec"]["securityContext"]
    assert config["User"] == f"{pod['runAsUser']}:{pod['runAsGroup']}"  # `docker run` without the chart agrees
    version = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    assert config["Labels"]["org.opencontainers.image.version"] == version
    assert config["Entrypoint"] == ["gpuwarden"]
    for module in ("pip", "setuptools"):
        result = subprocess.run(
            [*containers.podman, "run", "--rm", *ULIMITS, "--entrypoint", "python", IMAGE, "-c", f"import {module}"],
            capture_output=True,
            text=True,
        )
        assert result.returncode != 0 and "ModuleNotFoundError" in result.stderr, (module, result.stderr)
