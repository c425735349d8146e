"""Pod attribution against a fake kubelet: a real gRPC server on a unix socket speaking pod-resources v1.

Only the kubelet is stood in for (no kubelet runs here); the exporter's gRPC client, the protobuf decoding, the
pipeline, the renderer and HTTP are the real ones.
"""

from __future__ import annotations

import logging
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from gpuwarden.attribution.podresources import PodAttribution, assign, device_key
from gpuwarden.attribution.podresources import messages as pb
from tests.helpers.common import parse_exposition, values, wait_for
from tests.helpers.kubelet import GPU, FakeKubelet


def test_device_ids_lose_the_replica_suffix_only() -> None:
    assert device_key("GPU-abc::3") == "GPU-abc"
    assert device_key("GPU-abc") == "GPU-abc"
    assert device_key("0") == "0"
    assert device_key("MIG-1234") == "MIG-1234"


def test_exclusive_shared_index_and_foreign_devices(kubelet: FakeKubelet) -> None:
    kubelet.pods = [
        ("train", "llama-0", [("trainer", [(GPU, ["GPU-aaa", "GPU-bbb"]), ("cpu", ["0", "1"])])]),
        # time-slicing: two pods on one GPU; one container with two replicas of it counts once
        ("notebooks", "alice", [("jupyter", [("nvidia.com/gpu.shared", ["GPU-ccc::0", "GPU-ccc::1"])])]),
        ("notebooks", "bob", [("jupyter", [("nvidia.com/gpu.shared", ["GPU-ccc::2"])])]),
        # device plugin with the index strategy; an unrelated device plugin; a MIG instance
        ("batch", "idx", [("main", [(GPU, ["3"])])]),
        ("net", "rdma", [("main", [("rdma/hca", ["GPU-aaa"])])]),
        ("infer", "mig", [("main", [("nvidia.com/mig-1g.10gb", ["MIG-0f0f"])])]),
    ]
    pods = PodAttribution(kubelet.socket_path, 10, ("nvidia.com/gpu", "nvidia.com/gpu.shared", "nvidia.com/mig-*"))
    view = pods.refresh()
    assert view.state == "ok"
    held = {(a.device_id, a.namespace, a.pod, a.container) for a in view.allocations}
    assert held == {
        ("GPU-aaa", "train", "llama-0", "trainer"),
        ("GPU-bbb", "train", "llama-0", "trainer"),
        ("GPU-ccc", "notebooks", "alice", "jupyter"),
        ("GPU-ccc", "notebooks", "bob", "jupyter"),
        ("3", "batch", "idx", "main"),
        ("MIG-0f0f", "infer", "mig", "main"),
    }
    by_uuid, unmatched = assign(view, [(0, "GPU-aaa", ()), (2, "GPU-ccc", ()), (3, "GPU-ddd", ())])
    assert [a.pod for a in by_uuid["GPU-aaa"]] == ["llama-0"]
    assert sorted(a.pod for a in by_uuid["GPU-ccc"]) == ["alice", "bob"]
    assert [a.pod for a in by_uuid["GPU-ddd"]] == ["idx"]  # index "3" → GPU 3
    assert unmatched == 2  # GPU-bbb is not visible here; MIG-0f0f
    # once GPU 2's MIG instances are known, the MIG slice is charged to its parent
    by_uuid, unmatched = assign(
        view, [(0, "GPU-aaa", ()), (2, "GPU-ccc", ("MIG-0f0f", "MIG-1e1e")), (3, "GPU-ddd", ())]
    )
    assert sorted(a.pod for a in by_uuid["GPU-ccc"]) == ["alice", "bob", "mig"] and unmatched == 1


def test_two_slices_of_one_gpu_in_one_container_are_one_series(kubelet: FakeKubelet) -> None:
    kubelet.pods = [("infer", "big", [("main", [("nvidia.com/mig-3g.40gb", ["MIG-a1", "MIG-a2"])])])]
    view = PodAttribution(kubelet.socket_path, 10, ("nvidia.com/mig-*",)).refresh()
    by_uuid, unmatched = assign(view, [(0, "GPU-aaa", ("MIG-a1", "MIG-a2", "MIG-a3"))])
    assert [(a.namespace, a.pod, a.container) for a in by_uuid["GPU-aaa"]] == [("infer", "big", "main")]
    assert unmatched == 0


def test_mig_instances_are_read_and_their_pods_charged_to_the_parent(
    kubelet: FakeKubelet, live_server: Callable[..., object]
) -> None:
    scenario = {"name": "mig", "node": {"count": 2, "mig_instances": {1: 3}}}
    server = live_server(
        scenario,
        pods={"resources_socket": str(kubelet.socket_path), "refresh_interval": 1},
        metrics={"enable_groups": ["static_detail"]},  # gpuwarden_mig_mode_enabled
    )
    gpus = {g.index: g for g in server.pipeline.snapshot.gpus}  # type: ignore[attr-defined]
    wait_for(lambda: len(server.pipeline.snapshot.gpus[1].info.mig_uuids or ()) == 3)  # type: ignore
    mig = server.pipeline.snapshot.gpus[1].info.mig_uuids  # type: ignore[attr-defined]
    assert all(u.startswith("MIG-") for u in mig) and len(set(mig)) == 3
    assert server.pipeline.snapshot.gpus[0].info.mig_uuids is None  # type: ignore[attr-defined]
    kubelet.pods = [("infer", f"svc-{i}", [("main", [("nvidia.com/mig-2g.20gb", [u])])]) for i, u in enumerate(mig)]

    def allocations() -> list[float]:
        return values(
            parse_exposition(server.get("/metrics").text),  # type: ignore[attr-defined]
            "gpuwarden_gpu_allocation",
            uuid=gpus[1].uuid,
            gpu="1",
        )

    wait_for(lambda: len(allocations()) == 3)
    series = parse_exposition(server.get("/metrics").text)  # type: ignore[attr-defined]
    assert values(series, "gpuwarden_mig_mode_enabled", gpu="1") == [1]
    assert values(series, "gpuwarden_mig_mode_enabled", gpu="0") == [0]
    assert values(series, "gpuwarden_pod_attribution_unmatched_devices") == [0]
    # each slice's holder, by mig_uuid: the label its GPM activity (gpuwarden_mig_gpm_*) carries, so the two join
    held = {
        dict(labels)["mig_uuid"]: dict(labels)["pod"]
        for (name, labels), _ in series.items()
        if name == "gpuwarden_mig_allocation"
    }
    assert held == {u: f"svc-{i}" for i, u in enumerate(mig)}
    wait_for(
        lambda: (
            len(values(parse_exposition(server.get("/metrics").text), "gpuwarden_mig_gpm_window_seconds_total")) == 3
        )  # type: ignore[attr-defined]
    )
    series = parse_exposition(server.get("/metrics").text)  # type: ignore[attr-defined]
    sampled = {dict(labels)["mig_uuid"] for (name, labels), _ in series.items() if name.startswith("gpuwarden_mig_gpm")}
    assert sampled == set(mig)


def test_dra_allocations_of_whole_gpus_and_mig_slices_attribute_as_the_device_plugins_do(
    kubelet: FakeKubelet, live_server: Callable[..., object]
) -> None:
    """On a DRA node the kubelet names devices by driver, pool and device (gpu-<minor>, and
    gpu-<minor>-mig-<profile>-<profile ID>-<placement start> for a slice), never by UUID: matched through the minor
    numbers and slice placements NVML reports, the allocations and the processes' pods are those the device plugin
    path gives."""
    scenario = {
        "name": "dra",
        "node": {"count": 3, "mig_instances": {1: 3}},
        "processes": [{"gpu": 0, "pid": 4101, "name": "train", "memory_gib": {"constant": 30}}],
    }
    server = live_server(scenario, pods={"resources_socket": str(kubelet.socket_path), "refresh_interval": 1})
    wait_for(lambda: len(server.pipeline.snapshot.gpus[1].info.mig_uuids or ()) == 3)  # type: ignore[attr-defined]
    snap = server.pipeline.snapshot  # type: ignore[attr-defined]
    gpus = {g.index: g for g in snap.gpus}
    assert [gpus[i].info.minor_number for i in range(3)] == [0, 1, 2]
    mig = gpus[1].info.mig_uuids
    node = "gpu-node-7"  # NVIDIA's driver: one pool per node, named after it
    kubelet.claims = [
        ("ml", "trainer-0", "main", "train-gpu", [("gpu.nvidia.com", node, "gpu-0")]),
        *[
            ("infer", f"svc-{i}", "main", f"slice-{i}", [("gpu.nvidia.com", node, f"gpu-1-mig-1g10gb-19-{i}")])
            for i in range(3)
        ],  # fmt: skip
        ("net", "router", "main", "nic", [("nic.example.com", node, "gpu-2")]),  # another driver: not a GPU
        ("ml", "ghost", "main", "gone", [("gpu.nvidia.com", node, "gpu-9")]),  # no such GPU here
    ]

    def series() -> dict:
        return parse_exposition(server.get("/metrics").text)  # type: ignore[attr-defined]

    wait_for(lambda: len(values(series(), "gpuwarden_gpu_allocation", gpu="1")) == 3)
    found = series()
    assert values(found, "gpuwarden_gpu_allocation", gpu="0", pod="trainer-0", container="main") == [1]
    assert not values(found, "gpuwarden_gpu_allocation", gpu="2")
    assert values(found, "gpuwarden_pod_attribution_unmatched_devices") == [1]  # gpu-9
    held = {dict(labels)["mig_uuid"]: dict(labels)["pod"] for (name, labels), _ in found.items()
            if name == "gpuwarden_mig_allocation"}  # fmt: skip
    assert held == {u: f"svc-{i}" for i, u in enumerate(mig)}  # placement start i is slot i's slice
    # the GPU's process belongs to the pod its DRA claim gave it (an exclusive GPU: no host /proc needed)
    assert values(found, "gpuwarden_container_gpu_memory_used_bytes", gpu="0", pod="trainer-0") == [30 * 2**30]
    (process,) = server.get("/api/v1/processes").json()["processes"]  # type: ignore[attr-defined]
    assert (process["pod"], process["attributed_by"]) == ("trainer-0", "allocation")


def test_dra_names_that_are_not_nvidias_or_name_no_gpu_stay_unmatched() -> None:
    from gpuwarden.attribution.podresources import dra_aliases, dra_key

    aliases = dra_aliases([("GPU-a", 3, ()), ("GPU-b", 5, (("MIG-x", 19, 4),)), ("GPU-c", None, ())])
    assert dra_key("gpu-3", aliases) == "GPU-a" and dra_key("gpu-5-mig-1g10gb-19-4", aliases) == "MIG-x"
    assert dra_key("gpu-0", aliases) == "gpu-0"  # index 0 is not minor 0: never guessed
    assert dra_key("gpu-5-mig-1g10gb-19-3", aliases) == "gpu-5-mig-1g10gb-19-3"  # another placement
    assert dra_key("gpu-5-mig-2g20gb-14-4", aliases) == "gpu-5-mig-2g20gb-14-4"  # another profile


def test_over_http_pods_come_and_go_and_the_socket_disappears(
    kubelet: FakeKubelet, live_server: Callable[..., object], caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="gpuwarden.attribution.podresources")
    server = live_server("healthy", pods={"resources_socket": str(kubelet.socket_path), "refresh_interval": 1})
    gpus = server.pipeline.snapshot.gpus  # type: ignore[attr-defined]
    first, second = gpus[0].uuid, gpus[1].uuid
    kubelet.pods = [("train", "job-a", [("worker", [(GPU, [first])])])]

    def scrape() -> dict:
        return parse_exposition(server.get("/metrics").text)  # type: ignore[attr-defined]

    wait_for(lambda: values(scrape(), "gpuwarden_gpu_allocation", pod="job-a"))
    series = scrape()
    assert values(series, "gpuwarden_pod_attribution_up") == [1]
    assert values(
        series,
        "gpuwarden_gpu_allocation",
        uuid=first,
        namespace="train",
        pod="job-a",
        container="worker",
        gpu=str(gpus[0].index),
    ) == [1]
    assert not values(series, "gpuwarden_gpu_allocation", uuid=second)
    api = server.get(f"/api/v1/gpus/{gpus[0].index}").json()  # type: ignore[attr-defined]
    assert api["pods"] == [{"namespace": "train", "pod": "job-a", "container": "worker"}]

    # job-a ends, two time-sliced pods share the second GPU
    kubelet.pods = [
        ("dev", "p1", [("c", [("nvidia.com/gpu.shared", [f"{second}::0"])])]),
        ("dev", "p2", [("c", [("nvidia.com/gpu.shared", [f"{second}::1"])])]),
    ]
    wait_for(lambda: not values(scrape(), "gpuwarden_gpu_allocation", pod="job-a"))
    series = scrape()
    assert sorted(k[1] for k in series if k[0] == "gpuwarden_gpu_allocation") == sorted(
        [
            frozenset(
                {("gpu", str(gpus[1].index)), ("uuid", second), ("namespace", "dev"), ("pod", p), ("container", "c")}
            )
            for p in ("p1", "p2")
        ]
    )

    # the kubelet goes away: allocations are dropped (not left stale), the gauge says so, one log line
    kubelet.stop()
    wait_for(lambda: values(scrape(), "gpuwarden_pod_attribution_up") == [0])
    assert not values(scrape(), "gpuwarden_gpu_allocation")
    calls = kubelet.calls  # it is gone: no call can reach it any more
    refreshes: set[float] = set()

    def two_more_refreshes() -> bool:
        refreshes.add(server.pipeline.pods.view.refreshed_at)  # type: ignore[attr-defined]
        return len(refreshes) >= 3

    wait_for(two_more_refreshes, timeout=30)  # two more refreshes while absent: still one line
    off_lines = [r for r in caplog.records if "pod attribution off" in r.getMessage()]
    assert len(off_lines) == 1, [r.getMessage() for r in caplog.records]
    assert kubelet.calls == calls

    # it comes back on the same path
    kubelet.pods = [("train", "job-b", [("worker", [(GPU, [first])])])]
    kubelet.start()
    wait_for(lambda: values(scrape(), "gpuwarden_gpu_allocation", pod="job-b"))
    assert values(scrape(), "gpuwarden_pod_attribution_up") == [1]


def test_no_socket_at_start_turns_itself_off(
    tmp_path: Path, live_server: Callable[..., object], caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="gpuwarden.attribution.podresources")
    missing = tmp_path / "nope" / "kubelet.sock"
    server = live_server("healthy", pods={"resources_socket": str(missing)})
    wait_for(
        lambda: (
            values(
                parse_exposition(server.get("/metrics").text),  # type: ignore[attr-defined]
                "gpuwarden_pod_attribution_up",
            )
            == [0]
        )
    )
    assert any(str(missing) in r.getMessage() and "pod attribution off" in r.getMessage() for r in caplog.records)


def test_attribution_off_exports_nothing_and_never_imports_grpc(tmp_path: Path) -> None:
    code = (
        "import sys\n"
        "from tests.helpers.common import settings\n"
        "from gpuwarden.sim import install_simulator\n"
        "from gpuwarden.sim.scenario import load_scenario\n"
        "from gpuwarden.runtime.pipeline import Pipeline\n"
        "install_simulator(load_scenario('healthy'))\n"
        f"p = Pipeline(settings(pods={{'resources_socket': '{tmp_path}/none.sock'}}))\n"
        "p.start(); p.ready_once.wait(10); p.stop()\n"
        "print('grpc' in sys.modules, p.snapshot.pods_state)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=Path(__file__).parents[1]
    ).stdout.split()
    assert out == ["False", "no_socket"]


def test_a_simulated_node_without_a_kubelet_does_not_look_for_one(tmp_path: Path) -> None:
    """The simulator on a laptop: the default socket path is absent, so no watcher and no "checking again" line;
    an explicit socket (the fake kubelet of the tests) is still watched (test_no_socket_at_start_turns_itself_off)."""
    default_socket = Path("/var/lib/kubelet/pod-resources/kubelet.sock")
    if default_socket.exists():
        pytest.skip("this machine has a kubelet socket at the default path")
    code = (
        "import logging, sys\n"
        "logging.basicConfig(level=logging.INFO)\n"
        "from tests.helpers.common import settings\n"
        "from gpuwarden.sim import install_simulator\n"
        "from gpuwarden.sim.scenario import load_scenario\n"
        "from gpuwarden.runtime.pipeline import Pipeline\n"
        "install_simulator(load_scenario('healthy'))\n"
        "p = Pipeline(settings())\n"
        "p.start(); p.ready_once.wait(10); p.stop()\n"
        "print(p.snapshot.pods_state)\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=Path(__file__).parents[1]
    )
    assert result.stdout.split() == ["disabled"], result.stdout
    assert "pod attribution" not in result.stderr, result.stderr


def test_kubelet_errors_are_reported_not_raised(tmp_path: Path) -> None:
    import socket
    import tempfile

    with tempfile.TemporaryDirectory(prefix="kubelet-") as short:
        path = Path(short) / "kubelet.sock"
        listener = socket.socket(socket.AF_UNIX)  # a socket that accepts and never speaks gRPC
        listener.bind(str(path))
        listener.listen(1)
        pods = PodAttribution(path, 10, ("nvidia.com/gpu",))
        import gpuwarden.attribution.podresources as module

        old = module.CALL_TIMEOUT_S
        module.CALL_TIMEOUT_S = 0.5
        try:
            view = pods.refresh()
        finally:
            module.CALL_TIMEOUT_S = old
            listener.close()
    assert view.state == "error" and view.allocations == ()
    assert view.error and ("deadline" in view.error or "unavailable" in view.error)


def test_committed_descriptor_matches_the_proto(tmp_path: Path) -> None:
    from grpc_tools import protoc

    proto_dir = Path(__file__).parents[1] / "exporter" / "gpuwarden" / "attribution" / "podresources"
    out = tmp_path / "set.pb"
    assert (
        protoc.main(["protoc", f"-I{proto_dir}", f"--descriptor_set_out={out}", str(proto_dir / "podresources.proto")])
        == 0
    )
    from google.protobuf import descriptor_pb2

    fresh = descriptor_pb2.FileDescriptorSet.FromString(out.read_bytes()).file[0]
    committed = descriptor_pb2.FileDescriptorProto.FromString(pb.DESCRIPTOR.serialized_pb)
    for message in fresh.message_type:  # protoc's descriptor sets carry json names, python_out drops them
        for field in message.field:
            field.ClearField("json_name")
    assert committed == fresh, "run: python -m gpuwarden.attribution.podresources.generate"
    # the wire names the kubelet serves
    assert pb.DESCRIPTOR.services_by_name["PodResourcesLister"].full_name == "v1.PodResourcesLister"
    assert [f.number for f in pb.PodResources.DESCRIPTOR.fields] == [1, 2, 3]
    assert [f.number for f in pb.ContainerDevices.DESCRIPTOR.fields] == [1, 2]
