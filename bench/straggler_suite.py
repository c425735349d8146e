"""Real jobs on a GPU host with gpuwarden watching from outside (issue 37): stragglers injected into a running DDP
job, and the diagnosis suite's jobs one after another.

`stragglers`: one DDP job (bench/workloads/train.py under torchrun, NCCL, one rank per GPU) runs for the whole call.
In turn, each injection (`kind:rank`) makes one rank a straggler for `--straggle-s` from a known instant (the job
reads its schedule file each step), then the job recovers until gpuwarden's job findings clear, then the next one.
Causes: `cpu` (Python work on the rank's main thread), `sleep`, `input` (the rank's loader workers spend CPU on every
sample), `gpu` (a bf16 matmul process started on the rank's GPU: a co-located tenant), `hang` (the rank stops; the
others wait in the next all-reduce: last, since the job does not recover). With `--nodes 2` the job is launched as a
two-node job (two torchrun agents with a c10d rendezvous on a non-loopback address, one GPU each) and two more
exporters each watch one GPU (`--nvml.devices`), scraped by a real Prometheus (`--prometheus PATH`) as nodes `node-a`
and `node-b`, with `gpuwarden fleet` over it: the fleet's job view is read with every sample.

`suite`: each named job of SUITE runs `--job-s` once it holds its GPUs; `a+b` runs two one-GPU jobs side by side.

Every answer of /api/v1/diagnosis (and the fleet's /api/v1/fleet/jobs) is kept, every 2 s, in samples.jsonl with
the wall time; the injections and runs with their instants in events.jsonl. The classification is done afterwards
(bench/straggler_report.py), not here. Run from the repository root on the GPU host, gpuwarden importable
(bench/source_env.sh):
    python3 bench/straggler_suite.py stragglers --gpus 2 --out OUT --runs cpu:1,input:0,gpu:1,hang:0
    python3 bench/straggler_suite.py suite --out OUT --runs ddp-bf16,fsdp,decode+elementwise
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

PORT = 10047
NODE_PORTS = (10048, 10049)
PROMETHEUS_PORT = 19090
FLEET_PORT = 10046
ROOT = Path(__file__).resolve().parents[1]
TRAIN = str(ROOT / "bench/workloads/train.py")
ENV = {**os.environ, "NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1",
       "PYTHONUNBUFFERED": "1"}  # fmt: skip
HOG = """
import sys, time, torch
torch.cuda.set_device(int(sys.argv[1]))
a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
end = time.time() + float(sys.argv[2])
while time.time() < end:
    (a @ a).sum().item()
"""
# name: (GPUs, train.py arguments, the class a right diagnosis gives, written before the run)
SUITE: dict[str, tuple[int, list[str], str]] = {
    "ddp-bf16": (2, ["--job", "transformer", "--checkpoint-every", "100"], "tensor_bound"),
    "fsdp": (2, ["--job", "fsdp"], "tensor_bound"),
    "comm-heavy": (2, ["--job", "comm-heavy"], "communication_bound"),
    "allreduce": (2, ["--job", "allreduce"], "communication_bound"),
    "pipeline": (2, ["--job", "pipeline"], "no job finding; never launch_bound"),
    "decode": (1, ["--job", "decode"], "launch_bound"),
    "elementwise": (1, ["--job", "elementwise"], "sm_bound_non_matmul"),
    "checkpoint": (1, ["--job", "transformer", "--checkpoint-every", "5"], "waiting: checkpoint"),
    "idle-holder": (1, ["--job", "fill", "--fill-share", "0.15"], "waiting: idle holder"),
    "fp32": (1, ["--job", "transformer", "--precision", "fp32"], "compute_without_tensor"),
    "input-starved": (
        1,
        ["--job", "transformer", "--workers", "2", "--sample-cost", "0.03", "--width", "512", "--layers", "2"],
        "waiting: workers_running",
    ),  # fmt: skip
}
JOB_CHECKS = ("straggler", "collective_hang", "waiting_elsewhere")
EXPORTER_ARGS: list[str] = []  # --exporter-arg: e.g. --nvml.backend=sim to try the driver here without a GPU


def get(port: int, path: str, timeout: float = 10) -> dict:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=timeout) as answer:
        return json.loads(answer.read())


def wait_for(port: int, path: str, what: str) -> None:
    for _ in range(240):
        try:
            get(port, path, timeout=2)
            return
        except OSError:
            time.sleep(0.5)
    raise SystemExit(f"{what} did not answer on port {port}")


def exporter_cgroup(name: str) -> Path:
    """The pod's view: every process of exporter `name`, counted. One cgroup per run: a lent machine kept warm
    between calls still has the last call's, whose cpu.stat and memory.peak would add to this run's (2026-11-29)."""
    return Path(f"/sys/fs/cgroup/gpuwarden-{name}-{os.getpid()}")


def start_exporter(out: Path, name: str, port: int, window: int | None, devices: str | None) -> subprocess.Popen:
    args = [sys.executable, "-m", "gpuwarden", "--web.listen-address", f"127.0.0.1:{port}", "--processes.proc-root",
            "/proc"]  # fmt: skip
    if devices is not None:
        args += ["--nvml.devices", devices]
    args += EXPORTER_ARGS
    if window:
        thresholds = out / "thresholds.yaml"
        thresholds.write_text(f"bottleneck_window_s: {window}\n")
        args += ["--health.thresholds-file", str(thresholds)]
    cgroup = exporter_cgroup(name)
    preexec = None
    try:
        cgroup.mkdir(exist_ok=True)
        preexec = lambda: (cgroup / "cgroup.procs").write_text(str(os.getpid()))  # noqa: E731
    except OSError as error:
        print(f"no cgroup for {name}: {error}", flush=True)
    proc = subprocess.Popen(args, stdout=(out / f"exporter-{name}.log").open("w"), stderr=subprocess.STDOUT,
                            preexec_fn=preexec)  # fmt: skip
    wait_for(port, "/api/v1/gpus" if name == "main" else "/healthz", f"exporter {name}")
    return proc


def start_prometheus(out: Path, binary: str) -> subprocess.Popen:
    config = out / "prometheus.yml"
    targets = [f"{{targets: ['127.0.0.1:{port}'], labels: {{node: {node}}}}}"
               for port, node in zip(NODE_PORTS, ("node-a", "node-b"), strict=True)]  # fmt: skip
    config.write_text(
        "global: {scrape_interval: 5s, evaluation_interval: 5s}\n"
        f"scrape_configs: [{{job_name: gpuwarden, static_configs: [{', '.join(targets)}]}}]\n"
    )
    proc = subprocess.Popen([binary, f"--config.file={config}", f"--storage.tsdb.path={out / 'tsdb'}",
                             f"--web.listen-address=127.0.0.1:{PROMETHEUS_PORT}"],
                            stdout=(out / "prometheus.log").open("w"), stderr=subprocess.STDOUT)  # fmt: skip
    wait_for(PROMETHEUS_PORT, "/api/v1/status/buildinfo", "Prometheus")
    return proc


def start_fleet(out: Path) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-m", "gpuwarden", "fleet", "--prometheus-url",
                             f"http://127.0.0.1:{PROMETHEUS_PORT}", "--web.listen-address", f"127.0.0.1:{FLEET_PORT}",
                             "--node-label", "node", "--cache-ttl", "0", "--refresh-interval", "0"],
                            stdout=(out / "fleet.log").open("w"), stderr=subprocess.STDOUT)  # fmt: skip
    wait_for(FLEET_PORT, "/healthz", "gpuwarden fleet")
    return proc


def rendezvous_address() -> str:
    """A non-loopback address of this host: a job key built on loopback is one node's only (jobs/launchers.py), so a
    two-node job needs the address a second node would dial."""
    probe = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        probe.connect(("10.255.255.255", 1))  # no packet is sent: this picks the interface a route would use
        address = probe.getsockname()[0]
    except OSError:
        address = "127.0.0.1"
    finally:
        probe.close()
    if address.startswith("127."):
        address = "10.77.0.1"  # no route out (a sealed machine): an address of our own on the loopback device
        subprocess.run(["ip", "addr", "add", f"{address}/32", "dev", "lo"], check=False)
    return address


def launch(out: Path, name: str, gpus: int, nodes: int, extra: list[str], seconds: float) -> list[subprocess.Popen]:
    log = (out / f"{name}.job.log").open("w")
    train = [TRAIN, "--seconds", str(seconds), *extra]
    if nodes == 1:
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(gpus), *train]
        return [subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=ENV, start_new_session=True)]
    address = rendezvous_address()
    agents = []
    for node in range(nodes):  # one agent per "node", each seeing its own GPU, as on separate hosts
        command = [sys.executable, "-m", "torch.distributed.run", "--nnodes", str(nodes), "--node-rank", str(node),
                   "--nproc-per-node", "1", "--rdzv-backend", "c10d", "--rdzv-endpoint", f"{address}:29400",
                   "--rdzv-id", f"{name}-job", "--rdzv-conf", f"is_host={str(node == 0).lower()}", "--local-addr",
                   address, *train]  # fmt: skip
        env = {**ENV, "CUDA_VISIBLE_DEVICES": str(node)}
        agents.append(subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True))
    return agents


def launch_single(out: Path, name: str, gpu: int, extra: list[str], seconds: float) -> list[subprocess.Popen]:
    log = (out / f"{name}.job.log").open("w")
    command = [sys.executable, TRAIN, "--seconds", str(seconds), "--gpu", str(gpu), *extra]
    return [subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=ENV, start_new_session=True)]


def descendants(pid: int) -> list[int]:
    """Every process below `pid`: torchrun starts its ranks in sessions of their own, so killing the launcher's
    process group left a hung job's ranks on the GPUs into the next call's runs (2x H200, 2026-11-28)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_text().rpartition(")")[2].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry.name))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def stop(procs: list[subprocess.Popen]) -> None:
    for proc in procs:
        for pid in [proc.pid, *descendants(proc.pid)]:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        proc.wait()


def held_gpus() -> list[int]:
    return [g["index"] for g in get(PORT, "/api/v1/gpus")["gpus"] if g.get("processes")]


def wait_free() -> None:
    """A new job never shares a GPU with a dying one (NVML lists killed processes for a few seconds); a GPU still
    held after a minute ends the call: what follows would judge someone else's job."""
    for _ in range(60):
        if not held_gpus():
            return
        time.sleep(1)
    raise SystemExit(f"GPUs {held_gpus()} are still held by processes of an earlier run")


def wait_held(count: int, limit: float = 150) -> bool:
    started = time.time()
    while time.time() - started < limit:
        if len(held_gpus()) >= count:
            return True
        time.sleep(1)
    return False


class Recorder:
    """Every answer, with its wall time, appended as it comes: a call cut at its limit keeps what it had."""

    def __init__(self, out: Path, fleet: bool) -> None:
        self.samples = (out / "samples.jsonl").open("a")
        self.events = (out / "events.jsonl").open("a")
        self.fleet = fleet

    def event(self, **fields: object) -> None:
        self.events.write(json.dumps({"wall": round(time.time(), 2), **fields}) + "\n")
        self.events.flush()
        print(json.dumps(fields), flush=True)

    def sample(self, label: str) -> list[dict]:
        now = time.time()
        try:
            findings = get(PORT, "/api/v1/diagnosis")["findings"]
        except OSError as error:
            findings = [{"error": str(error)}]
        record: dict[str, object] = {"wall": round(now, 2), "label": label, "findings": findings}
        if self.fleet:
            try:
                record["fleet_jobs"] = get(FLEET_PORT, "/api/v1/fleet/jobs", timeout=30)
            except OSError as error:
                record["fleet_jobs"] = {"error": str(error)}
        self.samples.write(json.dumps(record) + "\n")
        self.samples.flush()
        return findings


def job_findings(findings: list[dict]) -> list[dict]:
    return [f for f in findings if f.get("check") in JOB_CHECKS]


def stragglers(args: argparse.Namespace, recorder: Recorder, deadline: float) -> None:
    schedule = args.out / "schedule.jsonl"
    schedule.write_text("")
    wait_free()
    agents = launch(args.out, "stragglers", args.gpus, args.nodes, ["--schedule", str(schedule)], 3600)
    if not wait_held(args.gpus):
        recorder.event(what="job never held its GPUs")
        stop(agents)
        return
    recorder.event(what="job holds its GPUs", nodes=args.nodes)
    warm_until = time.time() + args.warmup_s
    while time.time() < warm_until:
        recorder.sample("warmup")
        time.sleep(2)
    for spec in args.runs.split(","):
        kind, rank = spec.split(":")
        length = args.straggle_s if kind != "hang" else args.hang_s
        quiet = 0
        while quiet < 2 and time.time() < deadline:  # the last injection's findings gone, twice in a row
            quiet = 0 if job_findings(recorder.sample("recovery")) else quiet + 1
            time.sleep(2)
        if time.time() + length + 4 > deadline:
            recorder.event(what="out of time", skipped=spec)
            break
        onset = time.time() + 2
        hog = None
        if kind == "gpu":
            time.sleep(max(0.0, onset - time.time()))
            gpu = int(rank)
            hog = subprocess.Popen([sys.executable, "-c", HOG, str(gpu), str(length)], stdout=subprocess.DEVNULL,
                                   stderr=subprocess.STDOUT, env=ENV)  # fmt: skip
        else:
            seconds = {"cpu": 0.3, "sleep": 0.3, "input": 0.08, "hang": 0}[kind]
            entry = {"start": onset, "end": onset + length, "rank": int(rank), "kind": kind, "seconds": seconds}
            with schedule.open("a") as handle:
                handle.write(json.dumps(entry) + "\n")
        recorder.event(what="onset", kind=kind, rank=int(rank), onset=onset, end=onset + length)
        while time.time() < onset + length:
            recorder.sample(f"{kind}:{rank}")
            time.sleep(2)
        if hog is not None:
            hog.kill()
            hog.wait()
        recorder.event(what="end", kind=kind, rank=int(rank))
        if kind == "hang":
            break
    stop(agents)


def suite(args: argparse.Namespace, recorder: Recorder, deadline: float) -> None:
    for spec in args.runs.split(","):
        names = spec.split("+")
        if time.time() + args.job_s + 30 > deadline:
            recorder.event(what="out of time", skipped=spec)
            break
        wait_free()
        if len(names) == 1 and SUITE[names[0]][0] == 2:
            procs = launch(args.out, names[0], 2, 1, SUITE[names[0]][1], args.job_s + 120)
            gpus = {names[0]: [0, 1]}
        else:
            procs = [p for gpu, name in enumerate(names)
                     for p in launch_single(args.out, name, gpu, SUITE[name][1], args.job_s + 120)]  # fmt: skip
            gpus = {name: [gpu] for gpu, name in enumerate(names)}
        held = wait_held(sum(len(g) for g in gpus.values()))
        recorder.event(what="run", run=spec, gpus=gpus, held=held,
                       expected={name: SUITE[name][2] for name in names})  # fmt: skip
        until = time.time() + args.job_s
        while held and time.time() < until:
            recorder.sample(spec)
            time.sleep(2)
        stop(procs)
        recorder.event(what="run end", run=spec)


def footprint(out: Path, names: list[str]) -> None:
    """What each exporter's pod pays: PSS and RSS of every process (smaps_rollup) and its cgroup's memory."""
    result = {}
    for name in names:
        cgroup = exporter_cgroup(name)
        entry: dict[str, object] = {}
        try:
            pids = [int(p) for p in (cgroup / "cgroup.procs").read_text().split()]
            for key in ("memory.current", "memory.peak"):
                if (cgroup / key).exists():
                    entry[key] = int((cgroup / key).read_text())
            if (cgroup / "cpu.stat").exists():
                entry["cpu.stat"] = (cgroup / "cpu.stat").read_text()
        except OSError as error:
            entry["error"] = str(error)
            pids = []
        processes = []
        for pid in pids:
            try:
                rollup = Path(f"/proc/{pid}/smaps_rollup").read_text()
                cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()[:200]
                stat = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
            except OSError:
                continue
            fields = {line.split(":")[0]: int(line.split()[1]) for line in rollup.splitlines()[1:] if "kB" in line}
            processes.append({"pid": pid, "cmdline": cmdline, "rss_kib": fields.get("Rss"),
                              "pss_kib": fields.get("Pss"), "utime_ticks": int(stat[11]),
                              "stime_ticks": int(stat[12])})  # fmt: skip
        entry["processes"] = processes
        result[name] = entry
    (out / "footprint.json").write_text(json.dumps(result, indent=1))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("mode", choices=["stragglers", "suite"])
    parser.add_argument("--gpus", type=int, default=2)
    parser.add_argument("--nodes", type=int, default=1, help="2: a two-node job, two more exporters, Prometheus, fleet")
    parser.add_argument("--prometheus", help="the prometheus binary (for --nodes 2)")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--runs", required=True)
    parser.add_argument("--warmup-s", type=float, default=25)
    parser.add_argument("--straggle-s", type=float, default=40)
    parser.add_argument("--hang-s", type=float, default=75)
    parser.add_argument("--job-s", type=float, default=50)
    parser.add_argument("--budget-s", type=float, default=520, help="stop starting runs past this many seconds")
    parser.add_argument("--window", type=int, default=None, help="bottleneck_window_s (default: the exporter's)")
    parser.add_argument("--exporter-arg", action="append", default=[], help="one more argument for every exporter")
    args = parser.parse_args()
    EXPORTER_ARGS.extend(args.exporter_arg)
    deadline = time.time() + args.budget_s
    args.out.mkdir(parents=True, exist_ok=True)
    for controller in ("+memory", "+cpu"):  # each exporter in a cgroup of its own: what a kubelet would limit
        try:
            Path("/sys/fs/cgroup/cgroup.subtree_control").write_text(controller)
        except OSError as error:
            print(f"cgroup controller {controller}: {error}", flush=True)
    services: list[subprocess.Popen] = [start_exporter(args.out, "main", PORT, args.window, None)]
    names = ["main"]
    fleet = args.nodes > 1 and args.prometheus is not None
    if args.nodes > 1:
        for node, port in enumerate(NODE_PORTS[: args.nodes]):
            services.append(start_exporter(args.out, f"node{node}", port, args.window, str(node)))
            names.append(f"node{node}")
        if fleet:
            services.append(start_prometheus(args.out, args.prometheus))
            services.append(start_fleet(args.out))
    recorder = Recorder(args.out, fleet)
    try:
        (stragglers if args.mode == "stragglers" else suite)(args, recorder, deadline)
    finally:
        footprint(args.out, names)
        for proc in reversed(services):
            proc.terminate()
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()


if __name__ == "__main__":
    main()
