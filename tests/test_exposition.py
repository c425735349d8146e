"""exporter/gpuwarden/exposition/text.py against prometheus_client as the oracle: the same families written by both must
be the same bytes, in the text format and in OpenMetrics — for every shipped scenario with every collector group, and
for label values, help texts and floats chosen to break an escaper or a number formatter."""

from __future__ import annotations

import math
import os
import resource

import pytest
from prometheus_client.exposition import generate_latest
from prometheus_client.metrics_core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.openmetrics.exposition import CONTENT_TYPE_LATEST
from prometheus_client.openmetrics.exposition import generate_latest as generate_openmetrics
from prometheus_client.openmetrics.parser import text_string_to_metric_families as parse_openmetrics

from gpuwarden.exposition.render import SnapshotCollector
from gpuwarden.exposition.text import (
    OPENMETRICS_CONTENT_TYPE,
    Family,
    ProcessFamilies,
    go_float,
    openmetrics_format,
    text_format,
)
from gpuwarden.model.families import GROUPS, Selection
from gpuwarden.sim.scenario import shipped_scenarios
from tests.helpers.common import parse_exposition, polled


class _Registry:
    """What prometheus_client's generators take: something with collect()."""

    def __init__(self, families: list[Family]) -> None:
        self.families = families

    def collect(self):  # noqa: ANN201 - prometheus_client Metric objects
        for family in self.families:
            cls = CounterMetricFamily if family.type == "counter" else GaugeMetricFamily
            metric = cls(family.name, family.help, labels=list(family.labels))
            for values, value in family.samples:
                metric.add_metric(list(values), value)
            yield metric


def assert_same_bytes(families: list[Family]) -> None:
    assert text_format(families) == generate_latest(_Registry(families))
    assert openmetrics_format(families) == generate_openmetrics(_Registry(families))


@pytest.mark.parametrize("scenario", sorted(shipped_scenarios()))
def test_every_scenario_renders_as_prometheus_client_renders_it(sim, make_pipeline, scenario):
    pipeline, fake = polled(sim, make_pipeline, scenario, 5, processes={"per_pid_series": True})
    families = list(SnapshotCollector(pipeline.snapshot, Selection((), (), tuple(GROUPS))).collect())
    fake.close()
    assert sum(len(family.samples) for family in families) > (2 if scenario == "driver-not-loaded" else 20)
    assert_same_bytes(families)


def test_odd_label_values_help_texts_and_numbers_render_identically():
    gauge = Family("gpuwarden_test_value", 'help with \\ a backslash,\na newline and "quotes"', "gauge", ("b", "a"))
    for values, value in [
        (("back\\slash", "new\nline"), 1),
        (('"quoted"', "ünïcödé ✓"), -0.0),
        (("", "empty"), math.inf),
        (("x", "y"), -math.inf),
        (("nan", "n"), math.nan),
        (("big", "b"), 1.5e21),
        (("bigint", "b"), 12345678901234567890),
        (("small", "s"), 1.2e-7),
        (("seven", "digits"), 1234567.0),
        (("true", "bool"), True),
    ]:
        gauge.add(values, value)
    counter = Family("gpuwarden_test_events_total", "a counter", "counter", ("gpu", "uuid"))
    counter.add(("0", "GPU-1"), 3)
    counter.add(("1", "GPU-2"), 0.5)
    bare = Family("gpuwarden_test_up", "no labels", "gauge")
    bare.add((), 1)
    empty = Family("gpuwarden_test_none", "no samples", "gauge", ("gpu",))
    assert_same_bytes([gauge, counter, bare, empty])
    parsed = list(parse_openmetrics(openmetrics_format([gauge, counter, bare]).decode()))
    assert [family.name for family in parsed] == ["gpuwarden_test_value", "gpuwarden_test_events", "gpuwarden_test_up"]


@pytest.mark.parametrize("value", [0, 1, 0.1, 1e6, 999999.0, 1e7, 123456789.123, 5e-324, 1.7976931348623157e308])
def test_go_float_matches_prometheus_client(value):
    from prometheus_client.utils import floatToGoString

    assert go_float(value) == floatToGoString(value)


def test_process_families_are_the_process_collectors_and_read_this_process():
    from prometheus_client import ProcessCollector

    ours = {family.name: family for family in ProcessFamilies().collect()}
    theirs = {metric.name: metric for metric in ProcessCollector(registry=None).collect()}
    assert {name.removesuffix("_total") for name in ours} == set(theirs)
    for name, family in ours.items():
        metric = theirs[name.removesuffix("_total")]
        assert (family.help, family.type) == (metric.documentation, metric.type)
    rss = ours["process_resident_memory_bytes"].samples[0][1]
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    assert 0 < rss <= peak * 1.01
    assert ours["process_open_fds"].samples[0][1] == len(os.listdir("/proc/self/fd"))  # each counts its own fd
    assert ProcessFamilies(proc="/nonexistent").collect() == []


def test_content_types_are_the_ones_prometheus_negotiates():
    assert OPENMETRICS_CONTENT_TYPE == CONTENT_TYPE_LATEST
    series = parse_exposition(text_format([_one()]).decode())
    assert series == {("gpuwarden_test_up", frozenset()): 1.0}


def _one() -> Family:
    family = Family("gpuwarden_test_up", "one", "gauge")
    family.add((), 1)
    return family
