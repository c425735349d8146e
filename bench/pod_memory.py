"""What the exporter's pod pays on a GPU host, as a kubelet counts it: every process of the exporter in a cgroup v2
group of its own, PSS and RSS of each process (smaps_rollup), the group's memory.current and memory.peak, CPU of
the parent and of the GPM child apart, and the time from start to the first /metrics with the GPUs in it.

Variants run one after another, each from a cold page cache where the host lets us drop it (each variant then
pays for reading its own files, as a pod does on a node), each in two phases:
  1. scrape-only: /metrics every second for --phase-s seconds (Prometheus' only request);
  2. with the JSON API: every route once, then /api/v1/diagnosis, /api/v1/gpus and /metrics every second.
A training job (bench/workloads/train.py) can hold the GPUs meanwhile (--job-seconds), so the exporter reads real
processes. --compile writes the bytecode first, as the image's pip install does (the pod then reads .pyc files, and
never compiles: its root is read-only).

    python3 -m bench.pod_memory OUT.json NAME=EXPORTER_DIR[,OPTION...] ... [--phase-s 35] [--compile] [--job-seconds S]

OPTION: ENV=VALUE (the exporter's environment), --FLAG=VALUE (its flags), limit=72M:96M (memory.max in each phase).

EXPORTER_DIR is the folder holding the `gpuwarden` package (this checkout's exporter/, or an older tree's).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

ROUTES = (
    "/api/v1/gpus",
    "/api/v1/gpus/0",
    "/api/v1/processes",
    "/api/v1/health",
    "/api/v1/diagnosis",
    "/api/v1/diagnosis/0",
    "/api/v1/topology",
    "/",
    "/docs",
    "/openapi.json",
)
CGROUP_ROOT = Path("/sys/fs/cgroup")
TICK = os.sysconf("SC_CLK_TCK")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def get(url: str) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=10) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def rollup(pid: int) -> dict[str, float]:
    fields = {}
    for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines()[1:]:
        name, value = line.split(":", 1)
        fields[name] = int(value.split()[0]) / 1024
    return {"rss_mib": round(fields["Rss"], 1), "pss_mib": round(fields["Pss"], 1),
            "anon_mib": round(fields.get("Anonymous", 0.0), 1)}  # fmt: skip


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICK  # utime, stime


def measure(group: Path, parent: int) -> dict[str, Any]:
    """Every process of the group, the parent and the GPM child named, and the group's own counters."""
    if (group / "cgroup.procs").exists():
        pids = [int(p) for p in (group / "cgroup.procs").read_text().split()]
    else:  # no cgroup v2 here (the build machine): the process tree
        pids = [
            parent,
            *(int(c) for t in Path(f"/proc/{parent}/task").glob("*/children") for c in t.read_text().split()),
        ]
    processes = {}
    for pid in pids:
        try:
            command = Path(f"/proc/{pid}/cmdline").read_bytes()
            role = "parent" if pid == parent else ("gpm_child" if b"gpm_child" in command else "other")
            processes[str(pid)] = {"role": role, **rollup(pid), "cpu_s": cpu_seconds(pid)}
        except (OSError, IndexError):
            continue
    entry: dict[str, Any] = {"processes": processes}
    entry["pod_pss_mib"] = round(sum(p["pss_mib"] for p in processes.values()), 1)
    entry["pod_rss_mib"] = round(sum(p["rss_mib"] for p in processes.values()), 1)
    for key in ("memory.current", "memory.peak"):
        if (group / key).exists():
            entry[key.replace(".", "_") + "_mib"] = round(int((group / key).read_text()) / 2**20, 1)
    if (group / "memory.events").exists():
        entry["memory_events"] = dict(line.split() for line in (group / "memory.events").read_text().splitlines())
        entry["memory_max"] = (group / "memory.max").read_text().strip()
        stat = dict(line.split() for line in (group / "memory.stat").read_text().splitlines())
        entry["major_faults"] = int(stat.get("pgmajfault", 0))
    if (group / "memory.stat").exists():
        stat = dict(line.split() for line in (group / "memory.stat").read_text().splitlines())
        entry["cgroup_anon_mib"] = round(int(stat["anon"]) / 2**20, 1)
        entry["cgroup_file_mib"] = round(int(stat["file"]) / 2**20, 1)
        entry["cgroup_kernel_mib"] = round(int(stat.get("kernel", 0)) / 2**20, 1)
    return entry


class Timings:
    """Latencies and failures of the requests of one phase."""

    def __init__(self) -> None:
        self.seconds: list[float] = []
        self.failed = 0

    def get(self, url: str) -> None:
        started = time.monotonic()
        try:
            status, _ = get(url)
        except OSError:
            status = 0
        if status != 200:
            self.failed += 1
        self.seconds.append(time.monotonic() - started)

    def summary(self) -> dict[str, Any]:
        ordered = sorted(self.seconds) or [0.0]
        return {"requests": len(self.seconds), "failed": self.failed,
                "p50_ms": round(1000 * ordered[len(ordered) // 2], 1),
                "max_ms": round(1000 * ordered[-1], 1)}  # fmt: skip


def set_limit(group: Path, limit: str) -> None:
    """memory.max as a kubelet sets a pod's limit; no swap to hide behind."""
    (group / "memory.max").write_text(limit)
    if (group / "memory.swap.max").exists():
        (group / "memory.swap.max").write_text("0")


def drop_caches() -> bool:
    try:
        subprocess.run(["sync"], check=False)
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
        return True
    except OSError:
        return False


def run_variant(name: str, spec: str, phase_s: float) -> dict[str, Any]:
    directory, *options = spec.split(",")
    env = {k: v for k, v in os.environ.items() if not k.startswith("GPUWARDEN_")}
    env["PYTHONPATH"] = os.pathsep.join([str(Path(directory).resolve()), *env.get("PYTHONPATH", "").split(os.pathsep)])
    port = free_port()
    command = [sys.executable, "-m", "gpuwarden", "--web.listen-address", f"127.0.0.1:{port}"]
    limits: list[str] = []
    for option in options:
        if option.startswith("limit="):  # memory.max for each phase, as a kubelet sets the pod's limit: 72M:96M
            limits = option.removeprefix("limit=").split(":")
        elif option.startswith("--"):
            command.append(option)  # an exporter flag, e.g. --nvml.gpm-isolation=thread or --sim
        else:
            key, _, value = option.partition("=")
            env[key] = value
    group = CGROUP_ROOT / f"gw-pod-{name}"
    try:
        group.mkdir(exist_ok=True)
    except OSError as error:
        print(f"{name}: no cgroup of its own ({error}): the process tree only", flush=True)
    result: dict[str, Any] = {"variant": name, "spec": spec, "cold_page_cache": drop_caches()}
    if limits:
        set_limit(group, limits[0])
    started = time.monotonic()
    proc = subprocess.Popen(
        command, env=env, stdout=subprocess.DEVNULL, stderr=open(f"/tmp/pod-{name}.log", "wb"),  # noqa: SIM115
        preexec_fn=lambda: (group / "cgroup.procs").exists() and (group / "cgroup.procs").write_text(str(os.getpid())),
    )  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    try:
        while True:
            try:
                status, body = get(url + "/metrics")
                if status == 200 and b"gpuwarden_gpu_up{" in body:
                    result["first_metrics_s"] = round(time.monotonic() - started, 3)
                    break
            except OSError:
                pass
            if time.monotonic() - started > 60 or proc.poll() is not None:
                raise RuntimeError(f"{name}: no metrics within 60 s (exit {proc.poll()}), see /tmp/pod-{name}.log")
            time.sleep(0.01)
        scrapes = Timings()
        end = time.monotonic() + phase_s
        while time.monotonic() < end:
            scrapes.get(url + "/metrics")
            time.sleep(1)
        result["scrape_only"] = measure(group, proc.pid) | {"scrapes": scrapes.summary()}
        if len(limits) > 1:
            set_limit(group, limits[1])
        result["routes"] = {route: get(url + route)[0] for route in ROUTES}
        scrapes, api = Timings(), Timings()
        end = time.monotonic() + phase_s
        while time.monotonic() < end:
            api.get(url + "/api/v1/diagnosis")
            api.get(url + "/api/v1/gpus")
            scrapes.get(url + "/metrics")
            time.sleep(1)
        result["with_api"] = measure(group, proc.pid) | {"scrapes": scrapes.summary(), "api": api.summary()}
        result["exit_code"] = proc.poll()  # None: still running (an OOM kill would show here and in memory.events)
    finally:
        proc.terminate()
        proc.wait(10)
    print(json.dumps({k: result[k] for k in result if k in ("variant", "first_metrics_s", "exit_code")}
                     | {phase: {k: v for k, v in result[phase].items() if k != "processes"}
                        for phase in ("scrape_only", "with_api") if phase in result}), flush=True)  # fmt: skip
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("variants", nargs="+", help="NAME=EXPORTER_DIR[,OPTION...]")
    parser.add_argument("--phase-s", type=float, default=35.0)
    parser.add_argument(
        "--compile", action="store_true", help="bytecode for every variant and PYTHONPATH folder, as in the image"
    )
    parser.add_argument("--job-seconds", type=float, default=0.0, help="train on the GPUs meanwhile (0: no job)")
    args = parser.parse_args()
    for controller in ("+memory", "+cpu"):
        try:
            (CGROUP_ROOT / "cgroup.subtree_control").write_text(controller)
        except OSError as error:
            print(f"cgroup controller {controller}: {error}", flush=True)
    if args.compile:  # pip install compiles; the image is read-only and never writes bytecode at run time
        folders = [v.partition("=")[2].split(",")[0] for v in args.variants]
        folders += [f for f in os.environ.get("PYTHONPATH", "").split(os.pathsep) if f]
        subprocess.run([sys.executable, "-m", "compileall", "-q", "-j", "0", *sorted(set(folders))], check=False)
    job = None
    if args.job_seconds:
        job = subprocess.Popen(
            [sys.executable, "bench/workloads/train.py", "--seconds", str(args.job_seconds)],
            stdout=open("/tmp/pod-job.log", "wb"), stderr=subprocess.STDOUT,  # noqa: SIM115
        )  # fmt: skip
        time.sleep(20)  # the job's CUDA context and its first steps, before the first variant starts
    results = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "phase_s": args.phase_s, "variants": []}
    try:
        for variant in args.variants:
            name, _, spec = variant.partition("=")
            results["variants"].append(run_variant(name, spec, args.phase_s))
            args.out.write_text(json.dumps(results, indent=1))
    finally:
        if job is not None:
            job.terminate()
            job.wait(30)
            results["job_exit"] = job.returncode
            args.out.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
