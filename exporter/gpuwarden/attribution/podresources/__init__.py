"""Pod attribution: which pods hold which GPU, read from the kubelet's pod-resources API.

The kubelet answers `List` on a unix socket with every pod's containers and the device IDs the device plugin
handed them, and (Kubernetes 1.34+) the devices DRA claims gave them, named by driver, pool and device: NVIDIA's
driver says `gpu-<minor>` for a GPU and `gpu-<minor>-mig-<profile>-<profile ID>-<placement start>` for a MIG slice,
which `dra_aliases` matches to the GPUs' minor numbers and the slices' placements (no API access needed). A
background thread refreshes that view every `pods.refresh_interval` — never per scrape — and the poller copies the
latest view into each snapshot, so `gpuwarden_gpu_allocation` joins GPU metrics to pods.
"""

from __future__ import annotations

import dataclasses
import logging
import re
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from fnmatch import fnmatch
from pathlib import Path

from gpuwarden.model.snapshot import Allocation

log = logging.getLogger(__name__)

LIST_METHOD = "/v1.PodResourcesLister/List"
CALL_TIMEOUT_S = 5.0
# The NVIDIA device plugin's time-slicing and MPS replicas are "<uuid>::<replica>".
_REPLICA_SUFFIX = re.compile(r"::\d+$")


@dataclass(frozen=True)
class AttributionView:
    """The last refresh: immutable, swapped whole, read by the poller without a lock."""

    state: str  # starting | ok | no_socket | error | disabled
    allocations: tuple[Allocation, ...] = ()
    refreshed_at: float = 0.0
    error: str | None = None


DISABLED = AttributionView(state="disabled")


def device_key(device_id: str) -> str:
    """The GPU a device ID names: a UUID ('GPU-…'), a MIG UUID ('MIG-…') or an index ('0'), without the
    time-slicing replica suffix."""
    return _REPLICA_SUFFIX.sub("", device_id.strip())


_DRA_GPU = re.compile(r"^gpu-(\d+)$")
_DRA_MIG = re.compile(r"^gpu-(\d+)-mig-[0-9a-z+]+-(\d+)-(\d+)$")


def dra_aliases(gpus: Iterable[tuple[str, int | None, Iterable[tuple[str, int, int]]]]) -> dict[str, str]:
    """NVIDIA DRA device names → the IDs the device plugin would have used (GPU UUID, MIG UUID), from each GPU's
    (uuid, minor number, MIG placements). A name no visible GPU answers to is left out (counted as unmatched)."""
    aliases: dict[str, str] = {}
    for uuid, minor, placements in gpus:
        if minor is None:
            continue
        aliases[f"gpu-{minor}"] = uuid
        for mig_uuid, profile_id, start in placements:
            aliases[f"gpu-{minor}:{profile_id}:{start}"] = mig_uuid
    return aliases


def dra_key(device_name: str, aliases: dict[str, str]) -> str:
    """The device-plugin ID a DRA device name stands for, or the name itself where no GPU answers to it."""
    if _DRA_GPU.match(device_name):
        return aliases.get(device_name, device_name)
    mig = _DRA_MIG.match(device_name)
    if mig:  # the profile's name (1g10gb) is the driver's spelling; ID and placement identify the slice
        return aliases.get(f"gpu-{mig.group(1)}:{mig.group(2)}:{mig.group(3)}", device_name)
    return device_name


def parse_list_response(
    response: object, resource_patterns: Iterable[str], dra_drivers: Iterable[str] = ("gpu.nvidia.com",)
) -> tuple[Allocation, ...]:
    """Flatten a ListPodResourcesResponse into one Allocation per (container, GPU), keeping only devices of the
    wanted resources and DRA drivers (a DRA device keeps its name, gpu-0, until `assign` resolves it). Replicas of
    one GPU in one container (time-slicing gives a container several) count once."""
    patterns = tuple(resource_patterns)
    drivers = set(dra_drivers)
    seen: dict[tuple[str, str, str, str], Allocation] = {}
    for pod in response.pod_resources:  # type: ignore[attr-defined]
        for container in pod.containers:
            for claim in container.dynamic_resources:
                for resource in claim.claim_resources:
                    if resource.driver_name in drivers and resource.device_name:
                        key = resource.device_name
                        seen.setdefault(
                            (key, pod.namespace, pod.name, container.name),
                            Allocation(key, pod.namespace, pod.name, container.name),
                        )
            for devices in container.devices:
                if not any(fnmatch(devices.resource_name, pattern) for pattern in patterns):
                    continue
                for device_id in devices.device_ids:
                    key = device_key(device_id)
                    seen.setdefault(
                        (key, pod.namespace, pod.name, container.name),
                        Allocation(key, pod.namespace, pod.name, container.name),
                    )
    return tuple(sorted(seen.values(), key=lambda a: (a.device_id, a.namespace, a.pod, a.container)))


def assign(
    view: AttributionView, gpus: Iterable[tuple[int, str, Iterable[str]]], aliases: dict[str, str] | None = None
) -> tuple[dict[str, tuple[Allocation, ...]], int]:
    """Map allocations onto the visible GPUs: by UUID, by index (the plugin's index strategy), or by the UUID of
    one of the GPU's MIG instances (a MIG slice is charged to its parent GPU). Returns uuid → allocations and the
    number of allocated device IDs that name no visible GPU (GPUs hidden from this container)."""
    by_key: dict[str, str] = {}
    for index, uuid, mig_uuids in gpus:
        by_key[uuid] = uuid
        by_key[str(index)] = uuid
        for mig_uuid in mig_uuids:
            by_key[mig_uuid] = uuid
    assigned: dict[str, dict[tuple[str, str, str], Allocation]] = {}
    unmatched: set[str] = set()
    for allocation in view.allocations:
        uuid = by_key.get(dra_key(allocation.device_id, aliases or {}))
        if uuid is None:
            unmatched.add(allocation.device_id)
        else:  # one series per container and GPU, however many slices of the GPU it holds
            holders = assigned.setdefault(uuid, {})
            holders.setdefault((allocation.namespace, allocation.pod, allocation.container), allocation)
    return {uuid: tuple(holders.values()) for uuid, holders in assigned.items()}, len(unmatched)


def assign_mig(
    view: AttributionView, gpus: Iterable[tuple[int, str, Iterable[str]]], aliases: dict[str, str] | None = None
) -> dict[str, tuple[Allocation, ...]]:
    """The allocations of MIG slices, by parent GPU UUID, one per container and slice: what joins a slice's
    activity (gpuwarden_mig_gpm_*) to the pod that holds it."""
    parent = {mig_uuid: uuid for _, uuid, mig_uuids in gpus for mig_uuid in mig_uuids}
    found: dict[str, list[Allocation]] = {}
    for allocation in view.allocations:
        slice_id = dra_key(allocation.device_id, aliases or {})
        uuid = parent.get(slice_id)
        if uuid is not None:  # under DRA the slice is named by its MIG UUID here, as the device plugin names it
            found.setdefault(uuid, []).append(dataclasses.replace(allocation, device_id=slice_id))
    return {uuid: tuple(allocations) for uuid, allocations in found.items()}


class PodResourcesClient:
    """One gRPC channel to the kubelet socket; the grpc import is deferred so nodes without the socket never
    pay for it."""

    def __init__(self, socket_path: Path) -> None:
        import grpc

        from gpuwarden.attribution.podresources import messages as pb

        self._pb = pb
        self._grpc = grpc
        self._channel = grpc.insecure_channel(f"unix://{socket_path}")
        self._list = self._channel.unary_unary(
            LIST_METHOD,
            request_serializer=pb.ListPodResourcesRequest.SerializeToString,
            response_deserializer=pb.ListPodResourcesResponse.FromString,
        )

    def list(self) -> object:
        return self._list(self._pb.ListPodResourcesRequest(), timeout=CALL_TIMEOUT_S)

    def close(self) -> None:
        self._channel.close()


def describe_rpc_error(exc: Exception) -> str:
    code = getattr(exc, "code", None)
    if callable(code):
        details = exc.details() if hasattr(exc, "details") else ""  # type: ignore[attr-defined]
        return f"{code().name.lower()}: {details}".strip()
    return f"{type(exc).__name__}: {exc}"


class PodAttribution:
    """Refreshes the allocation view in a daemon thread; `view` is always the latest complete one."""

    def __init__(
        self,
        socket_path: Path,
        refresh_interval: float,
        resource_patterns: tuple[str, ...],
        wall_clock: Callable[[], float] = time.time,
        dra_drivers: tuple[str, ...] = ("gpu.nvidia.com",),
    ) -> None:
        self.socket_path = socket_path
        self.refresh_interval = refresh_interval
        self.resource_patterns = resource_patterns
        self.dra_drivers = dra_drivers
        self._wall = wall_clock
        self.view: AttributionView = AttributionView(state="starting")
        self._client: PodResourcesClient | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="gpuwarden-pods", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()

    def _run(self) -> None:
        while not self._stop.is_set():
            self.refresh()
            self._stop.wait(self.refresh_interval)
        self._close()

    def _close(self) -> None:
        if self._client is not None:
            self._client.close()
            self._client = None

    def refresh(self) -> AttributionView:
        """One List call; state changes (not every failure) are logged, one line each."""
        previous = self.view.state
        if not self.socket_path.exists():
            self._close()
            view = AttributionView(state="no_socket", refreshed_at=self._wall())
            if previous != "no_socket":
                log.info(
                    "pod attribution off: no kubelet pod-resources socket at %s (mount "
                    "/var/lib/kubelet/pod-resources read-only, or set --pods.resources-socket); "
                    "checking again every %.0f s",
                    self.socket_path,
                    self.refresh_interval,
                )
        else:
            try:
                if self._client is None:
                    self._client = PodResourcesClient(self.socket_path)
                allocations = parse_list_response(self._client.list(), self.resource_patterns, self.dra_drivers)
                view = AttributionView(state="ok", allocations=allocations, refreshed_at=self._wall())
                if previous != "ok":
                    log.info(
                        "pod attribution on: kubelet pod-resources at %s, %d GPU allocation(s)",
                        self.socket_path,
                        len(allocations),
                    )
            except Exception as exc:  # any failure of the kubelet call: report it, keep polling
                self._close()
                reason = describe_rpc_error(exc)
                view = AttributionView(state="error", refreshed_at=self._wall(), error=reason)
                if previous != "error":
                    log.warning(
                        "pod attribution failing: kubelet pod-resources List at %s: %s%s",
                        self.socket_path,
                        reason,
                        " (the socket is root-only: run the container as UID 0 with no capabilities, "
                        "see docs/deploy.md)"
                        if "permission denied" in reason.lower()
                        else "",
                    )
        self.view = view
        return view
