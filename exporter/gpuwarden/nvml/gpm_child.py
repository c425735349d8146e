"""The GPM sampler process: owns every GPM sample buffer and answers one request at a time (one GPM call in flight).

Started by gpuwarden.nvml.gpm_sampler.ChildProcessSampler as
`python -X faulthandler -m gpuwarden.nvml.gpm_child SPEC FD` (SPEC: JSON from gpuwarden.nvml.library.child_spec; FD:
the pipe the answers go to). It loads the same library as its parent (the driver's, or the simulator's scenario on
the parent's timeline), initialises NVML, writes {"ready": true}, then reads one JSON request per line on stdin and
writes one JSON answer per line on FD. Its stdout is its stderr: whatever a library prints never reaches the
protocol.
- {"op": "advance", "uuid", "gi", "metrics"} → {"window": null | {"seconds", "values", "failed"}}, or
  {"error": "unavailable" | "lost" | "down" | "fatal", "reason"};
- {"op": "close", "uuid", "gi"} → {"closed": true}: the windows of a re-discovered GPU or a destroyed MIG slice.
It exits when stdin closes (the parent is gone). A native crash kills only this process; faulthandler prints the
stacks on stderr, where the parent reads the name of the call.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable

import pynvml

from gpuwarden.nvml import calls
from gpuwarden.nvml.errors import GpuLostError, NvmlDownError, NvmlFatalError, error_code, error_name
from gpuwarden.nvml.gpm import GpmUnavailable, InProcessSampler

TYPE_CHECKING = False  # typing.TYPE_CHECKING without importing typing in the GPM child (gpm.py, its imports)
if TYPE_CHECKING:
    from typing import Any


class Child:
    """The child's state: a handle per GPU UUID; the windows are an InProcessSampler's (the same code as
    `nvml.gpm_isolation: thread`), alone in this process."""

    def __init__(self) -> None:
        self.handles: dict[str, Any] = {}
        self.sampler = InProcessSampler()

    def handle(self, uuid: str) -> Any:
        if uuid not in self.handles:
            self.handles[uuid] = calls.nvmlDeviceGetHandleByUUID(uuid)
        return self.handles[uuid]

    def close(self, uuid: str, gpu_instance: int | None) -> None:
        self.sampler.close(uuid, gpu_instance)
        if gpu_instance is None:
            self.handles.pop(uuid, None)  # re-discovered: open it again by UUID

    def answer(self, request: dict[str, Any]) -> dict[str, Any]:
        uuid, gpu_instance = request["uuid"], request.get("gi")
        if request["op"] == "close":
            self.close(uuid, gpu_instance)
            return {"closed": True}
        try:
            metrics = [int(m) for m in request["metrics"]]
            window = self.sampler.advance(uuid, self.handle(uuid), gpu_instance, metrics)
        except GpmUnavailable as exc:  # the sampler has dropped that window
            return {"error": "unavailable", "reason": exc.reason}
        except pynvml.NVMLError as exc:  # opening the handle by UUID
            self.handles.pop(uuid, None)
            return {"error": "lost", "reason": error_name(error_code(exc))}
        except GpuLostError as exc:
            self.close(uuid, None)
            return {"error": "lost", "reason": exc.reason}
        except NvmlDownError as exc:
            return {"error": "down", "reason": exc.reason}
        except NvmlFatalError as exc:
            return {"error": "fatal", "reason": str(exc)}
        if window is None:
            return {"window": None}
        return {"window": {"seconds": window.seconds, "values": window.values, "failed": window.failed}}


def main(prepare: Callable[[dict[str, Any]], None] | None = None) -> int:
    """Serve the protocol; `prepare` first loads the parent's library where it is not the driver's (the simulator's
    child, gpuwarden.sim.gpm_child, passes its installer: nvml/ knows nothing of the simulator)."""
    out = os.fdopen(int(sys.argv[2]), "w")
    os.dup2(2, 1)  # prints, Python's or a native library's, go to stderr: the protocol's pipe is its own
    if prepare is not None:
        prepare(json.loads(sys.argv[1]))
    try:
        calls.nvmlInitWithFlags(calls.NVML_INIT_FLAG_NO_GPUS)
    except pynvml.NVMLError as exc:
        out.write(json.dumps({"ready": False, "reason": error_name(error_code(exc))}) + "\n")
        out.flush()
        return 3
    out.write('{"ready": true}\n')
    out.flush()
    child = Child()
    for line in sys.stdin:
        out.write(json.dumps(child.answer(json.loads(line))) + "\n")
        out.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
