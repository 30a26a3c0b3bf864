"""KEDA carries out the autoscaler's decisions: one autoscaler decides, each ScaledObject scales one worker
pool's Deployment on that pool's desired replicas, within the autoscaler's bounds, and Prometheus scrapes
what its query reads. Part of `k8s_checks.problems`.

A pool is one base model's workers of one role; a worker Deployment runs one model, so its ScaledObject selects
the role (`pool`) and may select the model (`model_name`), which must then be the one its workers serve.
"""

from __future__ import annotations

import re
from typing import Any

from contracts.autoscaler import POOLS, PoolKey
from shared.config import KvlaneConfig
from tests.unit.k8s_objects import AUTOSCALER_MODULE, WORKER_MODULES, pod_labels, selects

# The gauge services/autoscaler/metrics.py exports, one series per pool (model_name and pool): what KEDA scales on.
DESIRED_REPLICAS_METRIC = "kvlane_autoscaler_desired_replicas"
# The gauge services/balancer/metrics.py exports per model: requests waiting for a pool at zero, what wakes it.
HELD_FROM_ZERO_METRIC = "kvlane_balancer_held_from_zero"

# --- autoscaling: KEDA acts on the autoscaler's decisions ------------------------------------

# PromQL words that are neither functions nor metric names.
_PROMQL_KEYWORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "bool", "offset", "and", "or", "unless"}


def promql_parts(query: str) -> tuple[list[str], list[str], list[tuple[str, str, str]]]:
    """(functions and aggregations, metric names, label matchers) of a plain PromQL query."""
    matchers: list[tuple[str, str, str]] = []

    def take(selector: re.Match[str]) -> str:
        matchers.extend(re.findall(r'([A-Za-z_]\w*)\s*(=~|!~|!=|=)\s*"((?:[^"\\]|\\.)*)"', selector.group(1)))
        return " "

    outside = re.sub(r"\{([^}]*)\}", take, query)
    outside = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", " ", outside)
    outside = re.sub(r"\[[^\]]*\]", " ", outside)
    functions, names = [], [value for label, op, value in matchers if label == "__name__" and op == "="]
    for word, paren in re.findall(r"([A-Za-z_:][\w:]*)\s*(\()?", outside):
        if paren:
            functions.append(word)
        elif word not in _PROMQL_KEYWORDS:
            names.append(word)
    return functions, names, [m for m in matchers if m[0] != "__name__"]


def worker_pool(module: str, config: KvlaneConfig) -> PoolKey | None:
    """The autoscaler's pool a worker container serves: the model it registers, and its role (services.worker takes
    worker.role, aggregated by default)."""
    if module not in WORKER_MODULES:
        return None
    role = {"services.prefill_worker": "prefill", "services.decode_worker": "decode"}.get(module, config.worker.role)
    return PoolKey(config.worker.served_model, role)


def _bounds_section(config: KvlaneConfig, pool: PoolKey) -> str:
    """Where the autoscaler's configuration bounds `pool`."""
    own = config.autoscaler.models.get(pool.model)
    if own is not None and getattr(own, pool.role) is not None:
        return f'[autoscaler.models."{pool.model}".{pool.role}]'
    return f"[autoscaler.{pool.role}]"


def scaling_problems(docs: list[dict[str, Any]], workloads: list[dict[str, Any]], loaded: dict[str, tuple[str, KvlaneConfig, dict[str, Any]]]) -> list[str]:
    """One decider; each ScaledObject scales a worker Deployment to its pool's desired replicas, within the autoscaler's bounds."""
    found = []
    by_name = {(w["kind"], w["metadata"]["name"]): w for w in workloads}
    autoscalers = [(key.split("/")[0], config) for key, (module, config, _) in loaded.items() if module == AUTOSCALER_MODULE]
    for name, _ in autoscalers:
        workload = by_name[("Deployment", name)] if ("Deployment", name) in by_name else None
        strategy = (workload or {}).get("spec", {}).get("strategy", {})
        surge = strategy.get("rollingUpdate", {}).get("maxSurge", "25%")
        if workload is None or workload["spec"].get("replicas", 1) != 1 or not (strategy.get("type") == "Recreate" or surge in (0, "0", "0%")):
            found.append(f"{name}: the autoscaler must be a Deployment of 1 replica with strategy Recreate (or maxSurge 0): two would decide at once")
    if len(autoscalers) > 1:
        found.append(f"{len(autoscalers)} autoscalers ({', '.join(n for n, _ in autoscalers)}): one decides")
    scaled = [doc for doc in docs if doc["kind"] == "ScaledObject"]
    if not scaled:
        return found
    if not autoscalers:
        return [*found, f"ScaledObjects scale on {DESIRED_REPLICAS_METRIC}, but no {AUTOSCALER_MODULE} runs to export it"]
    autoscaler_name, autoscaler_config = autoscalers[0]
    found += scrape_problems(docs, by_name.get(("Deployment", autoscaler_name)))
    pools: dict[str, set[PoolKey]] = {}
    for key, (module, config, _) in loaded.items():
        pool = worker_pool(module, config)
        if pool is not None:
            pools.setdefault(key.split("/")[0], set()).add(pool)
    targets: dict[str, list[str]] = {}
    for scaled_object in scaled:
        where = f"ScaledObject/{scaled_object['metadata']['name']}"
        spec = scaled_object["spec"]
        ref = spec["scaleTargetRef"]
        kind, api = ref.get("kind", "Deployment"), ref.get("apiVersion", "apps/v1")
        target = by_name.get((kind, ref["name"])) if (kind, api) == ("Deployment", "apps/v1") else None
        if target is None:
            found.append(f"{where}: scaleTargetRef {api} {kind} {ref['name']} names no Deployment in the manifests")
            continue
        targets.setdefault(ref["name"], []).append(where)
        target_pools = pools.get(ref["name"], set())
        if len(target_pools) != 1:
            described = sorted(f"{model}/{role}" for model, role in target_pools)
            found.append(f"{where}: Deployment {ref['name']} runs no kvlane worker of one pool ({described}), so no autoscaler pool decides it")
            continue
        pool = next(iter(target_pools))
        triggers = spec["triggers"]
        # Another trigger would be one more metric, and the HPA follows the largest: besides the decision, only the
        # wake from zero, which never asks for more than one replica.
        held = [t for t in triggers if HELD_FROM_ZERO_METRIC in t.get("metadata", {}).get("query", "")]
        deciding = [t for t in triggers if t not in held]
        if len(deciding) != 1 or len(held) > 1 or any(t["type"] != "prometheus" for t in triggers):
            found.append(f"{where}: needs exactly one trigger on the decision and at most one on held requests, of type prometheus "
                         f"(the autoscaler is the only decider), not {[t['type'] for t in triggers]}")
            continue
        found += [f"{where}: {problem}" for problem in _held_trigger_problems(held, autoscaler_config)]
        trigger = deciding[0]
        metadata = trigger["metadata"]
        # AverageValue: replicas = ceil(metric / threshold); threshold 1 makes replicas = the decision.
        if trigger.get("metricType", "AverageValue") != "AverageValue" or _number(metadata.get("threshold")) != 1.0:
            found.append(f"{where}: metricType {trigger.get('metricType', 'AverageValue')} with threshold {metadata.get('threshold')} "
                         "does not make replicas = the desired replicas (needs AverageValue and threshold \"1\")")
        if metadata.get("ignoreNullValues", "true").lower() != "false":
            found.append(f"{where}: ignoreNullValues must be \"false\": with the autoscaler away, an empty result would read as 0 "
                         "and scale the pool to its minimum")
        functions, names, matchers = promql_parts(metadata.get("query", ""))
        if set(names) != {DESIRED_REPLICAS_METRIC}:
            found.append(f"{where}: the query must name only the metric {DESIRED_REPLICAS_METRIC}, not {sorted(set(names))}")
        if functions != ["max"]:
            found.append(f"{where}: aggregate the series with max(...) alone (a restarted autoscaler's old series would add up with sum), not {functions}")
        pool_matchers = [(op, value) for label, op, value in matchers if label == "pool"]
        if len(pool_matchers) != 1 or pool_matchers[0][0] != "=" or pool_matchers[0][1] not in POOLS:
            found.append(f"{where}: the query must select one pool with pool=\"...\" ({', '.join(POOLS)}), not {pool_matchers}")
        elif pool_matchers[0][1] != pool.role:
            found.append(f"{where}: the query reads pool {pool_matchers[0][1]!r}, but Deployment {ref['name']} runs {pool.role} workers")
        # Without one, the query reads every model's pool of the role: right while the fleet serves one model.
        model_matchers = [(op, value) for label, op, value in matchers if label == "model_name"]
        if model_matchers and model_matchers != [("=", pool.model)]:
            found.append(f"{where}: the query selects model_name {model_matchers}, but Deployment {ref['name']} serves "
                         f"model {pool.model!r} (select model_name=\"{pool.model}\", or no model_name)")
        for label, op, value in matchers:
            if label == "namespace" and (op, value) != ("=", scaled_object["metadata"].get("namespace")):
                found.append(f"{where}: the query selects namespace {op}{value!r}, not its own {scaled_object['metadata'].get('namespace')!r}")
        bounds = autoscaler_config.autoscaler.bounds(pool.model, pool.role)
        # KEDA's defaults: 0 and 100.
        low, high = spec.get("minReplicaCount", 0), spec.get("maxReplicaCount", 100)
        if (low, high) != (bounds.min, bounds.max):
            found.append(f"{where}: minReplicaCount..maxReplicaCount {low}..{high} differ from {_bounds_section(autoscaler_config, pool)} "
                         f"min..max {bounds.min}..{bounds.max} in the autoscaler's configuration")
        if low < 1 and not held:
            found.append(f"{where}: minReplicaCount {low} without a trigger on {HELD_FROM_ZERO_METRIC}: at 0 the pool is woken only "
                         "once the autoscaler decided again and Prometheus scraped it")
        replicas = target["spec"].get("replicas", 1)
        if not low <= replicas <= high:
            found.append(f"{where}: Deployment {ref['name']} starts at {replicas} replicas, outside {low}..{high}")
    found += [f"Deployment/{name}: scaled by {len(objects)} ScaledObjects ({', '.join(objects)}), not 1" for name, objects in targets.items() if len(objects) > 1]
    return found


def _held_trigger_problems(held: list[dict[str, Any]], config: KvlaneConfig) -> list[str]:
    """A trigger on held requests wakes the pool (0 -> 1) and sizes it no further: the autoscaler decides the rest."""
    if not held:
        return []
    trigger, found = held[0], []
    metadata = trigger["metadata"]
    functions, names, _ = promql_parts(metadata.get("query", ""))
    if set(names) != {HELD_FROM_ZERO_METRIC} or functions != ["sum"]:
        found.append(f"the held-requests trigger must read sum({HELD_FROM_ZERO_METRIC}) (every balancer's), not {metadata.get('query')!r}")
    threshold = _number(metadata.get("threshold"))
    if trigger.get("metricType", "AverageValue") != "AverageValue" or threshold is None or threshold < config.balancer.queue.max_length:
        found.append(f"the held-requests trigger's threshold {metadata.get('threshold')} (AverageValue) must be at least "
                     f"balancer.queue.max_length {config.balancer.queue.max_length}, so that it never asks for more than one replica")
    if _number(metadata.get("activationThreshold", "0")) != 0.0:
        found.append(f"the held-requests trigger's activationThreshold must be 0: one held request wakes the pool, "
                     f"not {metadata.get('activationThreshold')}")
    if metadata.get("ignoreNullValues", "true").lower() != "true":
        found.append("the held-requests trigger's ignoreNullValues must be \"true\": no series means no request was ever held")
    return found


def _number(text: str | None) -> float | None:
    try:
        return float(text) if text is not None else None
    except ValueError:
        return None


def scrape_problems(docs: list[dict[str, Any]], autoscaler: dict[str, Any] | None) -> list[str]:
    """KEDA's query finds the metric only if Prometheus scrapes the autoscaler: a ServiceMonitor's Service must select it on port metrics."""
    if autoscaler is None:
        return []
    services = [doc for doc in docs if doc["kind"] == "Service" and doc["spec"].get("selector")]
    for monitor in (doc for doc in docs if doc["kind"] == "ServiceMonitor"):
        for service in services:
            if selects(monitor["spec"]["selector"], service["metadata"].get("labels", {})) and selects(service["spec"]["selector"], pod_labels(autoscaler)):
                if {e["port"] for e in monitor["spec"]["endpoints"]} & {p.get("name") for p in service["spec"]["ports"]}:
                    return []
    return [f"Deployment/{autoscaler['metadata']['name']}: no ServiceMonitor scrapes the autoscaler (add components/monitoring), "
            f"so KEDA's query would find no {DESIRED_REPLICAS_METRIC}"]
