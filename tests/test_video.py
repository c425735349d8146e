"""Encoder and decoder utilization (metrics group `video`, issue 36 papercut): busy seconds integrated from NVML's
reads on the driver's clock, exported only with the group on, and its NVML calls made only then."""

from __future__ import annotations

import pytest

from tests.helpers.common import poll_series, values

TRANSCODING = {
    "name": "transcoding",
    "node": {"count": 2},
    "values": {"decoder_utilization": {"constant": 40}, "encoder_utilization": 0},
}


def test_decoder_busy_seconds_are_its_utilization_times_the_time_polled(sim) -> None:
    pipeline, series = poll_series(sim, TRANSCODING, 11, metrics={"enable_groups": "video"})
    last = series[-1]
    # 10 s between the first poll and the last, 40 % busy: 4 s (the first poll starts the clock)
    assert values(last, "gpuwarden_video_busy_seconds_total", gpu="0", engine="decoder") == [pytest.approx(4.0)]
    assert values(last, "gpuwarden_video_busy_seconds_total", gpu="1", engine="encoder") == [0.0]


def test_the_group_is_off_by_default_and_its_nvml_calls_are_not_made(sim) -> None:
    """A decoder read that fails is counted where it is made: only with the group on."""
    failing = dict(
        TRANSCODING, faults=[{"kind": "error", "call": "nvmlDeviceGetDecoderUtilization", "code": "unknown"}]
    )
    _, off = poll_series(sim, failing, 3)
    assert not values(off[-1], "gpuwarden_video_busy_seconds_total")
    assert not values(off[-1], "gpuwarden_collect_errors_total", call="nvmlDeviceGetDecoderUtilization")
    _, on = poll_series(sim, failing, 3, metrics={"enable_groups": "video"})
    assert values(on[-1], "gpuwarden_collect_errors_total", call="nvmlDeviceGetDecoderUtilization")
    assert values(on[-1], "gpuwarden_video_busy_seconds_total", engine="encoder")  # the other engine still read
