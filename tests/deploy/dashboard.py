"""The Grafana dashboard's panels and queries, and its queries as plain PromQL.

Grafana substitutes template variables before a query reaches Prometheus; ``promql`` does
the same with the values "All" gives (``.*``) and a fixed rate window.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from tests.deploy.manifests import REPO

DASHBOARD_FILE = REPO / "deploy" / "grafana" / "dashboards" / "lmcache-svc.json"
GRAFANA_BUILTINS = {"__rate_interval", "__interval", "__range"}
# Metric names in PromQL: an identifier (colons allowed) followed by a selector, a range or
# the end of a function argument; label names and functions are excluded below.
_NAME = re.compile(r"(?<![\w:\"$.])([a-zA-Z_:][\w:]*)\s*(?=\{|\[|\)|$|\s*(?:/|\*|\+|-|>|<|or\b))")
_FUNCTIONS = {
    "sum",
    "rate",
    "min",
    "max",
    "histogram_quantile",
    "by",
    "ignoring",
    "group_left",
    "on",
    "without",
    "or",
    "and",
    "unless",
    "count",
    "avg",
}


@dataclass(frozen=True)
class Query:
    panel: str
    ref_id: str
    expr: str

    def promql(self, rate_window: str) -> str:
        return promql(self.expr, rate_window)

    def metric_names(self) -> set[str]:
        return metric_names(self.expr)


def load() -> dict[str, Any]:
    data: dict[str, Any] = json.loads(DASHBOARD_FILE.read_text())
    return data


def panels(dashboard: dict[str, Any]) -> Iterator[dict[str, Any]]:
    """Every panel, including those nested in collapsed rows."""
    for panel in dashboard["panels"]:
        yield panel
        yield from panel.get("panels", [])


def queries(dashboard: dict[str, Any]) -> list[Query]:
    return [
        Query(p["title"], t["refId"], t["expr"])
        for p in panels(dashboard) if p["type"] != "row"
        for t in p.get("targets", [])
    ]  # fmt: skip


def variables(dashboard: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {v["name"]: v for v in dashboard["templating"]["list"]}


def used_variables(expr: str) -> set[str]:
    return set(re.findall(r"\$\{?(\w+)", expr))


def promql(expr: str, rate_window: str) -> str:
    """``expr`` as Grafana sends it with every variable at "All"."""
    out = expr.replace("$__rate_interval", rate_window).replace("${__rate_interval}", rate_window)
    return re.sub(r"\$\{?(\w+)\}?", ".*", out)


def metric_names(expr: str) -> set[str]:
    text = re.sub(r"\{[^}]*\}", "{}", expr)  # label matchers hold no metric names
    text = re.sub(r"by \([^)]*\)|ignoring\([^)]*\)|on\([^)]*\)", "", text)
    return {n for n in _NAME.findall(text) if n not in _FUNCTIONS and not n[0].isdigit()}
