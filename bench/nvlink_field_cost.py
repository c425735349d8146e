"""What each NVLink field costs in one nvmlDeviceGetFieldValues batch (all links), on a real NVLink GPU.

Usage (GPU host): python3 -m bench.nvlink_field_cost   — prints one line per field group, wall and CPU ms.
"""

from __future__ import annotations

import statistics
import time

import pynvml

GROUPS = {
    "state (165)": [pynvml.NVML_FI_DEV_NVLINK_GET_STATE],
    "dl_replay (161)": [pynvml.NVML_FI_DEV_NVLINK_ERROR_DL_REPLAY],
    "dl_recovery (162)": [pynvml.NVML_FI_DEV_NVLINK_ERROR_DL_RECOVERY],
    "dl_crc (163)": [pynvml.NVML_FI_DEV_NVLINK_ERROR_DL_CRC],
    "all four": [165, 161, 162, 163],
    "throttle counters (74-79, 269-271)": [74, 75, 76, 77, 78, 79, 269, 270, 271],
    "pcie bytes (197, 198)": [197, 198],
    "energy (83)": [83],
}


def main() -> None:
    pynvml.nvmlInit()
    handle = pynvml.nvmlDeviceGetHandleByIndex(0)
    links = pynvml.nvmlDeviceGetFieldValues(handle, [pynvml.NVML_FI_DEV_NVLINK_LINK_COUNT])[0].value.uiVal
    print(f"{pynvml.nvmlDeviceGetName(handle)}: {links} NVLinks")
    for name, fields in GROUPS.items():
        scoped = [(f, link) for f in fields for link in range(links)] if f"{fields[0]}" in "165 161 162 163" else fields
        wall, cpu = [], []
        for _ in range(10):
            t, c = time.perf_counter(), time.thread_time()
            pynvml.nvmlDeviceGetFieldValues(handle, scoped)
            wall.append((time.perf_counter() - t) * 1000)
            cpu.append((time.thread_time() - c) * 1000)
        print(
            f"{name:40} {len(scoped):3} entries  wall {statistics.median(wall):7.2f} ms  "
            f"cpu {statistics.median(cpu):7.2f} ms"
        )


if __name__ == "__main__":
    main()
