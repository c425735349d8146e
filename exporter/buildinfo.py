"""Versions for gpuwarden_build_info, read from package metadata (importing nothing of NVML)."""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version


def nvml_binding_version() -> str:
    """Version of nvidia-ml-py, the Python binding that talks to libnvidia-ml."""
    try:
        return version("nvidia-ml-py")
    except PackageNotFoundError:
        return "unknown"
