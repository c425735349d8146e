"""A multi-node job's straggler, named across nodes from what every node's exporter says of its own ranks.

Each node judges its ranks over its job view's window (20 s) with the job's usual waits (exporter/gpuwarden/jobs/):
- a node that holds the straggler beside ranks that wait for it names it itself (`gpuwarden_job_finding`,
  kind straggler or collective_hang, with its GPU, rank and cause): the fleet reports that;
- a node whose every rank waits, more than they usually do, says the straggler is off it (kind waiting_elsewhere):
  the fleet names the GPUs of the job on the other nodes that do not wait now (their wait counter's rate over the
  last scrape interval at most STRAGGLER_SHARE), the least waiting first.
Nothing here reads a long window: the findings are the exporter's current judgement, and the counter's last
interval is one scrape old, so a job that has run for hours is named as fast as a new one (before, the waiters'
class over `bottleneck_window_s` had to turn, 254 s for a job that had run a while). A warm-up's skew or a
pipeline's built-in imbalance makes no node say waiting_elsewhere (no onset), so the fleet names no one for them.
"""

from __future__ import annotations

from typing import Any

STRAGGLER_SHARE = 0.2  # a GPU that waited at most this share of the last scrape interval is not waiting now
NAMED_KINDS = ("straggler", "collective_hang")
ELSEWHERE = "waiting_elsewhere"
JOB_WINDOW = "1m"  # the wait counter's rate for the page; its last interval (irate) for who waits now


def stragglers_of(gpus: list[dict[str, Any]], findings: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The GPUs holding one job back, each with its node, rank and cause ("" where its node cannot say), from the
    job's GPUs (node, gpu, uuid, rank, wait_share, now_share) and its nodes' findings (node, kind, uuid, cause)."""
    return _named_by_their_nodes(gpus, findings) or _off_the_waiting_nodes(gpus, findings)


def _named_by_their_nodes(gpus: list[dict[str, Any]], findings: list[dict[str, Any]]) -> list[dict[str, Any]]:
    row = {(g["node"], g["uuid"]): g for g in gpus}
    named = [f for f in findings if f["kind"] in NAMED_KINDS]
    found = [{**row[key], "cause": f.get("cause", ""), "kind": f["kind"]} for f in named if (key := _key(f)) in row]
    keys = {_key(s) for s in found}
    return _with_waiters(found, [g for g in gpus if _key(g) not in keys and g["now_share"] > STRAGGLER_SHARE])


def _off_the_waiting_nodes(gpus: list[dict[str, Any]], findings: list[dict[str, Any]]) -> list[dict[str, Any]]:
    elsewhere = {f["node"] for f in findings if f["kind"] == ELSEWHERE}
    idle = [g for g in gpus if elsewhere and g["node"] not in elsewhere and g["now_share"] <= STRAGGLER_SHARE]
    idle.sort(key=lambda g: (g["now_share"], g["wait_share"]))
    found = [{**g, "cause": "", "kind": "straggler"} for g in idle]
    return _with_waiters(found, [g for g in gpus if g["node"] in elsewhere])


def _key(item: dict[str, Any]) -> tuple[str, str]:
    return item["node"], item["uuid"]


def _with_waiters(found: list[dict[str, Any]], waiting: list[dict[str, Any]]) -> list[dict[str, Any]]:
    nodes = sorted({g["node"] for g in waiting})
    return [{**s, "waiting_gpus": len(waiting), "waiting_nodes": nodes} for s in found]
