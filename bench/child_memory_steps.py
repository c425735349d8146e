"""Where the GPM child's memory goes, step by step, in a fresh interpreter on a GPU host: the interpreter, pynvml,
gpuwarden's GPM modules, nvmlInit, a handle, two GPM sample buffers, one window. Anonymous memory and PSS from
/proc/self/smaps_rollup after each step (a full collection first).

    python3 -m bench.child_memory_steps OUT.json
"""

from __future__ import annotations

import gc
import json
import sys
import time


def reading() -> dict[str, float]:
    gc.collect()
    fields = {}
    with open("/proc/self/smaps_rollup") as rollup:
        for line in rollup.read().splitlines()[1:]:
            name, value = line.split(":", 1)
            fields[name] = int(value.split()[0]) / 1024
    return {key.lower() + "_mib": round(fields[key], 2) for key in ("Anonymous", "Pss", "Rss")}


def main() -> None:
    steps = [("interpreter", reading())]
    import pynvml

    steps.append(("import pynvml", reading()))
    from gpuwarden.nvml import calls, gpm_child  # noqa: F401 - what the child imports

    steps.append(("import gpuwarden.nvml.gpm_child", reading()))
    calls.nvmlInitWithFlags(calls.NVML_INIT_FLAG_NO_GPUS)
    steps.append(("nvmlInitWithFlags(NO_GPUS)", reading()))
    pynvml.nvmlInit()
    uuid = pynvml.nvmlDeviceGetUUID(pynvml.nvmlDeviceGetHandleByIndex(0))
    pynvml.nvmlShutdown()
    child = gpm_child.Child()
    handle = child.handle(uuid if isinstance(uuid, str) else uuid.decode())
    steps.append(("handle by UUID", reading()))
    names = (
        "GRAPHICS_UTIL",
        "SM_UTIL",
        "SM_OCCUPANCY",
        "ANY_TENSOR_UTIL",
        "FP64_UTIL",
        "FP32_UTIL",
        "FP16_UTIL",
        "DRAM_BW_UTIL",
        "PCIE_RX_PER_SEC",
        "PCIE_TX_PER_SEC",
        "NVLINK_TOTAL_RX_PER_SEC",
        "NVLINK_TOTAL_TX_PER_SEC",
    )
    metrics = [getattr(pynvml, f"NVML_GPM_METRIC_{name}") for name in names]  # the exporter's 12 (readers/gpm.py)
    uuid = uuid if isinstance(uuid, str) else uuid.decode()
    child.sampler.advance(uuid, handle, None, metrics)
    steps.append(("GPM: two sample buffers, the first sample", reading()))
    time.sleep(0.2)
    window = child.sampler.advance(uuid, handle, None, metrics)
    steps.append(("GPM: a window of 12 metrics", reading()))
    out = {"python": sys.version.split()[0], "window_seconds": getattr(window, "seconds", None), "steps": steps}
    with open(sys.argv[1], "w") as sink:
        json.dump(out, sink, indent=1)
    previous = 0.0
    for name, values in steps:
        print(f"{values['anonymous_mib'] - previous:+7.2f} anon  {values}  {name}")
        previous = values["anonymous_mib"]


if __name__ == "__main__":
    main()
