"""Bad input, generated: every invalid config, environment or scenario gives the one-line error, never a traceback;
and schemathesis against the running service's OpenAPI schema: no 500s, responses match the schema."""

from __future__ import annotations

import string
from collections.abc import Callable
from pathlib import Path

import pytest
import schemathesis
import schemathesis.transport.wsgi  # noqa: F401 - see below
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gpuwarden.config.settings import ConfigError, Settings, load_settings
from gpuwarden.sim.scenario import Scenario, load_scenario

# schemathesis imports its transport lazily, inside case.call(), where pytest's assertion rewriting parses it while the
# exporter's threads run; CPython 3.11's AST constructor keeps its recursion depth in shared state (gh-106905), and
# that parse failed once with "AST constructor recursion depth mismatch". Imported above, it is parsed at collection.

scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(10**6), 10**6),
    st.floats(allow_nan=True),
    st.text(string.printable, max_size=20),
)
keys = st.one_of(
    st.sampled_from(
        [
            "web",
            "poll",
            "nvml",
            "metrics",
            "log",
            "health",
            "fast_interval",
            "listen_address",
            "backend",
            "include",
            "level",
            "format",
            "scenario",
            "slow_interval",
            "call_deadline",
            "name",
            "node",
            "values",
            "gpus",
            "faults",
            "kind",
            "gpu",
            "at",
            "until",
            "count",
            "model",
            "square",
            "ramp",
            "constant",
        ]
    ),
    st.text(string.ascii_letters + "_", min_size=1, max_size=12),
)
documents = st.recursive(
    scalars,
    lambda inner: st.one_of(st.lists(inner, max_size=4), st.dictionaries(keys, inner, max_size=5)),
    max_leaves=25,
)
FUZZ = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


def loads_or_fails_with_one_line(load: Callable[[], object], kind: type = object) -> None:
    """`load()` returns a `kind`, or raises ConfigError with one line, never a traceback."""
    try:
        loaded = load()
    except ConfigError as exc:
        message = str(exc)
        assert message and "\n" not in message and "Traceback" not in message
    else:
        assert isinstance(loaded, kind)


def written(tmp_path_factory, document: object) -> str:
    """`document` as a YAML file of its own."""
    path = tmp_path_factory.mktemp("doc") / "d.yaml"
    path.write_text(yaml.safe_dump(document))
    return str(path)


@FUZZ
@given(document=documents)
def test_any_config_document_loads_or_fails_with_one_line(tmp_path_factory, document):
    path = Path(written(tmp_path_factory, document))
    loads_or_fails_with_one_line(lambda: load_settings(path, environ={}), Settings)


@FUZZ
@given(text=st.text(max_size=200))
def test_any_config_text_loads_or_fails_with_one_line(tmp_path_factory, text):
    path = tmp_path_factory.mktemp("cfg") / "c.yaml"
    path.write_bytes(text.encode("utf-8", "replace"))
    loads_or_fails_with_one_line(lambda: load_settings(path, environ={}))


@FUZZ
@given(
    env=st.dictionaries(
        st.sampled_from(
            [
                "GPUWARDEN_POLL_FAST_INTERVAL",
                "GPUWARDEN_NVML_BACKEND",
                "GPUWARDEN_WEB_LISTEN_ADDRESS",
                "GPUWARDEN_METRICS_INCLUDE",
                "GPUWARDEN_LOG_LEVEL",
                "GPUWARDEN_NVML_XID_EVENTS",
                "GPUWARDEN_X",
                "GPUWARDEN_WEB_TELEMETRY_PATH",
            ]
        ),
        st.text(string.printable, max_size=15),
        max_size=4,
    )
)
def test_any_environment_loads_or_fails_with_one_line(env):
    loads_or_fails_with_one_line(lambda: load_settings(None, environ=env))


@FUZZ
@given(document=documents)
def test_any_scenario_document_loads_or_fails_with_one_line(tmp_path_factory, document):
    path = written(tmp_path_factory, document)
    loads_or_fails_with_one_line(lambda: load_scenario(path), Scenario)


@FUZZ
@given(
    faults=st.lists(
        st.fixed_dictionaries(
            {
                "kind": st.sampled_from(
                    [
                        "gpu_lost",
                        "hang",
                        "error",
                        "xid",
                        "ecc",
                        "nvlink_down",
                        "remapped_rows",
                        "driver_unloaded",
                        "bogus",
                    ]
                )
            },
            optional={
                "gpu": st.integers(-2, 10),
                "at": st.floats(-5, 50),
                "until": st.floats(-5, 50),
                "every": st.floats(-1, 10),
                "duration": st.floats(-1, 10),
                "call": st.sampled_from(["nvmlDeviceGetName"]),
                "code": st.sampled_from(["unknown", "nope"]),
                "xid": st.integers(-1, 200),
                "type": st.text(max_size=8),
                "link": st.integers(-1, 30),
                "count": st.integers(-1, 5),
            },
        ),
        max_size=4,
    )
)
def test_scenario_faults_validate_or_fail_with_one_line(tmp_path_factory, faults):
    path = written(tmp_path_factory, {"name": "fuzz", "node": {"count": 4}, "faults": faults})
    loads_or_fails_with_one_line(lambda: load_scenario(path))


@pytest.mark.slow  # 25 generated requests for each operation: the whole suite's
def test_api_never_500s_and_matches_its_schema(live_server):
    """schemathesis drives every operation of the running service's OpenAPI schema with generated requests: no
    undocumented 5xx. A 5xx the operation documents is its answer, not a fault (/readyz's 503 while the poller's
    snapshot is older than allowed, as on a starved machine), and must match its schema like any other."""
    server = live_server("gpu-lost")
    schema = schemathesis.openapi.from_url(server.url + "/openapi.json")
    operations = [result.ok() for result in schema.get_all_operations()]
    assert {op.path for op in operations} >= {"/api/v1/gpus/{gpu}", "/api/v1/diagnosis/{gpu}", "/metrics"}
    paths = schema.raw_schema["paths"]
    for operation in operations:
        listed = paths[operation.path][operation.method.lower()].get("responses", {})
        exercise(operation, {int(code) for code in listed if code.isdigit() and int(code) != 500})


def exercise(operation: schemathesis.schemas.APIOperation, documented: set[int]) -> None:
    """25 generated requests to one operation: below 500 or a 5xx it documents, and its schema matched."""

    @given(case=operation.as_strategy())
    @settings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck))
    def one(case: schemathesis.Case) -> None:
        response = case.call()
        assert response.status_code < 500 or response.status_code in documented, (
            case.path,
            response.status_code,
            response.text[:200],
        )
        case.validate_response(response)

    one()
