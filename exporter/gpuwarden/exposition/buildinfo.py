"""Versions for gpuwarden_build_info, read from package metadata (importing nothing of NVML)."""

from __future__ import annotations

import importlib.util
from pathlib import Path


def nvml_binding_version() -> str:
    """Version of nvidia-ml-py, the Python binding that talks to libnvidia-ml.

    Read from the name of the `nvidia_ml_py-<version>.dist-info` folder beside the binding's module, where pip
    installs it:
    importlib.metadata would cost 0.5 MiB of imports and a scan of every folder on sys.path at start. Elsewhere
    (an egg, a zip) it falls back to importlib.metadata."""
    spec = importlib.util.find_spec("pynvml")
    if spec is not None and spec.origin:
        for info in Path(spec.origin).parent.glob("nvidia_ml_py-*.dist-info"):
            return info.name.removeprefix("nvidia_ml_py-").removesuffix(".dist-info")
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("nvidia-ml-py")
    except PackageNotFoundError:
        return "unknown"
