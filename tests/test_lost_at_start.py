"""A GPU lost before the exporter started (what a restarted pod finds) stays in view: gpu_up 0 under the UUID the
kernel driver still gives, a verdict, a finding, "3 of 4" on the landing page, and npd-plugin's fault. It gave
`gpuwarden_gpus 3` and no series at all for it (issue 36 point 1)."""

from __future__ import annotations

from pathlib import Path

import pynvml
import pytest

from gpuwarden.nvml.driver_gpus import DriverGpu, identify_unopened, parse_information, read_driver_gpus
from gpuwarden.remediation.verdicts import evaluate
from tests.helpers.common import parse_exposition, values, wait_for

DATA = Path(__file__).resolve().parent / "data"
H200 = DriverGpu("00000000:00:06.0", "GPU-571773d1-fcc0-6c98-361a-9e7517c8ae0d", "NVIDIA H200")

LOST_FROM_START = {
    "name": "lost-from-start",
    "node": {"count": 4},
    "faults": [{"kind": "gpu_lost", "gpu": 2, "at": 0}],
}


def test_the_drivers_information_file_as_an_h200_gives_it() -> None:
    assert parse_information((DATA / "driver_information.txt").read_text()) == H200


@pytest.mark.parametrize(
    "text", ["", "Model: X\n", "GPU UUID: \t GPU-1\nBus Location: \t nowhere\n", "Bus Location: 0000:00:06.0\n"]
)
def test_an_information_file_without_a_bus_location_and_a_uuid_names_no_gpu(text: str) -> None:
    assert parse_information(text) is None


def test_the_drivers_list_is_read_in_bus_order_and_a_missing_folder_is_empty(tmp_path: Path) -> None:
    for bus, uuid in (("0000:c8:00.0", "GPU-b"), ("0000:18:00.0", "GPU-a"), ("0000:29:00.0", None)):
        folder = tmp_path / "gpus" / bus
        folder.mkdir(parents=True)
        if uuid:
            (folder / "information").write_text(
                f"Model: \t\t NVIDIA H100\nGPU UUID: \t {uuid}\nBus Location: \t {bus}\n"
            )
    assert [gpu.uuid for gpu in read_driver_gpus(tmp_path)] == ["GPU-a", "GPU-b"]
    assert read_driver_gpus(tmp_path / "absent") == []


def test_unopened_gpus_take_the_drivers_unmatched_ones_in_bus_order_or_nothing() -> None:
    driver = [DriverGpu(f"00000000:{bus:02X}:00.0", f"GPU-{bus:02x}") for bus in (0x18, 0x29, 0x3A, 0x4B)]
    opened = {"00000000:18:00.0", "0000:3a:00.0"}  # NVML's spelling and the driver's: one bus id
    assert identify_unopened([3, 1], opened, driver) == {1: driver[1], 3: driver[3]}
    assert identify_unopened([1], opened, driver) == {}  # two unmatched for one index: no guess
    assert identify_unopened([1, 3], opened, []) == {}  # the folder not mounted


def uuid_while_up(sim, index: int) -> str:
    """The UUID NVML gives the GPU while it answers (the simulated node's identity depends on its name only)."""
    sim(dict(LOST_FROM_START, faults=[]))
    pynvml.nvmlInit()
    try:
        return pynvml.nvmlDeviceGetUUID(pynvml.nvmlDeviceGetHandleByIndex(index))
    finally:
        pynvml.nvmlShutdown()


def test_a_gpu_lost_before_start_is_served_lost_under_the_uuid_it_had(live_server, sim) -> None:
    uuid = uuid_while_up(sim, 2)
    server = live_server(LOST_FROM_START)
    wait_for(lambda: 'gpu="2"' in server.get("/metrics").text)
    series = parse_exposition(server.get("/metrics").text)
    assert values(series, "gpuwarden_gpu_up", gpu="2", uuid=uuid) == [0.0]
    assert values(series, "gpuwarden_gpus") == [3.0]
    detail = server.get("/api/v1/gpus/2").json()
    assert (detail["info"]["name"], detail["info"]["pci_bus_id"]) == ("NVIDIA H100 80GB HBM3", "00000000:38:00.0")
    health = server.get("/api/v1/health").json()
    assert health["gpus_skipped"] == {}
    (lost,) = [gpu for gpu in health["gpus"] if gpu["index"] == 2]
    assert lost["uuid"] == uuid and not lost["up"] and lost["checks"]["gpu_lost"]["severity"] == "critical"
    findings = server.get("/api/v1/diagnosis").json()["findings"]
    assert [f["check"] for f in findings if f["gpu"] == 2] == ["gpu_lost"], findings
    assert "3 of 4 GPU(s) answering" in server.get("/").text
    outcome = evaluate(health, "hardware", 2, health["taken_at"])
    assert outcome.state == "problem" and outcome.fault == "GPU2 gpu_lost", outcome


def test_a_gpu_no_one_names_is_served_lost_by_index_then_under_its_uuid_once_it_answers(live_server, sim) -> None:
    """No driver list (a container without /proc/driver/nvidia): `unknown-gpu-N`, reopened by index."""
    uuid = uuid_while_up(sim, 2)
    scenario = dict(
        LOST_FROM_START,
        driver={"lists_gpus": False},
        faults=[{"kind": "gpu_lost", "gpu": 2, "at": 0, "until": 3}],
    )
    server = live_server(scenario)
    wait_for(lambda: 'gpu="2"' in server.get("/metrics").text)
    series = parse_exposition(server.get("/metrics").text)
    assert values(series, "gpuwarden_gpu_up", gpu="2", uuid="unknown-gpu-2") == [0.0]
    wait_for(lambda: values(parse_exposition(server.get("/metrics").text), "gpuwarden_gpu_up", gpu="2") == [1.0])
    series = parse_exposition(server.get("/metrics").text)
    assert values(series, "gpuwarden_gpu_up", gpu="2", uuid=uuid) == [1.0]
    assert values(series, "gpuwarden_gpus") == [4.0]
    assert not values(series, "gpuwarden_gpu_up", uuid="unknown-gpu-2")  # one GPU, one series


def test_a_gpu_this_container_may_not_open_stays_skipped(live_server) -> None:
    scenario = dict(
        LOST_FROM_START,
        faults=[{"kind": "error", "gpu": 2, "call": "nvmlDeviceGetUUID", "code": "no_permission"}],
    )
    server = live_server(scenario)
    wait_for(lambda: server.get("/api/v1/health").json()["gpus_skipped"] == {"2": "no_permission"})
    assert 'gpu="2"' not in server.get("/metrics").text


def test_an_exporter_watches_only_the_gpus_its_devices_select(sim, caplog: pytest.LogCaptureFixture) -> None:
    """nvml.devices (dcgm-exporter's --devices): a node split between two exporters, by index or by UUID. The others
    are neither opened nor served, not even as lost; a lost GPU that is selected stays in view; a selector that
    names no GPU is said once."""
    from tests.helpers.common import poll_series

    def watched(devices: list[str]) -> tuple[list[tuple[int, bool]], list]:
        pipeline, series = poll_series(sim, LOST_FROM_START, 2, nvml={"devices": devices})
        return [(g.index, g.up) for g in pipeline.snapshot.gpus], series

    everything, _ = watched([])
    assert everything == [(0, True), (1, True), (2, False), (3, True)]
    by_index, series = watched(["2", "3"])
    assert by_index == [(2, False), (3, True)]  # the lost one selected: served as lost, GPU 0 and 1 not at all
    gpu_labels = {dict(labels)["gpu"] for (name, labels), _ in series[-1].items() if name == "gpuwarden_gpu_up"}
    assert gpu_labels == {"2", "3"}  # NVML's own indexes, as nvidia-smi shows them
    pipeline, _ = poll_series(sim, LOST_FROM_START, 1)
    second = pipeline.snapshot.gpus[1].uuid
    by_uuid, _ = watched([second, "7"])
    assert by_uuid == [(1, True)]
    assert "nvml.devices: no GPU opened for 7 (NVML counts 4)" in caplog.text
