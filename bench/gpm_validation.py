"""Profiling validation on a real GPU host: known loads → gpuwarden's GPM counters over a window inside the load,
each compared with an independent GPM read of the same window, the bottleneck class gpuwarden gives it, PCIe bytes
against the bytes copied, ncu running beside the exporter, the exporter unprivileged, and the poll cost with
profiling on and off.

    python3 -m bench.gpm_validation OUTDIR      # on the GPU host (PyTorch there; our dependencies as wheels)

Writes OUTDIR/results.json and OUTDIR/report.md. GPU 0 is used.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
import urllib.request
from pathlib import Path

from tests.helpers.daemon import start_daemon

ROOT = Path(__file__).resolve().parent.parent
PORT = 10045
WINDOW_S = 6.0
LOAD_S = 14.0

LOADS = {
    "idle": None,
    "bf16_matmul": """
        x = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
        end = ready()
        while time.time() < end:
            for _ in range(20):
                y = x @ x
            torch.cuda.synchronize()
    """,
    "fp32_matmul_tf32_off": """
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
        x = torch.randn(8192, 8192, device="cuda", dtype=torch.float32)
        end = ready()
        while time.time() < end:
            y = x @ x
            torch.cuda.synchronize()
    """,
    "d2d_copy": """
        a = torch.empty(2 * 1024**3, dtype=torch.uint8, device="cuda")
        b = torch.empty_like(a)
        end = ready()
        while time.time() < end:
            for _ in range(10):
                b.copy_(a)
            torch.cuda.synchronize()
    """,
    "h2d_pinned_copy": """
        src = torch.empty(1024**3, dtype=torch.uint8).pin_memory()
        dst = torch.empty(1024**3, dtype=torch.uint8, device="cuda")
        end = ready()
        copied, t0 = 0, time.time()
        while time.time() < end - 4.0:
            dst.copy_(src, non_blocking=True)
            torch.cuda.synchronize()
            copied += src.numel()
        print(json.dumps({"copied_bytes": copied, "copy_start": t0, "copy_end": time.time()}), flush=True)
        while time.time() < end:
            time.sleep(0.1)
    """,
    "starved": """
        x = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
        end = ready()
        while time.time() < end:  # one short kernel, then the "input pipeline" sleeps: the GPU mostly waits
            y = x @ x
            torch.cuda.synchronize()
            time.sleep(0.05)
    """,
}
PRELUDE = """import json, time, torch


def ready():
    torch.cuda.synchronize()
    print("READY", flush=True)
    return time.time() + %r

"""
EXPECTED = {
    "idle": "idle",
    "bf16_matmul": "tensor_bound",
    "fp32_matmul_tf32_off": "compute_without_tensor",
    "d2d_copy": "memory_bound",
    "h2d_pinned_copy": "host_transfer_bound",
    "starved": "waiting",  # was data_starved (renamed: the GPU cannot tell input from I/O or peers)
}


def scrape(port: int = PORT) -> dict[tuple[str, str], float]:
    """gpuwarden's GPU-0 counters: (name, label value) → value."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    out: dict[tuple[str, str], float] = {}
    for line in text.splitlines():
        if line.startswith("#") or 'gpu="0"' not in line:
            continue
        name, _, rest = line.partition("{")
        labels, _, value = rest.rpartition("} ")
        extra = [
            part.split("=", 1)[1].strip('"') for part in labels.split(",") if not part.startswith(("gpu=", "uuid="))
        ]
        out[(name, ",".join(extra))] = float(value)
    return out


def get_json(path: str, port: int = PORT) -> dict:
    return json.loads(urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5).read())


def exporter(*flags: str, port: int = PORT, user: str | None = None) -> subprocess.Popen:
    """The exporter on the driver's library, ready; `user`: as that unprivileged user (setpriv)."""
    setpriv = ["setpriv", "--reuid", user, "--regid", user, "--clear-groups"] if user else []
    command = [*setpriv, sys.executable, "-m", "gpuwarden"]
    return start_daemon(*flags, port=port, command=command, cwd=ROOT, ready="/readyz", timeout=30).proc


class IndependentGpm:
    """Our own GPM samples of GPU 0 (own buffers, this thread only), for the same windows."""

    IDS = {"sm": 2, "tensor": 5, "dram": 10, "fp32": 12, "graphics": 1, "pcie_rx_mib_s": 21, "pcie_tx_mib_s": 20}

    def __init__(self, index: int = 0, ids: dict[str, int] | None = None) -> None:
        import pynvml

        self.nv = pynvml
        self.ids = ids or self.IDS
        pynvml.nvmlInit()
        self.handle = pynvml.nvmlDeviceGetHandleByIndex(index)
        self.first, self.second = pynvml.nvmlGpmSampleAlloc(), pynvml.nvmlGpmSampleAlloc()

    def start(self) -> None:
        self.nv.nvmlGpmSampleGet(self.handle, self.first)

    def stop(self) -> dict[str, float]:
        nv = self.nv
        nv.nvmlGpmSampleGet(self.handle, self.second)
        request = nv.c_nvmlGpmMetricsGet_t()
        request.version, request.numMetrics = nv.NVML_GPM_METRICS_GET_VERSION, len(self.ids)
        request.sample1, request.sample2 = self.first, self.second
        for i, metric in enumerate(self.ids.values()):
            request.metrics[i].metricId = metric
        nv.nvmlGpmMetricsGet(request)
        return {name: request.metrics[i].value for i, name in enumerate(self.ids)}


def ratio(before: dict, after: dict, key: tuple[str, str]) -> float | None:
    window = after.get(("gpuwarden_gpm_window_seconds_total", "")) - before.get(
        ("gpuwarden_gpm_window_seconds_total", ""), 0
    )
    if key not in after or key not in before or window <= 0:
        return None
    return 100.0 * (after[key] - before[key]) / window


def run_load(name: str, body: str | None, gpm: IndependentGpm) -> dict:
    proc = None
    if body is not None:
        code = PRELUDE % LOAD_S + textwrap.dedent(body)
        proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
        assert proc.stdout is not None
        while proc.stdout.readline().strip() != "READY":  # torch and CUDA are set up: the load starts now
            if proc.poll() is not None:
                raise RuntimeError(f"load {name} died before it started")
    before_copy = scrape()
    time.sleep(2.0)  # warm-up inside the load
    before = scrape()
    gpm.start()
    time.sleep(WINDOW_S)
    independent = gpm.stop()
    after = scrape()
    klass = get_json("/api/v1/gpus/0")["health"]["bottleneck"]["observed"]
    copy = {}
    if proc is not None:
        output = proc.stdout.read() if proc.stdout else ""
        proc.wait(timeout=LOAD_S + 30)
        lines = [line for line in output.splitlines() if line.startswith("{")]
        copy = json.loads(lines[-1]) if lines else {}
    if copy:
        time.sleep(2.5)  # the slow tier reads the PCIe byte counters every second
        after_copy = scrape()
        rx = after_copy[("gpuwarden_pcie_bytes_total", "rx")] - before_copy[("gpuwarden_pcie_bytes_total", "rx")]
        copy["exporter_rx_bytes"] = rx
        copy["rx_error_pct"] = round(100.0 * (rx - copy["copied_bytes"]) / copy["copied_bytes"], 2)
        # the same quantity over the same window, exporter against an independent GPM read: rates in bytes/s
        window = after[("gpuwarden_gpm_window_seconds_total", "")] - before[("gpuwarden_gpm_window_seconds_total", "")]
        rx_key = ("gpuwarden_pcie_bytes_total", "rx")
        ours_rate = (after[rx_key] - before[rx_key]) / window
        independent_rate = independent["pcie_rx_mib_s"] * 1024 * 1024
        payload_rate = copy["copied_bytes"] / (copy["copy_end"] - copy["copy_start"])
        copy["window_rx_bytes_per_s"] = {
            "exporter": round(ours_rate),
            "independent_gpm": round(independent_rate),
            "payload_copied": round(payload_rate),
        }
        copy["exporter_vs_independent_pct"] = round(100.0 * (ours_rate - independent_rate) / independent_rate, 2)
        copy["link_over_payload_pct"] = round(100.0 * (independent_rate - payload_rate) / payload_rate, 2)
        copy["lspci"] = pcie_link()
    ours = {
        "sm": ratio(before, after, ("gpuwarden_gpm_sm_active_seconds_total", "")),
        "tensor": ratio(before, after, ("gpuwarden_gpm_pipe_active_seconds_total", "tensor")),
        "dram": ratio(before, after, ("gpuwarden_gpm_dram_active_seconds_total", "")),
        "fp32": ratio(before, after, ("gpuwarden_gpm_pipe_active_seconds_total", "fp32")),
        "graphics": ratio(before, after, ("gpuwarden_gpm_graphics_active_seconds_total", "")),
    }
    diff = {k: None if ours[k] is None else round(ours[k] - independent[k], 2) for k in ours}

    result = {
        "load": name,
        "exporter_pct": {k: None if v is None else round(v, 2) for k, v in ours.items()},
        "independent_pct": {k: round(v, 2) for k, v in independent.items()},
        "difference_points": diff,
        "within_5_points": all(d is not None and abs(d) <= 5 for d in diff.values()),
        "class": klass.split(":")[0],
        "class_observed": klass,
        "expected_class": EXPECTED[name],
        **({"pcie": copy} if copy else {}),
    }
    if proc is not None and proc.poll() is None:
        proc.kill()
    print(json.dumps(result), flush=True)
    return result


def pcie_link() -> dict:
    """The GPU's PCIe max payload size (from its config space, as root) and link state (sysfs): what predicts the
    protocol overhead counted on the link beside the payload."""
    bus = subprocess.run(
        ["nvidia-smi", "--query-gpu=pci.bus_id", "--format=csv,noheader", "-i", "0"], capture_output=True, text=True
    ).stdout.strip()
    device = Path("/sys/bus/pci/devices") / bus[4:].lower()
    out: dict = {"bus_id": bus}
    for name in ("current_link_speed", "current_link_width", "max_link_speed", "max_link_width"):
        path = device / name
        out[name] = path.read_text().strip() if path.exists() else None
    config = (device / "config").read_bytes() if (device / "config").exists() else b""
    pointer = config[0x34] if len(config) > 0x34 else 0
    while pointer and pointer + 10 < len(config):
        if config[pointer] == 0x10:  # the PCI Express capability: Device Control at +8, MPS in bits 7:5
            control = int.from_bytes(config[pointer + 8 : pointer + 10], "little")
            out["max_payload_bytes"] = 128 << ((control >> 5) & 0x7)
            out["max_read_request_bytes"] = 128 << ((control >> 12) & 0x7)
            break
        pointer = config[pointer + 1]
    return out


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def poll_cost() -> dict:
    """CPU of the exporter over 30 s at 1 s polls (profiling on, then off), and the fast tier's read time."""
    out = {}
    for label, flags in (("on", ()), ("off", ("--metrics.exclude", "gpuwarden_gpm_*"))):
        proc = exporter("--poll.fast-interval", "1", *flags, port=PORT + 2)
        time.sleep(5)
        c0, t0 = cpu_seconds(proc.pid), time.time()
        time.sleep(30)
        c1, t1 = cpu_seconds(proc.pid), time.time()
        durations = [
            float(line.split()[-1])
            for line in urllib.request.urlopen(f"http://127.0.0.1:{PORT + 2}/metrics").read().decode().splitlines()
            if line.startswith('gpuwarden_collect_duration_seconds{tier="fast"}')
        ]
        proc.terminate()
        proc.wait(10)
        out[label] = {
            "millicores": round(1000 * (c1 - c0) / (t1 - t0), 2),
            "fast_tier_ms": round(1000 * durations[0], 3),
        }
    from gpuwarden.config.settings import load_settings
    from gpuwarden.model.snapshot import Tier
    from gpuwarden.runtime.pipeline import Pipeline

    for label, exclude in (("read_on", ()), ("read_off", ("gpuwarden_gpm_*",))):
        pipeline = Pipeline(load_settings(None, environ={}, flags={"metrics.exclude": list(exclude)}))
        pipeline.poll_once()
        dev = next(iter(pipeline.poller.nvml.gpus.values())).device
        times = []
        for _ in range(40):
            time.sleep(0.12)  # GPM needs >= 100 ms between samples: each read takes one
            started = time.perf_counter()
            pipeline.poller.runner.read(dev, Tier.FAST)
            times.append(time.perf_counter() - started)
        pipeline.stop()
        times.sort()
        out[label] = {"median_ms": round(1000 * times[len(times) // 2], 3), "p90_ms": round(1000 * times[36], 3)}
    return out


def ncu_beside_the_exporter() -> dict:
    program = "import torch; a = torch.randn(2048, 2048, device='cuda'); (a @ a).sum().item()"
    result = subprocess.run(
        ["ncu", "--metrics", "sm__throughput.avg.pct_of_peak_sustained_elapsed", "--launch-count", "1",
         sys.executable, "-c", program],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    found = [line.strip() for line in result.stdout.splitlines() if "sm__throughput" in line]
    return {"returncode": result.returncode, "metric_lines": found[:3], "stderr_tail": result.stderr[-400:]}


def unprivileged() -> dict:
    proc = exporter("--poll.fast-interval", "1", port=PORT + 1, user="65534")
    time.sleep(4)
    text = urllib.request.urlopen(f"http://127.0.0.1:{PORT + 1}/metrics").read().decode()
    proc.terminate()
    proc.wait(10)
    return {
        "uid": 65534,
        "gpm_series": sum(1 for line in text.splitlines() if line.startswith("gpuwarden_gpm_")),
        "unavailable": [line for line in text.splitlines() if line.startswith("gpuwarden_gpm_unavailable_info")],
        "params": subprocess.run(
            ["grep", "-i", "profiling", "/proc/driver/nvidia/params"], capture_output=True, text=True
        ).stdout.strip(),
    }


def main() -> None:
    out = Path(sys.argv[1])
    out.mkdir(parents=True, exist_ok=True)
    thresholds = out / "thresholds.yaml"
    thresholds.write_text(f"bottleneck_window_s: {int(WINDOW_S)}\n")
    host = subprocess.run(
        ["nvidia-smi", "--query-gpu=name,driver_version,uuid", "--format=csv,noheader"], capture_output=True, text=True
    ).stdout.strip()
    results: dict = {"host": host, "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "loads": []}
    proc = exporter(
        "--poll.fast-interval", "1", "--poll.slow-interval", "1", "--health.thresholds-file", str(thresholds)
    )
    try:
        gpm = IndependentGpm()
        wanted = sys.argv[2].split(",") if len(sys.argv) > 2 else list(LOADS)
        for name, body in LOADS.items():
            if name not in wanted:
                continue
            results["loads"].append(run_load(name, body, gpm))
            (out / "results.json").write_text(json.dumps(results, indent=2))
        results["ncu"] = attempt(ncu_beside_the_exporter)
    finally:
        proc.terminate()
        proc.wait(10)
    results["unprivileged"] = attempt(unprivileged)
    results["cost"] = attempt(poll_cost)
    (out / "results.json").write_text(json.dumps(results, indent=2))


def attempt(step) -> dict:  # type: ignore[no-untyped-def]
    """One phase; its failure is recorded, not fatal to the others."""
    try:
        result = step()
    except Exception as exc:  # noqa: BLE001 - a report, whatever went wrong
        result = {"error": f"{type(exc).__name__}: {exc}"[:500]}
    print(json.dumps({step.__name__: result}), flush=True)
    return result


if __name__ == "__main__":
    main()
