"""The Grafana dashboard (``docs/grafana/feather-dashboard.json``) against the series Feather
really exports: every query names only exported series and labels, under both of the
dashboard's series prefixes (a server's ``feather:``, Ray Serve's relayed
``ray_feather_``), and every exported series is on some panel.

The exported names are not listed by hand: every metric object of
``feather_sched.telemetry.prometheus`` is recorded once in multiprocess mode, in a child
process, and read back as a server's registry collects it (counters' ``_total``,
histograms' ``_bucket``/``_sum``/``_count``)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from feather_sched.integrations.ray.metrics import ray_name

ROOT = Path(__file__).parents[2]
DASHBOARD = ROOT / "docs" / "grafana" / "feather-dashboard.json"

EXPORT = """
import dataclasses, json
from prometheus_client import CollectorRegistry, Counter, Gauge, multiprocess
from feather_sched.telemetry import prometheus

metrics = prometheus._registered()
for field in dataclasses.fields(metrics):
    metric = getattr(metrics, field.name)
    child = metric.labels(*["x"] * len(metric._labelnames))
    if isinstance(metric, Counter):
        child.inc()
    elif isinstance(metric, Gauge):
        child.set(1)
    else:
        child.observe(1)
registry = CollectorRegistry()
multiprocess.MultiProcessCollector(registry)
labels = {}
for family in registry.collect():
    for sample in family.samples:
        labels.setdefault(sample.name, set()).update(sample.labels)
print(json.dumps({name: sorted(names) for name, names in labels.items()}))
"""

TARGET_LABELS = {"instance", "job"}
"""Labels Prometheus adds to every series it scrapes."""
RAY_SERVE_LABELS = {"replica", "deployment", "application"}
"""Tags Ray Serve adds to every metric a replica records (``ray.serve.metrics``); grouping
by one where it is absent (a server's own ``/metrics``) is harmless."""
GRAFANA_VARIABLES = {"__rate_interval": "5m", "__interval": "1m", "__range": "1h"}
KEYWORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "bool", "and",
            "or", "unless", "offset", "inf", "nan"}


def exported(tmp: str) -> dict[str, set[str]]:
    """Every sample name the metrics endpoint serves, with its labels."""
    env = {**os.environ, "PROMETHEUS_MULTIPROC_DIR": tmp}
    done = subprocess.run([sys.executable, "-c", EXPORT], capture_output=True, text=True,
                          env=env, check=True, cwd=ROOT, timeout=120)
    return {name: set(labels) for name, labels in json.loads(done.stdout).items()}


@pytest.fixture(scope="module")
def series(tmp_path_factory) -> dict[str, dict[str, set[str]]]:
    """Per series prefix of the dashboard: the names exported under it, with labels."""
    direct = exported(str(tmp_path_factory.mktemp("multiproc")))
    return {"feather:": direct,
            "ray_" + ray_name("feather:"): {"ray_" + ray_name(name): labels | RAY_SERVE_LABELS
                                            for name, labels in direct.items()}}


def dashboard() -> dict:
    return json.loads(DASHBOARD.read_text())


def variables() -> dict[str, dict]:
    return {variable["name"]: variable for variable in dashboard()["templating"]["list"]}


def expressions() -> list[tuple[str, str]]:
    """(where, PromQL) of every panel target and every query variable."""
    found = [(f"panel {panel['title']!r} {target['refId']}", target["expr"])
             for panel in dashboard()["panels"] for target in panel["targets"]]
    found += [(f"variable {name!r}", variable["query"]["query"])
              for name, variable in variables().items() if variable["type"] == "query"]
    return found


def substituted(expr: str, prefix: str) -> str:
    """``expr`` as Grafana sends it with the series prefix ``prefix``."""
    values = {**GRAFANA_VARIABLES, "prefix": prefix, "scheduler": ".*"}

    def value(match: re.Match) -> str:
        name = match.group(1) or match.group(2)
        assert name in values, f"{name} is neither a dashboard nor a Grafana variable"
        return values[name]

    return re.sub(r"\$\{(\w+)\}|\$(\w+)", value, expr)


def parsed(expr: str) -> tuple[set[str], set[str]]:
    """A PromQL expression's series names and the label names it matches or groups by."""
    expr = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)
    labels = set()
    for matchers in re.findall(r"\{([^}]*)\}", expr):
        labels |= set(re.findall(r"(\w+)\s*(?:=~|!~|!=|=)", matchers))
    expr = re.sub(r"\{[^}]*\}|\[[^\]]*\]", " ", expr)
    for clause in re.findall(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*"
                             r"\(([^)]*)\)", expr):
        labels |= {label.strip() for label in clause.split(",") if label.strip()}
    expr = re.sub(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", " ",
                  expr)
    if expr.lstrip().startswith("label_values("):  # a variable's query: (series, label)
        series_name, _, label = expr.strip()[len("label_values("):-1].rpartition(",")
        return {series_name.strip()}, labels | {label.strip()}
    identifiers = re.findall(r"(?<![\w:.])([A-Za-z_:][\w:]*)(?![\w:])(?!\s*\()", expr)
    names = {name for name in identifiers if name.lower() not in KEYWORDS}
    return names, labels


def test_the_parser_sees_series_and_labels() -> None:
    names, labels = parsed('histogram_quantile(0.99, sum by (le) (rate(a:b_bucket'
                           '{scheduler=~".*"}[5m]))) / on (x) c_total offset 5m')
    assert names == {"a:b_bucket", "c_total"} and labels == {"le", "scheduler", "x"}
    assert parsed("label_values(a:b_total, scheduler)") == ({"a:b_total"}, {"scheduler"})


def test_the_series_prefixes_are_the_servers_and_rays(series) -> None:
    prefix = variables()["prefix"]
    offered = [option["value"] for option in prefix["options"]]
    assert sorted(offered) == sorted(series)
    assert prefix["query"].split(",") == offered
    assert prefix["current"]["value"] == "feather:"
    assert all(name.startswith("feather:") for name in series["feather:"])


@pytest.mark.parametrize("prefix", ["feather:", "ray_feather_"])
def test_every_query_names_only_exported_series_and_their_labels(series, prefix) -> None:
    names = series[prefix]
    for where, expr in expressions():
        used, labels = parsed(substituted(expr, prefix))
        assert used, f"{where}: no series in {expr}"
        unknown = used - set(names)
        assert not unknown, f"{where}: {sorted(unknown)} not exported (under {prefix})"
        known = set().union(*(names[name] for name in used)) | TARGET_LABELS | \
            RAY_SERVE_LABELS
        assert labels <= known, f"{where}: labels {sorted(labels - known)} on no series"


def test_every_exported_series_is_on_some_panel(series) -> None:
    shown = set()
    for where, expr in expressions():
        if where.startswith("panel "):
            shown |= parsed(substituted(expr, "feather:"))[0]
    assert set(series["feather:"]) - shown == set()


def test_the_dashboard_imports_as_grafana_reads_it() -> None:
    board = dashboard()
    panels = board["panels"]
    assert board["uid"] and board["title"] and panels
    assert len({panel["id"] for panel in panels}) == len(panels)
    cells = [(panel["gridPos"]["x"], panel["gridPos"]["y"]) for panel in panels]
    assert len(set(cells)) == len(cells)  # no panel drawn over another
    assert variables()["datasource"]["type"] == "datasource"
    for panel in panels:
        assert panel["type"] == "timeseries" and panel["title"] and panel["description"]
        refs = [target["refId"] for target in panel["targets"]]
        assert len(set(refs)) == len(refs)
        for part in (panel, *panel["targets"]):
            assert part["datasource"] == {"type": "prometheus", "uid": "${datasource}"}
