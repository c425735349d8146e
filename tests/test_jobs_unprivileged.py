"""The job view as deployed (issue 49, acceptance 2): the exporter runs as an unprivileged user (`nobody`, every
capability dropped, no new privileges: as the Helm chart's UID 10045 and the systemd unit's DynamicUser run it)
against processes of another user, and keys their jobs and ranks as an exporter running as root does.

- torchrun: real processes of another user (UID 1): an agent whose command line is torchrun's (a script named
  torchrun, as the console script is) and its two workers, with torchrun's variables; the real /proc, where the
  kernel refuses `nobody` their environment.
- Slurm (srun running torchrun; a cgroup v2 layout) and a Kubeflow PyTorchJob's pod (torchrun under the operator's
  PET_ variables, the pod's spec served by an API server on loopback over TLS): a /proc tree written here, its
  environ files root's and mode 0600, because neither slurmstepd's cgroups nor a kubelet can be made on this
  machine.

Both exporters run the simulator with the ranks as the GPUs' holders; the keys and ranks come from /metrics
(gpuwarden_job_collective_wait_seconds_total{job_id,rank}). Needs root (to start processes as other users), as CI
runs.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import ssl
import subprocess
import sys
import tempfile
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from tests.helpers.common import free_port, wait_for
from tests.helpers.stack import FAST_EXPORTER_FLAGS, wait_ready

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(os.geteuid() != 0, reason="starts processes as other users (CI runs as root)"),
    pytest.mark.skipif(shutil.which("setpriv") is None, reason="util-linux setpriv"),
]

ROOT = Path(__file__).resolve().parents[1]
NOBODY = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", "--inh-caps=-all", "--bounding-set=-all",
          "--no-new-privs"]  # fmt: skip
OTHER_USER = ["setpriv", "--reuid=1", "--regid=1", "--clear-groups"]  # `daemon`: the jobs' owner
POD_UID = "3f1c2a4e-8b7d-4c1e-9a55-2d6f0e7b1c90"
CONTAINER = "8f" * 32
TOKEN = "gpuwarden-test-token"

AGENT = """
import os, subprocess, time
workers = []
for local in range(2):
    env = dict(os.environ, MASTER_ADDR="10.0.0.5", MASTER_PORT="29500", TORCHELASTIC_RUN_ID="run42",
               RANK=str(2 + local), LOCAL_RANK=str(local), WORLD_SIZE="4", TORCHELASTIC_RESTART_COUNT="0")
    workers.append(subprocess.Popen(["/bin/sleep", "600"], env=env))
print(" ".join(str(w.pid) for w in workers), flush=True)
time.sleep(600)
"""


@pytest.fixture
def world() -> Iterator[Path]:
    """A folder every user may read (pytest's own tmp is root's alone)."""
    folder = Path(tempfile.mkdtemp(prefix="gpuwarden-unpriv-"))
    folder.chmod(0o755)
    yield folder
    shutil.rmtree(folder, ignore_errors=True)


def scenario(world: Path, name: str, pids: list[int]) -> Path:
    path = world / f"{name}.yaml"
    path.write_text(yaml.safe_dump({
        "name": name,
        "node": {"model": "h100-sxm-80gb", "count": len(pids), "nvlink": "nvswitch"},
        "processes": [{"gpu": g, "pid": pid, "memory_gib": {"constant": 40}} for g, pid in enumerate(pids)],
    }))  # fmt: skip
    path.chmod(0o644)
    return path


def run_exporter(world: Path, name: str, prefix: list[str], *flags: str) -> tuple[subprocess.Popen, str, Path]:
    port = free_port()
    log = world / f"{name}.log"
    env = dict(os.environ, PYTHONPATH=str(ROOT / "exporter"), HOME="/nonexistent")
    args = [*prefix, sys.executable, "-m", "gpuwarden", "--sim", "--web.listen-address", f"127.0.0.1:{port}",
            "--no-pods.attribution", "--nvml.kernel-log=off", *FAST_EXPORTER_FLAGS, *flags]  # fmt: skip
    with log.open("wb") as out:
        process = subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=world)
    return process, f"http://127.0.0.1:{port}", log


def jobs_of(url: str) -> dict[str, tuple[str, str]]:
    """GPU → (job_id, rank) of the GPUs in multi-GPU jobs, from /metrics."""
    text = httpx.get(url + "/metrics", timeout=5).text
    samples = [s for family in text_string_to_metric_families(text) for s in family.samples]
    return {
        s.labels["gpu"]: (s.labels["job_id"], s.labels["rank"])
        for s in samples
        if s.name == "gpuwarden_job_collective_wait_seconds_total"
    }


def sources_of(url: str) -> dict[str, float]:
    text = httpx.get(url + "/metrics", timeout=5).text
    samples = [s for family in text_string_to_metric_families(text) for s in family.samples]
    return {s.labels["source"]: s.value for s in samples if s.name == "gpuwarden_job_identity_source_up"}


def as_root_and_as_nobody(world: Path, name: str, expected: dict[str, tuple[str, str]], *flags: str) -> dict:
    """Both exporters' jobs once each shows `expected`; the unprivileged one's source states and log."""
    runs = {who: run_exporter(world, f"{name}-{who}", prefix, *flags) for who, prefix in (("root", []),
                                                                                       ("nobody", NOBODY))}  # fmt: skip
    try:
        for _, url, _ in runs.values():
            wait_ready(url + "/healthz")
        for who, (_, url, log) in runs.items():
            seen: dict = {}

            def keyed(url: str = url, seen: dict = seen) -> bool:
                seen.update(jobs_of(url))
                return seen == expected

            try:
                wait_for(keyed, timeout=60, step=0.5)
            except AssertionError:
                raise AssertionError(f"{who}: {seen} != {expected}\n{log.read_text()[-3000:]}") from None
        _, url, log = runs["nobody"]
        return {"sources": sources_of(url), "log": log.read_text()}
    finally:
        for process, _, _ in runs.values():
            process.terminate()
            process.wait(15)


def test_real_torchrun_ranks_of_another_user_are_keyed_as_root_keys_them(world: Path) -> None:
    script = world / "torchrun"
    script.write_text(AGENT)
    script.chmod(0o755)
    argv = [sys.executable, str(script), "--nnodes", "2", "--node-rank", "1", "--nproc-per-node", "2",
            "--master-addr", "10.0.0.5", "--master-port", "29500", "--rdzv-id", "run42", "train.py"]  # fmt: skip
    agent = subprocess.Popen([*OTHER_USER, *argv], stdout=subprocess.PIPE, text=True, start_new_session=True)
    try:
        workers = [int(pid) for pid in agent.stdout.readline().split()]  # type: ignore[union-attr]
        assert len(workers) == 2 and all(os.stat(f"/proc/{pid}").st_uid == 1 for pid in workers)
        path = scenario(world, "torchrun", workers)
        result = as_root_and_as_nobody(
            world, "torchrun", {"0": ("10.0.0.5:29500/run42", "2"), "1": ("10.0.0.5:29500/run42", "3")},
            "--nvml.scenario", str(path), "--processes.proc-root", "/proc",
        )  # fmt: skip
    finally:
        os.killpg(agent.pid, signal.SIGTERM)  # the agent and its workers: the session this test started
        agent.wait(15)
    assert result["sources"] == {"cgroup": 1.0, "cmdline": 1.0, "environ": 0.0}, result["sources"]
    assert "job identity sources: cgroup ok, cmdline ok, environ unreadable" in result["log"]


# --- Slurm and Kubernetes: /proc written here -------------------------------------------------------------------


def write(path: Path, data: bytes | str, mode: int = 0o644) -> None:
    path.parent.mkdir(mode=0o755, parents=True, exist_ok=True)
    path.write_bytes(data.encode() if isinstance(data, str) else data)
    path.chmod(mode)


def process(root: Path, pid: int, ppid: int, cgroup: str, argv: list[str], environ: dict[str, str],
            children: tuple[int, ...] = ()) -> None:  # fmt: skip
    """One /proc entry as the kernel shows it to another user: environ root's and 0600, the rest world-readable."""
    base = root / str(pid)
    write(base / "stat", f"{pid} (python3) S {ppid} {pid} {pid} 0 -1 0 0 0 0 0 0 0 0 0 20 0 1 0 {pid} 0 0\n")
    write(base / "status", f"Name:\tpython3\nPPid:\t{ppid}\nUid:\t1\t1\t1\t1\n")
    write(base / "comm", "python3\n")
    write(base / "cgroup", cgroup)
    write(base / "cmdline", b"".join(a.encode() + b"\0" for a in argv))
    write(base / "environ", b"".join(f"{k}={v}\0".encode() for k, v in environ.items()), mode=0o600)
    write(base / "task" / str(pid) / "children", "".join(f"{c} " for c in children))
    write(base / "task" / str(pid) / "stat", f"{pid} (python3) R {ppid} 1 2\n")


def slurm_and_kubeflow(world: Path) -> Path:
    """Slurm job 812's node 1 (srun → torchrun → two workers) and a PyTorchJob's worker pod (torchrun with the
    operator's PET_ variables → two workers)."""
    root = world / "proc"
    write(root / "self" / "stat", "")
    process(root, 1, 0, "0::/init.scope\n", ["/sbin/init"], {"HOME": "/"})
    slurm = "0::/system.slice/slurmstepd.scope/job_812/step_0/user/task_0\n"
    torchrun = ["/usr/bin/python3", "/usr/local/bin/torchrun", "--nnodes", "2", "--node-rank", "1",
                "--nproc-per-node", "2", "--master-addr", "node-a", "--master-port", "29500", "train.py"]  # fmt: skip
    process(root, 900, 1, slurm, torchrun, {"SLURM_JOB_ID": "812"}, children=(901, 902))
    for local, pid in enumerate((901, 902)):
        variables = {"SLURM_JOB_ID": "812", "RANK": str(2 + local), "LOCAL_RANK": str(local), "WORLD_SIZE": "4",
                     "MASTER_ADDR": "node-a", "MASTER_PORT": "29500", "TORCHELASTIC_RUN_ID": "none"}  # fmt: skip
        process(root, pid, 900, slurm, ["/usr/bin/python3", "-u", "train.py"], variables)
    pod = (f"0::/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{POD_UID.replace('-', '_')}.slice/"
           f"cri-containerd-{CONTAINER}.scope\n")  # fmt: skip
    spec = pod_spec_env()
    process(root, 950, 940, pod, ["/usr/bin/python3", "/usr/local/bin/torchrun", "train.py"], spec,
            children=(951, 952))  # fmt: skip
    for local, pid in enumerate((951, 952)):
        worker = {**spec, "RANK": str(2 + local), "LOCAL_RANK": str(local), "WORLD_SIZE": "4",
                  "TORCHELASTIC_RUN_ID": "none"}  # fmt: skip
        process(root, pid, 950, pod, ["/usr/bin/python3", "-u", "train.py"], worker)
    (world / "pods" / f"ml_llama-ft-worker-0_{POD_UID}" / "pytorch").mkdir(mode=0o755, parents=True)
    return root


def pod_spec_env() -> dict[str, str]:
    """What the training operator writes into the worker pod's spec (node rank 1 of 2, two processes a node)."""
    return {"MASTER_ADDR": "llama-ft-master-0", "MASTER_PORT": "23456", "PET_MASTER_ADDR": "llama-ft-master-0",
            "PET_MASTER_PORT": "23456", "PET_NNODES": "2", "PET_NPROC_PER_NODE": "2", "PET_NODE_RANK": "1",
            "RANK": "1", "WORLD_SIZE": "2"}  # fmt: skip


class FakeApiServer:
    """GET /api/v1/namespaces/ml/pods/llama-ft-worker-0 over TLS on loopback, for the bearer token only."""

    def __init__(self, world: Path) -> None:
        import trustme

        ca = trustme.CA()
        self.ca_file = world / "ca.crt"
        ca.cert_pem.write_to_path(str(self.ca_file))
        self.ca_file.chmod(0o644)
        context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        ca.issue_cert("127.0.0.1").configure_cert(context)
        self.token_file = world / "token"
        self.token_file.write_text(TOKEN)
        self.token_file.chmod(0o644)
        pod = {
            "metadata": {"name": "llama-ft-worker-0", "namespace": "ml", "uid": POD_UID,
                         "labels": {"training.kubeflow.org/job-name": "llama-ft",
                                    "training.kubeflow.org/replica-type": "worker"}},
            "spec": {"containers": [{"name": "pytorch", "env": [{"name": k, "value": v} for k, v in
                                                               pod_spec_env().items()]
                                     + [{"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": "hf"}}}]}]},
            "status": {"containerStatuses": [{"name": "pytorch", "containerID": f"containerd://{CONTAINER}"}]},
        }  # fmt: skip
        self.asked: list[str] = []
        asked = self.asked

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 - the standard library's name
                asked.append(self.path)
                authorised = self.headers.get("Authorization") == f"Bearer {TOKEN}"
                found = self.path == "/api/v1/namespaces/ml/pods/llama-ft-worker-0"
                code = 200 if authorised and found else 403 if not authorised else 404
                body = json.dumps(pod if code == 200 else {"kind": "Status", "code": code}).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *_: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.socket = context.wrap_socket(self.server.socket, server_side=True)
        self.url = f"https://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def test_slurm_and_a_training_operators_pods_are_keyed_as_root_keys_them(world: Path) -> None:
    root = slurm_and_kubeflow(world)
    path = scenario(world, "slurm-kubeflow", [901, 902, 951, 952])
    api = FakeApiServer(world)
    try:
        result = as_root_and_as_nobody(
            world,
            "slurm-kubeflow",
            {"0": ("slurm/812", "2"), "1": ("slurm/812", "3"),
             "2": ("ml/llama-ft-master-0:23456", "2"), "3": ("ml/llama-ft-master-0:23456", "3")},
            "--nvml.scenario", str(path), "--processes.proc-root", str(root),
            "--processes.pod-logs-root", str(world / "pods"), "--pods.api-server", api.url,
            "--pods.api-token-file", str(api.token_file), "--pods.api-ca-file", str(api.ca_file),
        )  # fmt: skip
    finally:
        api.stop()
    assert result["sources"] == {"cgroup": 1.0, "cmdline": 1.0, "environ": 0.0, "pod_api": 1.0}, result["sources"]
    assert set(api.asked) == {"/api/v1/namespaces/ml/pods/llama-ft-worker-0"}  # one pod, by name: no list
