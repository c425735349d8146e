"""The exporter's memory while its kernel log fills with forgeries (issue 48): the exporter as a process over the
simulator's `healthy` 8-GPU node, its kernel log a kmsg-format file; RSS, PSS and anonymous memory of the serving
process (/proc/PID/smaps_rollup) once its log from boot is read, after 10,000 forged lines, after 100,000, and after
three real driver lines (which must count: XID 79, XID 48, SXid 20034). The forgeries are tests/helpers/
kmsg_forgery.py's: driver lines of facility user, crash reports naming the driver, driver lines naming addresses the
host does not have (one new address per line), a driver wording that does not parse.

    python3 bench/kernel_log_forgery_rss.py OUT.json
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "exporter")]

from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from tests.helpers.common import free_port  # noqa: E402
from tests.helpers.kmsg_forgery import forged_lines, kmsg_line  # noqa: E402

BOOT_LOG = ROOT / "tests" / "data" / "kmsg" / "h200x2-boot.kmsg"
IGNORED_FAMILY = "gpuwarden_kernel_log_lines_ignored_total"
SCRAPES = 20  # between a step and its reading: the renderer's caches and the allocator settle


def rollup(pid: int) -> dict[str, float]:
    fields = {}
    for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines()[1:]:
        name, value = line.split(":", 1)
        fields[name] = int(value.split()[0]) / 1024
    return {
        key: round(fields[name], 1) for key, name in (("rss_mib", "Rss"), ("pss_mib", "Pss"), ("anon_mib", "Anonymous"))
    }


def scrape(url: str) -> dict[tuple[str, tuple], float]:
    with urllib.request.urlopen(url + "/metrics", timeout=10) as response:
        text = response.read().decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def wait(condition, url: str, what: str, timeout: float = 120.0) -> dict:  # noqa: ANN001 - a predicate on a scrape
    deadline = time.monotonic() + timeout
    while True:
        try:
            series = scrape(url)
            if condition(series):
                return series
        except OSError:
            pass
        if time.monotonic() > deadline:
            raise SystemExit(f"timed out waiting for {what}")
        time.sleep(0.2)


def ignored_total(series: dict) -> float:
    return sum(v for (name, _), v in series.items() if name == IGNORED_FAMILY)


def settle_and_measure(url: str, pid: int) -> dict[str, float]:
    for _ in range(SCRAPES):
        scrape(url)
    return rollup(pid)


def main() -> None:
    out = Path(sys.argv[1])
    folder = Path(tempfile.mkdtemp(prefix="gpuwarden-forgery-rss-"))
    log = folder / "kmsg"
    log.write_bytes(BOOT_LOG.read_bytes())
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    command = [sys.executable, "-m", "gpuwarden", "--sim", "--nvml.scenario", "healthy", "--nvml.kernel-log",
               str(log), "--web.listen-address", f"127.0.0.1:{port}"]  # fmt: skip
    env = {k: v for k, v in os.environ.items() if not k.startswith("GPUWARDEN_")}
    env["PYTHONPATH"] = str(ROOT / "exporter")
    proc = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    steps: dict[str, dict] = {}
    try:
        wait(lambda s: s.get(("gpuwarden_kernel_log_up", ())) == 1, url, "the kernel log read")
        steps["boot log read"] = settle_and_measure(url, proc.pid)
        seq = 10_000
        for total in (10_000, 100_000):
            lines, _ = forged_lines(total - (0 if total == 10_000 else 10_000), "0000:18:00", "0000:86:00.0", seq)
            seq += len(lines)
            with log.open("ab") as handle:
                handle.writelines(lines)
            wait(lambda s, n=total: ignored_total(s) >= n, url, f"{total} forged lines read")
            steps[f"{total} forged lines"] = settle_and_measure(url, proc.pid)
        now = time.monotonic()
        with log.open("ab") as handle:
            handle.write(
                kmsg_line(seq + 1, now - 3, "NVRM: Xid (PCI:0000:28:00): 79, pid='<unknown>', name=<unknown>, GPU has fallen off the bus.")  # noqa: E501
                + kmsg_line(seq + 2, now - 2, "NVRM: Xid (PCI:0000:38:00): 48, pid=1, name=python, DBE")
                + kmsg_line(seq + 3, now - 1, "nvidia-nvswitch3: SXid (PCI:0000:89:00.0): 20034, Fatal, Link 30")
            )  # fmt: skip
        counted = ("gpuwarden_xid_errors_total", "gpuwarden_kernel_sxid_errors_total")
        series = wait(lambda s: sum(1 for (name, _) in s if name in counted) == 3, url, "the real lines counted")
        steps["3 real driver lines"] = settle_and_measure(url, proc.pid)
    finally:
        proc.terminate()
        proc.wait(timeout=30)
        for path in folder.iterdir():
            path.unlink()
        folder.rmdir()
    result = {
        "machine": f"{os.cpu_count()} cores, {os.uname().release}",
        "date": time.strftime("%Y-%m-%d"),
        "steps": steps,
        "ignored": {dict(labels)["reason"]: v for (name, labels), v in series.items() if name == IGNORED_FAMILY},
        "rss_growth_10000_mib": round(steps["10000 forged lines"]["rss_mib"] - steps["boot log read"]["rss_mib"], 1),
        "rss_growth_100000_mib": round(steps["100000 forged lines"]["rss_mib"] - steps["boot log read"]["rss_mib"], 1),
    }
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
