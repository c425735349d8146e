"""The node's health document (`GET /api/v1/health`): every GPU's verdicts and nothing else, what npd-plugin and
slurm-healthcheck act on. Built from a snapshot with the standard library only, so that the front serves it without
loading the JSON API's framework: node-problem-detector asks every 30 s on every node, and FastAPI with pydantic cost
+10.8 MiB on the simulator (up to +30 MiB on a GPU host) in a process that otherwise only serves scrapes. The JSON
API keeps the route's schema (NodeHealth) for its OpenAPI document; tests/test_webserver.py holds the two bodies
equal.
"""

from __future__ import annotations

import json
import threading
from typing import Any

from gpuwarden.model.snapshot import Snapshot


def node_health(snap: Snapshot, expected_gpus: int) -> dict[str, Any]:
    """Every GPU's verdicts and nothing else: what the remediation commands (npd-plugin, slurm-healthcheck) read,
    a few KB where /api/v1/gpus is a few hundred."""
    return {
        "taken_at": snap.taken_at,
        "nvml_up": snap.nvml_up,
        "nvml_error": snap.nvml_error,
        "gpus_expected": expected_gpus or None,
        "gpus_skipped": {str(index): reason for index, reason in sorted(snap.gpus_skipped.items())},
        "gpus": [
            {
                "index": gpu.index,
                "uuid": gpu.uuid,
                "up": gpu.up,
                "stale": gpu.stale,
                "checks": {
                    v.check: {
                        "level": v.level,
                        "severity": v.severity,
                        "observed": v.observed,
                        "threshold": v.threshold,
                        "since": v.since if v.level else None,  # null while ok, as the API has always answered
                        # pending: the level it can reach, which npd-plugin and slurm-healthcheck report as unknown
                        "pending_level": v.pending_level or None,
                    }
                    for v in snap.health.get(gpu.uuid, ())
                },
            }
            for gpu in snap.gpus
        ],
        # the node's jobs judged as one (jobs/collective.py): a straggler or hang is the job's, not a GPU fault,
        # so it is beside the GPUs' checks and never in them (npd-plugin and slurm-healthcheck do not drain for it)
        "jobs": [
            {
                "job": found.job,
                "kind": found.kind,
                "straggler": found.straggler,
                "cause": found.cause,
                "detail": found.cause_detail,
                "waiting": [{"uuid": uuid, "wait_share": share} for uuid, share in found.waiting],
                "since": found.since,
            }
            for found in snap.collective
        ],
    }


def encode(document: dict[str, Any]) -> bytes:
    """JSON as the JSON API's responses encode it (compact, UTF-8, no NaN)."""
    return json.dumps(document, ensure_ascii=False, allow_nan=False, indent=None, separators=(",", ":")).encode()


class HealthBodies:
    """The encoded document, built once per snapshot (and expected GPU count) however many ask."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._key: tuple[int, float, int] | None = None
        self._body = b""

    def body(self, snapshot: Snapshot, expected_gpus: int) -> bytes:
        key = (snapshot.id, snapshot.taken_at, expected_gpus)
        with self._lock:
            if key != self._key:
                self._body, self._key = encode(node_health(snapshot, expected_gpus)), key
            return self._body
