"""Snapshot to Prometheus text: rendering, the text format writer, build info."""
