"""The Grafana dashboard deploy/grafana/kvroute.json: well-formed, and every query names
metrics kvroute exports (a renamed family breaks this test, not a panel in production)."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from tests.support.exported import exported, router_exposition, worker_exposition

DASHBOARD = Path(__file__).resolve().parents[2] / "deploy" / "grafana" / "kvroute.json"
_METRIC = re.compile(r"\b((?:kvroute|inference_pool)_[a-z0-9_]+)")
_HISTOGRAM_SAMPLES = re.compile(r"_(bucket|count|sum)$")


def panels() -> list[dict[str, Any]]:
    return json.loads(DASHBOARD.read_text())["panels"]  # type: ignore[no-any-return]


def queries() -> list[tuple[str, str]]:
    return [(p["title"], t["expr"]) for p in panels() if p["type"] != "row"
            for t in p["targets"]]


def balanced(expr: str) -> bool:
    stack = []
    pairs = {")": "(", "]": "[", "}": "{"}
    for ch in re.sub(r'"[^"]*"', "", expr):
        if ch in "([{":
            stack.append(ch)
        elif ch in pairs and (not stack or stack.pop() != pairs[ch]):
            return False
    return not stack


async def test_every_query_names_only_metrics_kvroute_exports() -> None:
    names = exported(router_exposition()) | exported(await worker_exposition())
    for title, expr in queries():
        used = {_HISTOGRAM_SAMPLES.sub("", m) for m in _METRIC.findall(expr)}
        assert used, f"{title}: {expr} names no kvroute metric"
        assert used <= names, f"{title}: {expr} names {used - names}, which nothing exports"
        assert balanced(expr), f"{title}: unbalanced brackets in {expr}"


def test_histograms_are_queried_by_bucket_and_counters_by_rate() -> None:
    for title, expr in queries():
        for quantile in re.findall(r"histogram_quantile\([^,]+,(.*)", expr):
            assert "_bucket[" in quantile, f"{title}: a quantile of no bucket series"
        for counter in re.findall(r"\b(kvroute_[a-z0-9_]+_total)\b", expr):
            assert re.search(rf"rate\({counter}\[", expr), f"{title}: {counter} without rate"


def test_the_dashboard_covers_what_an_operator_reads_first() -> None:
    titles = {p["title"] for p in panels()}
    assert {"Time to first token", "Inter-token latency",
            "Cached prompt tokens: predicted vs delivered", "Share of requests per worker",
            "Requests in flight per worker", "Event lag per worker",
            "Event gaps, lost history and resyncs", "Worker errors by cause"} <= titles
    ids = [p["id"] for p in panels()]
    assert len(ids) == len(set(ids))
    for p in panels():
        if p["type"] != "row":
            assert p["datasource"]["uid"] == "${datasource}", p["title"]
            assert {t["refId"] for t in p["targets"]} == {chr(65 + i)
                                                          for i in range(len(p["targets"]))}
