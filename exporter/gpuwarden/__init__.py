"""gpuwarden: an NVIDIA GPU exporter for Prometheus that stays truthful when GPUs misbehave."""

__version__ = "0.1.0"
