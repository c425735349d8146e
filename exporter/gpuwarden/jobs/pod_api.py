"""A GPU process's pod as the Kubernetes API server knows it: its labels and its containers' environment.

A GPU process's pod as the Kubernetes API server knows it: its labels (the training operator's job: Kubeflow,
JobSet, Volcano, LeaderWorkerSet, an Indexed Job) and its containers' literal environment, which is what the
operator wrote for the launcher (MASTER_ADDR/PORT, RANK, PET_*): the same variables an exporter running as root
reads from /proc/PID/environ, for an exporter that may not read another user's.

Least privilege: `get` on pods, no list or watch (the kubelet's /pods would need nodes/proxy, which also opens exec
into every pod of the node). A pod is asked for once, by the namespace and name its log folder gives
(attribution/host.py), checked against the UID its cgroup gives (a pod recreated under the same name is another
pod), on a lookup thread of its own: the jobs step never waits on the network. Answers are kept while the pod is on a
GPU; a failure is asked again after RETRY_S. Only literal values of the launcher variables are kept (never a secret
reference, never another variable).
"""

from __future__ import annotations

import json
import logging
import os
import ssl
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from gpuwarden.attribution.host import BackgroundLookups
from gpuwarden.jobs import launchers, sources

log = logging.getLogger(__name__)

TIMEOUT_S = 5.0
RETRY_S = 30.0
MAX_POD_BYTES = 1024 * 1024
MAX_PODS = 4096
SERVICE_ACCOUNT = Path("/var/run/secrets/kubernetes.io/serviceaccount")

# label naming a training operator's job → the key's kind; LeaderWorkerSet's groups are each a job of their own
JOB_LABELS = (
    ("training.kubeflow.org/job-name", "kubeflow"),
    ("trainer.kubeflow.org/trainjob-name", "trainjob"),
    ("jobset.sigs.k8s.io/jobset-name", "jobset"),
    ("volcano.sh/job-name", "volcano"),
    ("leaderworkerset.sigs.k8s.io/name", "lws"),
    ("batch.kubernetes.io/job-name", "job"),
)
LWS_GROUP = "leaderworkerset.sigs.k8s.io/group-index"


@dataclass(frozen=True)
class PodFacts:
    """What the API server said of one pod: its labels, and per container its launcher variables (literal values
    only) and its container ID."""

    uid: str
    namespace: str
    labels: dict[str, str] = field(default_factory=dict)
    env: dict[str, dict[str, str]] = field(default_factory=dict)  # container name → launcher variables
    container_ids: dict[str, str] = field(default_factory=dict)  # container ID (hex) → container name

    def variables(self, container_id: str) -> dict[str, str]:
        """The launcher variables of the process's container (by its cgroup's container ID), else of the pod's only
        container; {} where neither is known."""
        name = self.container_ids.get(container_id)
        if name is None and len(self.env) == 1:
            name = next(iter(self.env))
        return self.env.get(name or "", {})

    def job_key(self) -> str:
        """The operator's job as a key, the same on every node: `<namespace>/<kind>/<name>`; "" where no label."""
        for label, kind in JOB_LABELS:
            name = self.labels.get(label, "")
            if launchers.safe(name):
                group = self.labels.get(LWS_GROUP, "") if kind == "lws" else ""
                return f"{self.namespace}/{kind}/{name}" + (f"/{group}" if group.isdigit() else "")
        return ""


def parse_pod(document: dict) -> PodFacts:
    """PodFacts from a v1 Pod object (a JSON dict); missing or odd fields are skipped, never a crash."""
    metadata = document.get("metadata") or {}
    labels = {str(k): str(v) for k, v in (metadata.get("labels") or {}).items() if isinstance(v, str)}
    env: dict[str, dict[str, str]] = {}
    for container in (document.get("spec") or {}).get("containers") or []:
        literal = [(e.get("name"), e.get("value")) for e in container.get("env") or [] if isinstance(e, dict)]
        raw = b"".join(f"{n}={v}\0".encode() for n, v in literal if isinstance(n, str) and isinstance(v, str))
        env[str(container.get("name", ""))] = launchers.parse_environ(raw)
    ids = {}
    for status in (document.get("status") or {}).get("containerStatuses") or []:
        runtime_id = str(status.get("containerID") or "")  # containerd://<64 hex>
        ids[runtime_id.rpartition("://")[2]] = str(status.get("name", ""))
    return PodFacts(str(metadata.get("uid", "")), str(metadata.get("namespace", "")), labels, env, ids)


def in_cluster_url() -> str:
    host, port = os.environ.get("KUBERNETES_SERVICE_HOST", ""), os.environ.get("KUBERNETES_SERVICE_PORT", "443")
    if not host:
        return ""
    return f"https://[{host}]:{port}" if ":" in host else f"https://{host}:{port}"


class PodApi:
    """Pods by namespace, name and UID from the API server, fetched on a lookup thread; records the source state."""

    def __init__(
        self,
        server: str,
        token_file: Path,
        ca_file: Path | None,
        states: sources.SourceStates,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._server = (in_cluster_url() if server == "in-cluster" else server).rstrip("/")
        self._token_file = token_file
        self._context = ssl.create_default_context(cafile=str(ca_file) if ca_file else None)
        self.states = states  # the jobs step's: this source's state joins the others'
        self._clock = clock
        self._pods: dict[str, PodFacts] = {}
        self._failed: dict[str, float] = {}  # UID → when its last fetch failed
        self._lock = threading.Lock()
        self.lookups = BackgroundLookups()
        if not self._server:
            log.warning("pods.api_server in-cluster: KUBERNETES_SERVICE_HOST is not set; pod labels stay unread")
            states.record(sources.POD_API, False)
        else:
            log.info("job identity sources: pod_api %s (get on pods: the operator's labels and launcher variables)",
                     self._server)  # fmt: skip

    def facts(self, namespace: str, name: str, uid: str) -> PodFacts | None:
        """The pod's facts if fetched; otherwise None, and a fetch is queued (at most every RETRY_S after a
        failure)."""
        with self._lock:
            known = self._pods.get(uid)
            failed_at = self._failed.get(uid)
        if known is not None or not (self._server and namespace and name and uid):
            return known
        if failed_at is None or self._clock() - failed_at >= RETRY_S:
            self.lookups.submit(f"pod {uid}", lambda: self._fetch(namespace, name, uid))
        return None

    def retain(self, uids: set[str]) -> None:
        """Forget pods no GPU process runs in any more."""
        with self._lock:
            self._pods = {uid: pod for uid, pod in self._pods.items() if uid in uids}
            self._failed = {uid: at for uid, at in self._failed.items() if uid in uids}

    def _fetch(self, namespace: str, name: str, uid: str) -> None:
        url = f"{self._server}/api/v1/namespaces/{namespace}/pods/{name}"
        try:
            token = self._token_file.read_text(encoding="utf-8").strip()  # re-read: projected tokens rotate
            request = urllib.request.Request(
                url, headers={"Authorization": f"Bearer {token}", "Accept": "application/json"}
            )
            with urllib.request.urlopen(request, timeout=TIMEOUT_S, context=self._context) as answer:  # noqa: S310
                found = parse_pod(json.loads(answer.read(MAX_POD_BYTES)))
        except (OSError, ValueError, urllib.error.URLError) as exc:
            self._fail(uid, f"pod {namespace}/{name}: {exc}")
            return
        self.states.record(sources.POD_API, True)
        with self._lock:
            if found.uid != uid:  # recreated under the same name: not this process's pod
                self._failed[uid] = self._clock()
                return
            if len(self._pods) >= MAX_PODS:
                self._pods.clear()
            self._pods[uid] = found
            self._failed.pop(uid, None)

    def _fail(self, uid: str, why: str) -> None:
        was_up = self.states.snapshot().get(sources.POD_API, True)
        self.states.record(sources.POD_API, False)
        if was_up:  # one line per outage, not one per pod
            log.warning("pod API: %s; pod labels stay unread until it answers (retried every %.0f s)", why, RETRY_S)
        with self._lock:
            self._failed[uid] = self._clock()
