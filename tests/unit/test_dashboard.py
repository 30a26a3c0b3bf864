"""The Grafana dashboard: the checked-in JSON is what the code builds, and its queries name only exported metrics."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

pytest.importorskip("grafana_foundation_sdk", reason="grafana-foundation-sdk is not installed (kvlane[dashboard])")

from prometheus_client import CollectorRegistry  # noqa: E402

from kvlane.cli import main  # noqa: E402
from kvlane.dashboard import expressions, render  # noqa: E402
from services.autoscaler.metrics import AutoscalerMetrics  # noqa: E402
from services.balancer.metrics import BalancerMetrics  # noqa: E402
from services.cache_manager.metrics import CacheMetrics  # noqa: E402
from services.health_prober.metrics import HealthMetrics  # noqa: E402
from services.ingress.metrics import IngressMetrics  # noqa: E402
from services.worker.metrics import WorkerMetrics  # noqa: E402
from shared.cluster import ClusterView  # noqa: E402

CHECKED_IN = Path(__file__).resolve().parents[2] / "deploy" / "grafana" / "kvlane.json"
# PromQL words that look like metric names but are not.
_KEYWORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "bool", "and", "or", "unless", "offset", "inf", "nan"}


def metric_names(expr: str) -> set[str]:
    """The metric names a PromQL expression reads (the identifiers left once labels, ranges and functions are out)."""
    stripped = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)
    stripped = re.sub(r"\{[^}]*\}", "", stripped)
    stripped = re.sub(r"\[[^\]]*\]", "", stripped)
    stripped = re.sub(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", "", stripped)
    names = set()
    for match in re.finditer(r"(?<![\w.:$])[A-Za-z_:][A-Za-z0-9_:]*", stripped):
        if stripped[match.end():].lstrip().startswith("(") or match.group() in _KEYWORDS:
            continue  # a function, or an operator
        names.add(match.group())
    return names


def exported_names() -> set[str]:
    """Every sample name the services' registries expose, as PromQL sees them."""
    health = HealthMetrics()
    health.watch(lambda: [])
    balancer = BalancerMetrics()
    balancer.track_degradation({"shed": 0})
    registries: list[CollectorRegistry] = [
        IngressMetrics(ClusterView(3.0)).registry, balancer.registry, CacheMetrics().registry,
        WorkerMetrics().registry, health.registry, AutoscalerMetrics().registry,
    ]
    suffixes = {"counter": ("_total", "_created"), "histogram": ("_bucket", "_count", "_sum", "_created"), "gauge": ("",)}
    names = set()
    for registry in registries:
        for family in registry.collect():
            names |= {family.name + suffix for suffix in suffixes[family.type]}
    return names


def test_checked_in_dashboard_is_what_the_code_builds() -> None:
    assert CHECKED_IN.read_text() == render(), "regenerate it: kvlane dashboard --output deploy/grafana/kvlane.json"


def test_every_query_names_only_exported_metrics() -> None:
    exported = exported_names()
    queries = expressions(json.loads(render()))
    assert len(queries) > 20
    unknown = {(expr, name) for expr in queries for name in metric_names(expr) if name not in exported}
    assert not unknown
    used = set().union(*(metric_names(expr) for expr in queries))
    for name in ("vllm:time_to_first_token_seconds_bucket", "vllm:inter_token_latency_seconds_bucket",
                 "vllm:request_success_total", "vllm:num_requests_waiting", "kvlane_balancer_queue_length",
                 "vllm:kv_cache_usage_perc", "vllm:prefix_cache_hits_total", "kvlane_balancer_decisions_total",
                 "kvlane_worker_kv_pull_bytes_total", "kvlane_worker_kv_pull_seconds_total"):
        assert name in used, name
    variable = json.loads(render())["templating"]["list"][1]["query"]
    assert metric_names(variable.removeprefix("label_values(").split(",")[0]) <= exported


def test_metric_names_sees_through_promql() -> None:
    expr = ('histogram_quantile(0.9, sum by (le, model_name) (rate(vllm:x_bucket{model_name=~"$model", le="1.0"}'
            '[$__rate_interval]))) / max by (worker) (kvlane_y_total) > bool 0 or on(worker) kvlane_z')
    assert metric_names(expr) == {"vllm:x_bucket", "kvlane_y_total", "kvlane_z"}
    assert metric_names("rate(vllm:not_exported_total[5m])") - exported_names() == {"vllm:not_exported_total"}


def test_cli_writes_the_dashboard(tmp_path: Path) -> None:
    output = tmp_path / "grafana" / "kvlane.json"
    with pytest.raises(SystemExit) as exit_info:
        main(["dashboard", "--output", str(output)])
    assert exit_info.value.code == 0
    assert output.read_text() == render()
