"""The Grafana dashboards: generated, linted, and every panel and variable query run against a real Prometheus
that scraped simulated nodes under several scenarios, every node at the default metric set."""

from __future__ import annotations

import importlib.util
import json
import re
import tempfile
import time
from pathlib import Path

import httpx
import pytest

from alert_rules import generate
from gpuwarden.health import rules
from gpuwarden.model.families import FAMILIES
from tests.helpers.common import write_yaml
from tests.helpers.kubelet import FakeKubelet
from tests.helpers.stack import PROMETHEUS
from tests.helpers.stack import stack as running_stack

pytestmark = [pytest.mark.slow, pytest.mark.serial]  # end-to-end, and measured under load or against real clocks

ROOT = Path(__file__).resolve().parent.parent
FOLDER = ROOT / "grafana_dashboards"
SPEC = importlib.util.spec_from_file_location("dashboards_build", FOLDER / "build.py")
build = importlib.util.module_from_spec(SPEC)
SPEC.loader.exec_module(build)
XID_EVENTS = build.xid_events(build.GPU_SELECTOR)
UNITS = {"percentunit", "bytes", "Bps", "celsius", "watt", "hertz", "joule", "s", "ops", "none"}
SCENARIOS = [
    "healthy",
    "thermal-throttling",
    "ecc-uncorrectable",
    "nvlink-down",
    "gpu-lost",
    "mig-inference",
    "fabric-degraded",
    "nvswitch-sxid",  # the kernel log's panel
    "driver-library-crash",  # a crash report naming the driver's library: only ignored, and counted
]
# what a query may reference beyond the exporter's families
EXTERNAL = {"ALERTS", "up"}


def dashboards() -> dict[str, dict]:
    return {name: json.loads((FOLDER / name).read_text()) for name in build.DASHBOARDS}


def panels(dashboard: dict) -> list[dict]:
    return [p for p in dashboard["panels"] if p["type"] != "row"]


def exprs(dashboard: dict) -> list[tuple[str, str]]:
    return [(p["title"], t["expr"]) for p in panels(dashboard) for t in p["targets"]]


def test_committed_json_matches_the_generator():
    for name, text in build.render().items():
        assert (FOLDER / name).read_text() == text, "run `python grafana_dashboards/build.py`"


def test_lint():
    uids = set()
    for name, board in dashboards().items():
        assert board["uid"] not in uids and re.fullmatch(r"[a-z0-9-]{1,40}", board["uid"])
        uids.add(board["uid"])
        assert board["schemaVersion"] >= 39 and board["editable"] is False and board["id"] is None
        variables = {v["name"]: v for v in board["templating"]["list"]}
        assert variables["datasource"]["type"] == "datasource" and variables["datasource"]["label"] == "Data Source"
        assert variables["job"]["multi"] and variables["job"]["allValue"] == ".+" and variables["job"]["refresh"] == 2
        one_node = name == "gpuwarden-node.json"  # opens on one node, not the fleet; its legends name no pod IP
        for var in ("node", "instance"):
            assert variables[var]["multi"] is not one_node and variables[var]["includeAll"] is not one_node, name
            assert variables[var]["refresh"] == 2
        for panel in panels(board):
            where = f"{name}: {panel['title']}"
            assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, where
            assert panel["description"].strip(), where
            assert panel["targets"], where
            assert panel["fieldConfig"]["defaults"]["unit"] in UNITS, where
            for target in panel["targets"]:
                expr = target["expr"]
                assert target["datasource"]["uid"] == "${datasource}", where
                assert 'job=~"$job"' in expr and 'instance=~"$instance"' in expr, (where, expr)
                for window in re.findall(r"(?:rate|increase)\([^\[]*\[([^\]]+)\]", expr):
                    assert window in ("$__rate_interval", "$__range"), (where, expr)
                for counter in re.findall(r"\b(gpuwarden_\w+_total)\b", expr):
                    assert (
                        re.search(rf"(rate|increase)\({counter}", expr)
                        or f"{counter}{{" in expr
                        and ("> 0" in expr or "increase" in expr)
                        or expr == XID_EVENTS  # events per step, a counter's birth counted (xid_events)
                    ), (where, expr)


def test_queries_reference_only_exported_metrics():
    known = set(FAMILIES) | EXTERNAL
    for name, board in dashboards().items():
        texts = [e for _, e in exprs(board)] + [v.get("definition", "") for v in board["templating"]["list"]]
        for text in texts:
            for metric in re.findall(r"\b(gpuwarden_[a-z_]+|ALERTS|up)\b(?=\{|\)|\s|$)", text):
                assert metric in known, (name, metric, text)


def test_no_panel_needs_an_opt_in_group():
    """Every panel has data at the default metric set: no target queries a family (or the rows of one) that only an
    opt-in collector group exports. The live test below proves it against Prometheus at the defaults."""
    from gpuwarden.model.families import GROUPS

    whole = {m.family.name: g.name for g in GROUPS.values() for m in g.members if m.label is None and not m.zero_rows}
    needing = []
    for name, board in dashboards().items():
        for panel in panels(board):
            for target in panel["targets"]:
                for metric in re.findall(r"\b(gpuwarden_\w+)\b", target["expr"]):
                    if metric in whole:
                        needing.append((name, panel["title"], metric, whole[metric]))
    assert not needing, needing


def test_health_panels_link_the_runbooks_and_the_fleet_drills_down_to_the_node():
    node, fleet = dashboards()["gpuwarden-node.json"], dashboards()["gpuwarden-fleet.json"]
    for board, title in ((node, "Health status per GPU"), (node, "Failing checks"), (fleet, "Unhealthy GPUs")):
        panel = next(p for p in panels(board) if p["title"] == title)
        assert any("runbooks.md" in link["url"] for link in panel.get("links", [])), title
    unhealthy = next(p for p in panels(fleet) if p["title"] == "Unhealthy GPUs")
    (drill,) = unhealthy["fieldConfig"]["defaults"]["links"]
    assert drill["url"].startswith(f"/d/{node['uid']}/") and "var-instance=${__data.fields.instance}" in drill["url"]


def test_thresholds_follow_the_alert_thresholds():
    from gpuwarden.health.thresholds import DEFAULT

    node = dashboards()["gpuwarden-node.json"]
    temperature = next(p for p in panels(node) if p["title"] == "GPU temperature")
    steps = [s["value"] for s in temperature["fieldConfig"]["defaults"]["thresholds"]["steps"]]
    assert DEFAULT.temperature_warning_celsius in steps and DEFAULT.temperature_critical_celsius in steps


def substitute(expr: str) -> str:
    return (
        expr.replace("$__rate_interval", "10s")
        .replace("$__interval", "2s")
        .replace("$__range", "60s")
        .replace('"$job"', '"gpuwarden"')
        .replace('"$node"', '".*"')
        .replace('"$instance"', '".+"')
        .replace('"$gpu"', '".+"')
        .replace("$price", "2.5")
    )


@pytest.fixture(scope="module")
def prometheus(tmp_path_factory):
    if PROMETHEUS is None:
        pytest.skip("Debian's prometheus is not installed (the README test command installs it)")
    with (
        tempfile.TemporaryDirectory(prefix="kubelet-") as short,
        running_stack(tmp_path_factory.mktemp("dashboards")) as parts,
    ):
        kubelet = FakeKubelet(Path(short) / "kubelet.sock").start()  # pod attribution on the thermal node
        # a bottleneck window the test can watch (300 s by default), so the class panels have data
        thresholds = write_yaml(Path(short) / "thresholds.yaml", {"bottleneck_window_s": 5})
        for scenario in SCENARIOS:
            flags = (
                ["--pods.resources-socket", str(kubelet.socket_path), "--pods.refresh-interval", "1"]
                if scenario == "thermal-throttling"
                else []
            )
            parts.exporter(scenario, "--health.thresholds-file", str(thresholds), *flags)
        parts.start_prometheus(generate.alert_rules_yaml(rules.build(), for_scale=1 / 240), node_labels=True)
        thermal = parts.instance_of("thermal-throttling")
        uuids = [g["uuid"] for g in httpx.get(f"http://{thermal}/api/v1/gpus", timeout=5).json()["gpus"]]
        kubelet.pods = [
            ("research", "train-0", [("main", [("nvidia.com/gpu", uuids[:4])])]),
            ("inference", "serve-0", [("server", [("nvidia.com/gpu", uuids[4:])])]),
        ]
        time.sleep(25)  # NVLink 7 drops at 5 s, the GPU is lost at 8 s; rates need a few scrapes
        yield parts
        kubelet.stop()


def test_every_panel_query_returns_data(prometheus):
    """Every target of every panel (not only one per panel: a half-empty panel fails too), against nodes that all
    run the default metric set, as a cluster installed with the chart's defaults does."""
    empty = []
    for name, board in dashboards().items():
        for title, expr in exprs(board):
            if not prometheus.query(substitute(expr)):
                empty.append((name, title, expr))
    assert not empty, empty


def test_every_variable_query_returns_values(prometheus):
    for board in dashboards().values():
        for var in board["templating"]["list"]:
            if var["type"] != "query":
                continue
            match = re.fullmatch(r"label_values\((.+), (\w+)\)", var["definition"])
            assert match, var["definition"]
            selector, label = substitute(match.group(1)), match.group(2)
            body = httpx.get(
                prometheus.prometheus + f"/api/v1/label/{label}/values", params={"match[]": selector}, timeout=10
            ).json()
            assert body["status"] == "success" and body["data"], (var["name"], selector)


def panel_expr(board: str, title: str, index: int = 0) -> str:
    panel = next(p for p in panels(dashboards()[board]) if p["title"] == title)
    return substitute(panel["targets"][index]["expr"])


def test_panels_show_what_the_scenarios_imply(prometheus):
    def rows(board: str, title: str, index: int = 0) -> list[dict]:
        return prometheus.query(panel_expr(board, title, index))

    ecc = prometheus.instance_of("ecc-uncorrectable")
    unhealthy = {
        (r["metric"]["instance"], r["metric"]["gpu"], r["metric"]["check"])
        for r in rows("gpuwarden-fleet.json", "Unhealthy GPUs")
    }
    assert (ecc, "1", "ecc") in unhealthy
    assert not [row for row in unhealthy if row[0] == prometheus.instance_of("healthy")]
    thermal = prometheus.instance_of("thermal-throttling")
    reasons = {
        (r["metric"]["instance"], r["metric"]["gpu"], r["metric"]["reason"])
        for r in rows("gpuwarden-node.json", "Throttle time share")
        if float(r["value"][1]) > 0
    }
    assert (thermal, "2", "hw_thermal_slowdown") in reasons
    assert not [r for r in reasons if r[0] == prometheus.instance_of("healthy")]
    kernel = rows("gpuwarden-fleet.json", "Kernel log: SXids, GPUs off the bus, lines not counted, readers down")
    assert sorted(
        (r["metric"]["instance"], r["metric"].get("sxid") or r["metric"].get("reason"), r["value"][1]) for r in kernel
    ) == sorted(
        [
            (prometheus.instance_of("nvswitch-sxid"), "20034", "1"),
            (prometheus.instance_of("driver-library-crash"), "not_driver", "1"),
        ]
    )
    down = {(r["metric"]["instance"], r["metric"]["gpu"]) for r in rows("gpuwarden-fleet.json", "NVLink problems")}
    assert (prometheus.instance_of("nvlink-down"), "4") in down  # 17 links against its peers' 18
    links = {
        (r["metric"]["instance"], r["metric"]["gpu"]): float(r["value"][1])
        for r in rows("gpuwarden-node.json", "Active NVLinks of the GPU's links")
    }
    assert links[(prometheus.instance_of("nvlink-down"), "4")] == 17 / 18  # below 100 %: red, not green
    assert links[(prometheus.instance_of("healthy"), "0")] == 1.0
    lost = {
        (r["metric"]["instance"], r["metric"]["gpu"]): r["value"][1]
        for r in rows("gpuwarden-node.json", "Health status per GPU")
    }
    assert lost[(prometheus.instance_of("gpu-lost"), "6")] == "2"
    assert lost[(prometheus.instance_of("healthy"), "0")] == "0"
    # the node board lists a page held across restarts (it names the node, not the instance) beside the others
    firing = {(r["metric"]["alertname"], r["metric"]["node"]) for r in rows("gpuwarden-node.json", "Firing alerts")}
    lost_node = f"node-{prometheus.instance_of('gpu-lost').rsplit(':', 1)[1]}"
    assert ("GpuwardenGpuLost", lost_node) in firing, firing
    pods = {
        (r["metric"]["instance"], r["metric"]["gpu"], r["metric"]["namespace"], r["metric"]["pod"])
        for r in rows("gpuwarden-node.json", "Pods on these GPUs")
    }
    assert pods == {
        (thermal, str(g), "research" if g < 4 else "inference", "train-0" if g < 4 else "serve-0") for g in range(8)
    }
    by_namespace = {
        r["metric"]["namespace"]: float(r["value"][1])
        for r in rows("gpuwarden-fleet.json", "Idle GPU-hours by namespace")
    }
    assert set(by_namespace) == {"research", "inference"} and all(v >= 0 for v in by_namespace.values())
    # XID 79 at 7.5 s, the first of its code on that GPU: the events panel shows it (increase() read 0), at its step
    lost_gpu = prometheus.instance_of("gpu-lost")
    events = prometheus.query(f"max_over_time(({panel_expr('gpuwarden-node.json', 'XID events')})[60s:1s])")
    assert {(r["metric"]["instance"], r["metric"]["gpu"], r["metric"]["xid"], r["value"][1]) for r in events} == {
        (lost_gpu, "6", "79", "1"),
        (ecc, "1", "48", "1"),  # the ECC scenario's double-bit XID
    }
    offenders = rows("gpuwarden-fleet.json", "ECC and XID offenders", 1)
    assert {(r["metric"]["instance"], r["metric"]["gpu"], r["metric"]["xid"]) for r in offenders} == {
        (lost_gpu, "6", "79"),
        (ecc, "1", "48"),
    }
    hottest = rows("gpuwarden-fleet.json", "Hottest GPUs")
    assert {r["metric"]["instance"] for r in hottest[:2]} == {thermal}


def test_pickers_list_nodes_by_name_and_gpus_by_index(prometheus):
    """Not pod IPs and UUIDs: the node picker reads the `node` label, the GPU picker the index."""
    node = dashboards()["gpuwarden-node.json"]
    variables = {v["name"]: v for v in node["templating"]["list"]}
    for name, check in (("node", lambda v: v.startswith("node-")), ("gpu", str.isdigit)):
        match = re.fullmatch(r"label_values\((.+), (\w+)\)", variables[name]["definition"])
        body = httpx.get(
            prometheus.prometheus + f"/api/v1/label/{match.group(2)}/values",
            params={"match[]": substitute(match.group(1))},
            timeout=10,
        ).json()
        assert body["data"] and all(check(value) for value in body["data"]), (name, body["data"])
    assert not variables["node"]["includeAll"]  # one node; without node labels (systemd hosts) `node=~""` matches
    legends = [t.get("legendFormat", "") for p in panels(node) for t in p["targets"]]
    assert legends and not [text for text in legends if "{{instance}}" in text]  # pod IPs named nothing


QUERY_START = re.compile(r"^(rate|increase|sum|max|min|avg|count|topk|bottomk|max_over_time|time)\b\s*[( ]")


def doc_queries() -> list[tuple[str, str]]:
    """The PromQL the README and docs/ give as queries to run: ```promql blocks, and code spans that start with a
    function or aggregation or join two gpuwarden series (not `name{labels} value` sample notation)."""
    found = []
    for path in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        text = path.read_text(encoding="utf-8")
        for block in re.findall(r"```promql\n(.*?)```", text, re.S):
            # a block may hold several queries, each under its own comment line
            for query in re.split(r"^#.*$", block, flags=re.M):
                if query.strip():
                    found.append((path.name, query.strip()))
        for span in re.findall(r"`([^`\n]+)`", text):
            if "gpuwarden_" in span and (QUERY_START.match(span) or span.count("gpuwarden_") >= 2):
                found.append((path.name, span))
    return found


def test_every_doc_query_parses_and_default_ones_return_data(prometheus):
    """Every query the docs tell a reader to run is valid PromQL; those over default series return data from nodes
    at the default metric set (opt-in ones, e.g. the "before" column of the NVLink table, only parse)."""
    from gpuwarden.model.families import GROUPS

    opt_in = {m.family.name for g in GROUPS.values() for m in g.members if m.label is None and not m.zero_rows}
    queries = doc_queries()
    assert len(queries) >= 20, queries  # the extraction itself works
    bad, empty = [], []
    for where, query in queries:
        body = httpx.get(prometheus.prometheus + "/api/v1/query", params={"query": query}, timeout=10).json()
        if body["status"] != "success":
            bad.append((where, query, body.get("error")))
        elif not body["data"]["result"] and not set(re.findall(r"gpuwarden_\w+", query)) & opt_in:
            empty.append((where, query))
    assert not bad, bad
    assert not empty, empty


def test_the_pods_panel_shows_holders_found_without_root(tmp_path: Path) -> None:
    """Pod attribution through the kubelet runs as UID 0; through /proc (processes.hostProc) it does not. The panel
    shows both kinds of rows, each once (promtool evaluates the panel's own query)."""
    import shutil
    import subprocess

    import yaml as yaml_lib

    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.fail("promtool missing: the README's test command installs Debian's prometheus package")
    expr = panel_expr("gpuwarden-node.json", "Pods on these GPUs")

    def holder(index: int, namespace: str, pod: str, container: str) -> str:
        where = f'instance="n1:10045",gpu="{index}",uuid="G{index}"'
        return f'{where},namespace="{namespace}",pod="{pod}",container="{container}"'

    def series(name: str, labels: str, values: str) -> dict[str, str]:
        return {"series": f'{name}{{job="gpuwarden",node="n1",{labels}}}', "values": values}

    memory = "gpuwarden_container_gpu_memory_used_bytes"
    test = {
        "rule_files": [],
        "evaluation_interval": "1m",
        "tests": [
            {
                "interval": "1m",
                "input_series": [
                    # GPU 0: allocated by the kubelet, and its process found through /proc too: one row
                    series("gpuwarden_gpu_allocation", holder(0, "a", "p", "c"), "1x5"),
                    series(memory, holder(0, "a", "p", "c"), "5e9x5"),
                    # GPU 1: no kubelet attribution, its holder found through /proc: a row
                    series(memory, holder(1, "b", "q", "d"), "7e9x5"),
                    # GPU 2: a process no pod holds: no row
                    series(memory, holder(2, "", "", ""), "1e9x5"),
                ],
                "promql_expr_test": [
                    {
                        "expr": expr,
                        "eval_time": "3m",
                        "exp_samples": [
                            {"labels": "{" + holder(0, "a", "p", "c") + "}", "value": 1},
                            {"labels": "{" + holder(1, "b", "q", "d") + "}", "value": 1},
                        ],
                    }
                ],
            }
        ],
    }
    (tmp_path / "test.yaml").write_text(yaml_lib.safe_dump(test))
    ran = subprocess.run([promtool, "test", "rules", "test.yaml"], capture_output=True, text=True, cwd=tmp_path)
    assert ran.returncode == 0, ran.stdout + ran.stderr
