"""A real Prometheus server scrapes a real sim fleet; PromQL over its HTTP API must add up to the load sent.

The fleet runs every service with its own `/metrics` (the ingress on its HTTP
port); Prometheus scrapes them all every second. After a known load of
completions, the test waits until every target has been scraped after the
load (by each target's `timestamp(up)`), then checks the vLLM-compatible
series and kvlane's own against what the clients were answered.
"""

from __future__ import annotations

import asyncio
import json
import shutil
import time
import urllib.error
import urllib.parse
import urllib.request
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import pytest

from launch.fleet import Fleet, with_overrides
from launch.launcher import Launcher, Process, free_port, servers_available, wait_ready, wait_services_ready
from shared.config import to_env
from tests.integration.conftest import MODEL, fleet_config
from tests.waiting import wait_for

PROMETHEUS = shutil.which("prometheus")

pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(not servers_available(), reason="nats-server or redis-server not found"),
    pytest.mark.skipif(PROMETHEUS is None, reason="the prometheus binary is not on PATH (Debian: apt-get install prometheus)"),
]

REQUESTS = 12
SCRAPE_INTERVAL = "1s"
# Heartbeats come every 0.25 s (FAST_HEARTBEATS): a scrape this long after the load sees the workers' final counts.
SETTLE_S = 1.0


@dataclass
class Scraped:
    fleet: Fleet
    prometheus_url: str
    targets: dict[str, list[str]]


def start_fleet_with_metrics(launcher: Launcher, log_dir: Path) -> tuple[Fleet, dict[str, list[str]]]:
    """Two workers, a balancer, a cache-manager and a health-prober, each serving `/metrics` on a port of its own."""
    nats_port, redis_port = free_port(), free_port()
    launcher.start_nats(nats_port)
    launcher.start_redis(redis_port)
    ports = {"balancer": free_port(), "cache_manager": free_port(), "health_prober": free_port()}
    config = with_overrides(
        fleet_config(nats_port, redis_port),
        balancer={"metrics_port": ports["balancer"]},
        cache_manager={"metrics_port": ports["cache_manager"]},
        health={"metrics_port": ports["health_prober"]},
    )
    fleet = Fleet(launcher, config, f"http://127.0.0.1:{config.ingress.port}")
    fleet.add_balancer()
    fleet.add_cache_manager()
    fleet.health_probers.append(launcher.start_service("health_prober", to_env(config), name="health-prober"))
    wait_services_ready([*fleet.balancers, *fleet.cache_managers, *fleet.health_probers])
    # Fleet.add_worker gives each worker the next port up from worker.metrics_port.
    first = free_port(count=2)
    worker_ports = [first, first + 1]
    fleet.config = with_overrides(config, worker={"metrics_port": first})
    for index in range(2):
        fleet.add_worker(f"w{index}")
    fleet.ingress = launcher.start_service("ingress", to_env(config))
    wait_ready(fleet.base_url, 60.0, fleet.services(), min_workers=2)
    targets = {job: [f"127.0.0.1:{port}"] for job, port in ports.items()}
    targets["worker"] = [f"127.0.0.1:{port}" for port in worker_ports]
    targets["ingress"] = [f"127.0.0.1:{config.ingress.port}"]
    return fleet, targets


def start_prometheus(launcher: Launcher, directory: Path, targets: dict[str, list[str]]) -> str:
    port = free_port()
    config = {
        "global": {"scrape_interval": SCRAPE_INTERVAL, "scrape_timeout": SCRAPE_INTERVAL},
        "scrape_configs": [{"job_name": job, "static_configs": [{"targets": addresses}]} for job, addresses in targets.items()],
    }
    config_file = directory / "prometheus.yml"
    config_file.write_text(json.dumps(config, indent=2))  # JSON is YAML
    process = launcher.spawn("prometheus", [
        str(PROMETHEUS), f"--config.file={config_file}", f"--storage.tsdb.path={directory / 'tsdb'}",
        f"--web.listen-address=127.0.0.1:{port}",
    ])
    url = f"http://127.0.0.1:{port}"
    wait_for(lambda: _ready(url, process), 30.0, "prometheus to be ready")
    return url


def _ready(url: str, process: Process) -> bool:
    if not process.alive():
        raise AssertionError(f"prometheus exited with {process.popen.returncode}:\n{process.log_tail()}")
    try:
        with urllib.request.urlopen(f"{url}/-/ready", timeout=2) as response:
            return response.status == 200
    except (urllib.error.URLError, OSError):
        return False


def query(url: str, promql: str) -> list[dict]:
    """An instant PromQL query; its result vector."""
    with urllib.request.urlopen(f"{url}/api/v1/query?{urllib.parse.urlencode({'query': promql})}", timeout=5) as response:
        body = json.loads(response.read())
    assert body["status"] == "success", body
    return body["data"]["result"]


def scalar(url: str, promql: str) -> float:
    result = query(url, promql)
    assert len(result) == 1, f"{promql}: expected one series, got {result}"
    return float(result[0]["value"][1])


def by(url: str, promql: str, label: str) -> dict[str, float]:
    return {series["metric"].get(label, ""): float(series["value"][1]) for series in query(url, promql)}


@pytest.fixture(scope="module")
def scraped(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Scraped]:
    directory = tmp_path_factory.mktemp("prometheus")
    launcher = Launcher(directory / "logs")
    try:
        fleet, targets = start_fleet_with_metrics(launcher, directory)
        url = start_prometheus(launcher, directory, targets)
        yield Scraped(fleet, url, targets)
    finally:
        launcher.stop_all()


async def send_load(base_url: str) -> list[dict]:
    """REQUESTS completions; two long prompts sent several times each, so the prefix cache hits."""
    prompts = [" ".join(f"{topic} word{i}" for i in range(120)) for topic in ("alpha", "beta")]
    async with aiohttp.ClientSession() as session:

        async def one(index: int) -> dict:
            body = {"model": MODEL, "prompt": prompts[index % 2], "max_tokens": 6 + 2 * (index % 3), "temperature": 0}
            async with session.post(f"{base_url}/v1/completions", json=body, timeout=aiohttp.ClientTimeout(total=60)) as response:
                assert response.status == 200, await response.text()
                return await response.json()

        # Two waves: the second finds the first's prompts in the prefix caches.
        first = await asyncio.gather(*(one(i) for i in range(REQUESTS // 2)))
        second = await asyncio.gather(*(one(i) for i in range(REQUESTS // 2, REQUESTS)))
    return [*first, *second]


def test_promql_over_a_real_prometheus_adds_up_to_the_load(scraped: Scraped) -> None:
    url = scraped.prometheus_url
    answers = asyncio.run(send_load(scraped.fleet.base_url))
    load_ended = time.time()
    completion = [a["usage"]["completion_tokens"] for a in answers]
    prompt = sum(a["usage"]["prompt_tokens"] for a in answers)
    cached = sum(a["usage"]["prompt_tokens_details"]["cached_tokens"] for a in answers)
    reasons = Counter(a["choices"][0]["finish_reason"] for a in answers)
    assert sum(completion) > REQUESTS  # the ITL check below needs more than one token per request

    # Every target scraped (and up) after the load settled: from here on, values are final.
    jobs = len([address for addresses in scraped.targets.values() for address in addresses])
    wait_for(lambda: len(query(url, f"timestamp(up == 1) > {load_ended + SETTLE_S}")) == jobs, 30.0,
             f"all {jobs} targets to be scraped after the load: {query(url, 'up')}")

    # Request metrics, vLLM names, measured at the ingress.
    assert scalar(url, "sum(vllm:request_success_total)") == REQUESTS
    assert by(url, "sum by (finished_reason) (vllm:request_success_total) > 0", "finished_reason") == reasons
    assert scalar(url, "sum(vllm:generation_tokens_total)") == sum(completion)
    assert scalar(url, "sum(vllm:prompt_tokens_total)") == prompt
    assert scalar(url, "sum(vllm:prompt_tokens_cached_total)") == cached
    for histogram in ("time_to_first_token_seconds", "e2e_request_latency_seconds", "request_queue_time_seconds"):
        assert scalar(url, f"sum(vllm:{histogram}_count)") == REQUESTS, histogram
    # One inter-token interval between each pair of consecutive chunks (the sim engine sends a token per chunk).
    assert scalar(url, "sum(vllm:inter_token_latency_seconds_count)") == sum(completion) - REQUESTS
    assert scalar(url, 'count(vllm:request_success_total{model_name="kvlane-sim"})') >= 1
    ttft_p50 = scalar(url, "histogram_quantile(0.5, sum by (le) (vllm:time_to_first_token_seconds_bucket))")
    e2e_p99 = scalar(url, "histogram_quantile(0.99, sum by (le) (vllm:e2e_request_latency_seconds_bucket))")
    assert 0 < ttft_p50 < 60 and 0 < e2e_p99 < 60
    assert scalar(url, "sum(vllm:request_queue_time_seconds_sum)") >= 0

    # Per-node engine metrics, from the heartbeats, on the ingress.
    nodes = ("w0", "w1")
    for gauge in ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc"):
        values = by(url, f'{gauge}{{job="ingress", model_name="{MODEL}"}}', "worker")
        assert sorted(values) == list(nodes), (gauge, values)
        assert all(value >= 0 for value in values.values()), (gauge, values)
    assert all(0 <= v <= 1 for v in by(url, "vllm:kv_cache_usage_perc", "worker").values())
    queries = scalar(url, "sum(vllm:prefix_cache_queries_total)")
    hits = scalar(url, "sum(vllm:prefix_cache_hits_total)")
    assert queries >= prompt  # every admission looks its prompt up (health probes add theirs)
    assert cached <= hits <= queries and hits > 0
    assert sorted(by(url, "vllm:num_preemptions_total", "worker")) == list(nodes)
    assert sorted(by(url, 'kvlane_worker_info{role="aggregated", engine="sim"}', "worker")) == list(nodes)

    # kvlane's own, each on the service that knows it.
    decisions = query(url, "sum by (policy, outcome) (kvlane_balancer_decisions_total) > 0")
    assert {d["metric"]["policy"] for d in decisions} == {scraped.fleet.config.balancer.policy}
    assert sum(float(d["value"][1]) for d in decisions if d["metric"]["outcome"] in ("placed", "queued")) == REQUESTS
    assert scalar(url, "sum(kvlane_balancer_queue_length)") == 0
    assert scalar(url, "sum(kvlane_cache_indexed_blocks)") > 0  # the cache-manager heard the workers' KV events
    finished = scalar(url, 'sum(kvlane_worker_requests_finished_total{outcome=~"stop|length"})')
    assert finished >= REQUESTS  # the prober's canaries end on the workers too
    assert len(query(url, "kvlane_worker_requests_in_flight")) == 2
    assert by(url, "sum by (worker) (kvlane_health_node_state)", "worker") == {"w0": 1, "w1": 1}
    assert scalar(url, 'sum(kvlane_health_probes_total{result="ok"})') > 0
    assert scalar(url, 'sum(kvlane_ingress_requests_total{endpoint="/v1/completions", status="200"})') == REQUESTS


def test_every_dashboard_query_is_valid_promql(scraped: Scraped) -> None:
    """The Grafana dashboard's queries, with its variables filled in, as Prometheus itself parses them."""
    pytest.importorskip("grafana_foundation_sdk", reason="grafana-foundation-sdk is not installed (kvlane[dashboard])")
    from kvlane.dashboard import expressions, render

    for expr in expressions(json.loads(render())):
        promql = expr.replace("$__rate_interval", "1m").replace("$model", ".*")
        try:
            query(scraped.prometheus_url, promql)
        except urllib.error.HTTPError as exc:
            raise AssertionError(f"{promql}: {exc.read().decode()}") from exc
