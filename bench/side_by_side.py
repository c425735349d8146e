"""gpuwarden and nvitop-exporter side by side on one GPU host: time to first metrics with GPU data, resident
memory, CPU at 1 s scrapes, sequential and 16-client scrape latency. Each exporter runs alone (never both at
once); the start-up time is the median of five starts each, taken in turn.

    python3 -m bench.side_by_side OUT.json        # on the GPU host; nvitop-exporter 1.7.2 installed beside ours

Two rounds: first as the packages lie (on the lent host they are unpacked without bytecode and the environment
sets PYTHONDONTWRITEBYTECODE, so every start compiles every module from source), then after `compileall` of the
packages of both exporters — bytecode, as `pip install` and the container image leave them: the figures that
describe a deployment. Also records where gpuwarden's resident memory lives (the largest mappings of smaps).
"""

from __future__ import annotations

import http.client
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PORT = 10065
EXPORTERS = {
    "gpuwarden": ([sys.executable, "-m", "gpuwarden", f"--web.listen-address=127.0.0.1:{PORT}"], b"gpuwarden_gpu_up"),
    "nvitop-exporter": (
        [sys.executable, "-m", "nvitop_exporter", "--bind-address", "127.0.0.1", "--port", str(PORT)],
        b"gpu_utilization",  # its per-GPU series (gpu_utilization_Percentage, ...)
    ),
}


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def get(conn: http.client.HTTPConnection) -> bytes:
    conn.request("GET", "/metrics")
    response = conn.getresponse()
    body = response.read()
    if response.status != 200:
        raise RuntimeError(f"status {response.status}")
    return body


CWD: dict[str, Path] = {}  # where an exporter other than this checkout's starts from (startup_variants.py --against)


def start(name: str) -> tuple[subprocess.Popen, float]:
    cmd, marker = EXPORTERS[name]
    started = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=CWD.get(name, ROOT), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    while time.perf_counter() - started < 30:
        try:
            conn = http.client.HTTPConnection("127.0.0.1", PORT, timeout=2)
            if marker in get(conn):
                return proc, time.perf_counter() - started
        except (OSError, RuntimeError, http.client.HTTPException):
            time.sleep(0.005)
    proc.kill()
    raise RuntimeError(f"{name} served no GPU metrics in 30 s: {proc.stderr.read()[-1500:] if proc.stderr else ''}")


def stop(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(10)
    except subprocess.TimeoutExpired:
        proc.kill()


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def concurrent(clients: int, seconds: float) -> dict:
    latencies: list[float] = []
    errors = [0]
    lock = threading.Lock()
    end = time.perf_counter() + seconds

    def worker() -> None:
        conn = http.client.HTTPConnection("127.0.0.1", PORT, timeout=10)
        mine = []
        while time.perf_counter() < end:
            t = time.perf_counter()
            try:
                get(conn)
                mine.append(time.perf_counter() - t)
            except (OSError, RuntimeError, http.client.HTTPException):
                errors[0] += 1
                conn = http.client.HTTPConnection("127.0.0.1", PORT, timeout=10)
        with lock:
            latencies.extend(mine)

    threads = [threading.Thread(target=worker) for _ in range(clients)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return {
        "requests_per_s": round(len(latencies) / seconds, 1),
        "p50_ms": round(1000 * percentile(latencies, 0.5), 2),
        "p99_ms": round(1000 * percentile(latencies, 0.99), 2),
        "errors": errors[0],
    }


def top_mappings(pid: int, count: int = 12) -> list[tuple[str, float]]:
    sizes: dict[str, float] = {}
    name = "[anon]"
    for line in Path(f"/proc/{pid}/smaps").read_text().splitlines():
        parts = line.split()
        if parts and "-" in parts[0] and len(parts) >= 5 and not parts[0].endswith(":"):
            name = parts[5] if len(parts) >= 6 else "[anon]"
        elif parts and parts[0] == "Rss:":
            sizes[name] = sizes.get(name, 0.0) + int(parts[1]) / 1024
    return sorted(((n, round(s, 1)) for n, s in sizes.items()), key=lambda kv: -kv[1])[:count]


STARTS = 5


def interleaved_starts(count: int = STARTS) -> dict[str, list[float]]:
    """First metrics of each exporter, started in turn (A, B, A, B, ...): drift on the host touches both alike.
    Three starts of one exporter and then three of the other could not tell apart a 20 ms difference on a host
    whose start-up times spread over 40 ms (2026-11-26, run 14)."""
    starts: dict[str, list[float]] = {name: [] for name in EXPORTERS}
    for _ in range(count):
        for name in EXPORTERS:
            proc, first = start(name)
            starts[name].append(round(first, 3))
            stop(proc)
            time.sleep(0.5)
    return starts


def measure(name: str, starts: list[float]) -> dict:
    proc, _ = start(name)
    try:
        time.sleep(5)
        result: dict = {"first_metrics_s": starts, "first_metrics_median_s": statistics.median(starts)}
        conn = http.client.HTTPConnection("127.0.0.1", PORT, timeout=10)
        c0, t0 = cpu_seconds(proc.pid), time.perf_counter()
        for _ in range(30):  # Prometheus-like: one scrape a second for 30 s
            get(conn)
            time.sleep(1.0)
        result["millicores_at_1s_scrapes"] = round(1000 * (cpu_seconds(proc.pid) - c0) / (time.perf_counter() - t0), 2)
        result["rss_mib"] = round(rss_mib(proc.pid), 1)
        sequential = []
        for _ in range(200):
            t = time.perf_counter()
            get(conn)
            sequential.append(time.perf_counter() - t)
        result["sequential"] = {
            "p50_ms": round(1000 * percentile(sequential, 0.5), 2),
            "p99_ms": round(1000 * percentile(sequential, 0.99), 2),
        }
        result["clients_16"] = concurrent(16, 10.0)
        result["rss_mib_after_load"] = round(rss_mib(proc.pid), 1)
        fresh = http.client.HTTPConnection("127.0.0.1", PORT, timeout=10)  # idle keep-alives may have been closed
        result["series"] = sum(1 for line in get(fresh).splitlines() if line and not line.startswith(b"#"))
        if name == "gpuwarden":
            result["rss_top_mappings_mib"] = top_mappings(proc.pid)
            api = http.client.HTTPConnection("127.0.0.1", PORT, timeout=10)
            api.request("GET", "/api/v1/gpus")
            api.getresponse().read()
            result["rss_mib_after_first_api_request"] = round(rss_mib(proc.pid), 1)
    finally:
        stop(proc)
    return result


def compile_packages() -> list[str]:
    """Bytecode for both exporters' packages and this repository's, as pip would have written it."""
    import compileall
    import importlib.util

    folders = {str(ROOT / "exporter")}
    for module in ("pynvml", "prometheus_client", "nvitop_exporter", "nvitop", "psutil", "httptools", "yaml"):
        spec = importlib.util.find_spec(module)
        if spec is not None and spec.origin:
            folders.add(
                str(Path(spec.origin).parent.parent if spec.submodule_search_locations else Path(spec.origin).parent)
            )
    for folder in sorted(folders):
        compileall.compile_dir(folder, quiet=1, workers=0)
    return sorted(folders)


def main() -> None:
    out = Path(sys.argv[1])
    host = subprocess.run(
        ["nvidia-smi", "--query-gpu=name,driver_version", "--format=csv,noheader"], capture_output=True, text=True
    ).stdout.strip()
    results: dict = {"host": host, "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "python": sys.version}
    for round_name in ("as_installed", "bytecode"):
        if round_name == "bytecode":
            results["compiled"] = compile_packages()
        results[round_name] = {}
        starts = interleaved_starts()
        for name in EXPORTERS:
            try:
                results[round_name][name] = measure(name, starts[name])
            except Exception as exc:  # noqa: BLE001 - record the failure, run the other
                results[round_name][name] = {"error": f"{type(exc).__name__}: {exc}"[:1500]}
            print(json.dumps({round_name: {name: results[round_name][name]}}), flush=True)
            out.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
