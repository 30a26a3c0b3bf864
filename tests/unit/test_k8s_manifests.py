"""k8s/ renders with kustomize, validates against the Kubernetes schemas, and agrees with the code.

Every overlay, and every component on top of an overlay, is rendered with
`kubectl kustomize` and validated offline (kubernetes-validate, strict, for
the oldest and newest Kubernetes promised). Then each kvlane container's
command runs through kvlane's own entry point on the configuration its
ConfigMaps, env and mounted TOML make (shared/config.py refuses unknown
sections and keys), and its probes, grace period, disruption budget and
Services are checked against that configuration (tests/unit/k8s_checks.py).
KEDA's ScaledObjects must scale each worker Deployment to the autoscaler's
decision for that worker's pool, within the autoscaler's bounds. The last
tests break a copy of k8s/ on purpose and expect the checks to say so.
"""

from __future__ import annotations

import functools
import re
import shutil
import tomllib
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.unit.k8s_checks import problems
from tests.unit.k8s_render import K8S, REPO, render, render_composed, schema_errors

OVERLAYS = sorted(path.parent.name for path in (K8S / "overlays").glob("*/kustomization.yaml"))
# Components at any depth (components/keda/aggregated), as paths under k8s/.
COMPONENTS = sorted(str(path.parent.relative_to(K8S)) for path in (K8S / "components").rglob("kustomization.yaml"))
SIM_IMAGES = {"kvlane": "kvlane:sim"}
# What the overlays do not show: the optional components on top of the sim
# overlay, and disaggregation on the sim engine (the overlay runs vLLM).
COMPOSED: dict[str, tuple[list[str], list[str]]] = {
    "sim+monitoring+external-redis": (["overlays/sim"], ["components/monitoring", "components/external-redis"]),
    "disaggregated-sim": (["base", "workers/disaggregated"], []),
    # KEDA on the prefill and decode pools (overlays/sim-autoscaled shows the aggregated one).
    "disaggregated-sim+monitoring+keda": (["base", "workers/disaggregated"], ["components/monitoring", "components/keda/disaggregated"]),
}
TARGETS = [f"overlays/{name}" for name in OVERLAYS] + sorted(COMPOSED)

@functools.cache
def rendered(target: str) -> list[dict[str, Any]]:
    """The target's objects, rendered once per test session (tests must not change them)."""
    if target in COMPOSED:
        resources, components = COMPOSED[target]
        return render_composed([K8S / r for r in resources], [K8S / c for c in components], SIM_IMAGES)
    return render(K8S / target)


def test_the_three_overlays_exist() -> None:
    assert {"sim", "vllm-gpu", "disaggregated"} <= set(OVERLAYS)


def test_every_component_is_rendered_somewhere() -> None:
    def included(kustomization: Path) -> set[str]:
        """The components a kustomization includes, and the ones those include."""
        found = set()
        for ref in yaml.safe_load(kustomization.read_text()).get("components", []):
            path = (kustomization.parent / ref).resolve()
            found |= {str(path.relative_to(K8S))} | included(path / "kustomization.yaml")
        return found

    used = set()
    for _, components in COMPOSED.values():
        for component in components:
            used |= {component} | included(K8S / component / "kustomization.yaml")
    for name in OVERLAYS:
        used |= included(K8S / "overlays" / name / "kustomization.yaml")
    assert set(COMPONENTS) <= used


@pytest.mark.parametrize("target", TARGETS)
def test_renders_and_validates_against_the_kubernetes_schemas(target: str) -> None:
    docs = rendered(target)
    assert docs
    assert schema_errors(docs) == []


@pytest.mark.parametrize("target", TARGETS)
def test_agrees_with_kvlane_commands_and_config(target: str) -> None:
    assert problems(rendered(target)) == []


def test_overlays_run_the_workers_they_promise() -> None:
    def workers(target: str) -> dict[str, dict[str, Any]]:
        return {d["metadata"]["name"]: d for d in rendered(target) if d["metadata"].get("labels", {}).get("kvlane.io/worker") == "true"}

    assert set(workers("overlays/sim")) == {"kvlane-worker"}
    assert set(workers("overlays/disaggregated")) == {"kvlane-prefill-worker", "kvlane-decode-worker"}
    for target in ("overlays/vllm-gpu", "overlays/disaggregated"):
        for worker in workers(target).values():
            container = worker["spec"]["template"]["spec"]["containers"][0]
            assert container["resources"]["limits"]["nvidia.com/gpu"] == 1
            assert container["image"] == "kvlane:vllm"
    ingress = next(d for d in rendered("overlays/vllm-gpu") if d["metadata"]["name"] == "kvlane-ingress" and d["kind"] == "Deployment")
    assert ingress["spec"]["template"]["spec"]["containers"][0]["image"] == "kvlane:sim"


def test_keda_scales_each_worker_pool_on_the_autoscalers_decision() -> None:
    def scaled(target: str) -> dict[str, str]:
        return {d["spec"]["scaleTargetRef"]["name"]: d["spec"]["triggers"][0]["metadata"]["query"]
                for d in rendered(target) if d["kind"] == "ScaledObject"}

    assert scaled("overlays/sim-autoscaled") == {"kvlane-worker": 'max(kvlane_autoscaler_desired_replicas{pool="aggregated"})'}
    assert scaled("disaggregated-sim+monitoring+keda") == {
        "kvlane-prefill-worker": 'max(kvlane_autoscaler_desired_replicas{pool="prefill"})',
        "kvlane-decode-worker": 'max(kvlane_autoscaler_desired_replicas{pool="decode"})',
    }
    # The overlays that need no CRDs stay without them.
    for target in ("overlays/sim", "overlays/vllm-gpu", "overlays/disaggregated"):
        assert not scaled(target)
    autoscaler = next(d for d in rendered("overlays/sim") if d["kind"] == "Deployment" and d["metadata"]["name"] == "kvlane-autoscaler")
    assert autoscaler["spec"]["replicas"] == 1 and autoscaler["spec"]["strategy"] == {"type": "Recreate"}


def test_external_redis_component_removes_the_statefulset() -> None:
    docs = rendered("sim+monitoring+external-redis")
    assert not [d for d in docs if d["metadata"]["name"].startswith("redis")]
    assert {d["kind"] for d in docs} >= {"ServiceMonitor"}


def test_dockerfile_copies_every_package_and_builds_both_engines() -> None:
    dockerfile = (REPO / "Dockerfile").read_text()
    pyproject = tomllib.loads((REPO / "pyproject.toml").read_text())
    packages = {pattern.rstrip("*") for pattern in pyproject["tool"]["setuptools"]["packages"]["find"]["include"]}
    copied = set(re.findall(r"^COPY\s+(\w+)\s", dockerfile, re.MULTILINE))
    assert packages <= copied, f"the Dockerfile does not COPY {sorted(packages - copied)}"
    assert re.search(r"^ARG ENGINE=sim$", dockerfile, re.MULTILINE)
    assert {"base-sim", "base-vllm"} <= set(re.findall(r"^FROM \S+ AS (\S+)", dockerfile, re.MULTILINE))
    extras = set(re.findall(r'KVLANE_EXTRAS="\[([\w-]+)\]"', dockerfile))
    assert extras and extras <= set(pyproject["project"]["optional-dependencies"])


# --- the checks can fail ----------------------------------------------------------------------


@pytest.fixture(scope="module")
def sim_without_changes() -> None:
    assert problems(rendered("overlays/sim")) == []


BREAKAGES = [
    # (file under k8s/, text to replace, replacement, what the checks must say)
    ("base/config/kvlane.env", "KVLANE__LOGGING__FORMAT=json", "KVLANE__WORKER__NO_SUCH_KEY=1", "no_such_key"),
    ("base/config/kvlane.env", "KVLANE__LOGGING__FORMAT=json", "KVLANE__NO_SUCH_SECTION__KEY=1", "no_such_section"),
    ("base/config/kvlane.env", "KVLANE__LOGGING__FORMAT=json", "KVLANE_LOGGING__FORMAT=json", "neither KVLANE__SECTION__KEY"),
    ("base/config/kvlane.toml", "drain_timeout_s = 60.0", "drain_timeout_s = 600.0", "terminationGracePeriodSeconds 90"),
    ("base/config/kvlane.toml", "[cache_manager]\nmetrics_port = 9090", "[cache_manager]\nmetrics_port = 9191", "serves HTTP on 9191"),
    ("base/config/kvlane.toml", "[autoscaler]\nmetrics_port = 9090", "[autoscaler]\nmetrics_port = 0", "serves HTTP on no port"),
    ("base/config/kvlane.toml", 'metrics_host = "0.0.0.0"', 'metrics_host = "127.0.0.1"', "listens on 127.0.0.1 only"),
    ("base/ingress.yaml", '"services.ingress"', '"services.no_such_service"', "is not a kvlane service"),
    ("base/ingress.yaml", "terminationGracePeriodSeconds: 330", "terminationGracePeriodSeconds: 60", "terminationGracePeriodSeconds 60"),
    ("base/ingress.yaml", "path: /ready", "path: /readyz", "does not serve"),
    ("base/balancer.yaml", '"services.balancer"]', '"services.balancer", "--no-such-flag"]', "exits 2"),
    ("base/config/nats.conf", "    nats://nats-2.nats-headless:6222\n", "", "routes"),
    ("workers/common/worker-pod.yaml", "node_key(config.worker.worker_id)", "node_key(config.worker.model)", "is registered"),
    ("workers/common/worker-pod.yaml", "from contracts.subjects import node_key", "from contracts.subjects import no_such_name", "quietly"),
    ("base/redis.yaml", "    - name: redis\n      port: 6379\n      targetPort: redis\n---\napiVersion: v1\nkind: Service\nmetadata:\n  name: redis-headless",
     "    - name: redis\n      port: 6380\n      targetPort: redis\n---\napiVersion: v1\nkind: Service\nmetadata:\n  name: redis-headless", "names no Service port"),
]


def broken_copy_problems(tmp_path: Path, overlay: str, path: str, old: str, new: str) -> list[str]:
    """What the checks say of `overlay`, rendered from a copy of k8s/ with `old` replaced by `new` in `path`."""
    copy = tmp_path / "k8s"
    shutil.copytree(K8S, copy)
    target = copy / path
    text = target.read_text()
    assert old in text, f"{path} no longer contains {old!r}: update the breakage"
    target.write_text(text.replace(old, new, 1))
    return problems(render(copy / "overlays" / overlay))


@pytest.mark.parametrize(("path", "old", "new", "expected"), BREAKAGES, ids=[f"{b[0]}:{b[3]}" for b in BREAKAGES])
def test_a_broken_copy_is_refused(tmp_path: Path, sim_without_changes: None, path: str, old: str, new: str, expected: str) -> None:
    found = broken_copy_problems(tmp_path, "sim", path, old, new)
    assert any(expected in problem for problem in found), found


@pytest.fixture(scope="module")
def autoscaled_without_changes() -> None:
    assert problems(rendered("overlays/sim-autoscaled")) == []


AGGREGATED_SCALEDOBJECT = "components/keda/aggregated/scaledobject.yaml"
QUERY = 'query: max(kvlane_autoscaler_desired_replicas{pool="aggregated"})'
KEDA_BREAKAGES = [
    # (file under k8s/, text to replace, replacement, what the checks must say), on overlays/sim-autoscaled
    (AGGREGATED_SCALEDOBJECT, QUERY, 'query: max(kvlane_autoscaler_desired_replicas{pool="decode"})', "runs aggregated workers"),
    (AGGREGATED_SCALEDOBJECT, QUERY, 'query: max(kvlane_autoscaler_desired_replicas{pool="everything"})', "must select one pool"),
    (AGGREGATED_SCALEDOBJECT, QUERY, 'query: max(kvlane_autoscaler_desired_replicas{pool=~"aggregated|decode"})', "must select one pool"),
    (AGGREGATED_SCALEDOBJECT, QUERY, QUERY.replace('pool="aggregated"', 'pool="aggregated", model_name="other"'),
     "serves model 'kvlane-sim'"),
    (AGGREGATED_SCALEDOBJECT, QUERY, QUERY.replace('pool="aggregated"', 'pool="aggregated", model_name=~"kvlane-.*"'),
     "serves model 'kvlane-sim'"),
    # The model's own bounds, when it has them, are what KEDA must repeat.
    ("base/config/kvlane.toml", "[autoscaler.aggregated]\nmin = 1\nmax = 4",
     '[autoscaler.aggregated]\nmin = 1\nmax = 4\n[autoscaler.models."kvlane-sim".aggregated]\nmin = 1\nmax = 6',
     '[autoscaler.models."kvlane-sim".aggregated] min..max 1..6'),
    (AGGREGATED_SCALEDOBJECT, QUERY, QUERY.replace("desired", "current"), "must name only the metric"),
    (AGGREGATED_SCALEDOBJECT, QUERY, QUERY.replace("max", "sum"), "max(...) alone"),
    (AGGREGATED_SCALEDOBJECT, "maxReplicaCount: 4", "maxReplicaCount: 8", "differ from [autoscaler.aggregated] min..max 1..4"),
    ("base/config/kvlane.toml", "[autoscaler.aggregated]\nmin = 1\nmax = 4", "[autoscaler.aggregated]\nmin = 1\nmax = 6", "1..6"),
    (AGGREGATED_SCALEDOBJECT, "    name: kvlane-worker\n", "    name: kvlane-workers\n", "names no Deployment"),
    (AGGREGATED_SCALEDOBJECT, "metricType: AverageValue", "metricType: Value", "does not make replicas = the desired replicas"),
    (AGGREGATED_SCALEDOBJECT, 'threshold: "1"', 'threshold: "2"', "does not make replicas = the desired replicas"),
    (AGGREGATED_SCALEDOBJECT, 'ignoreNullValues: "false"', 'ignoreNullValues: "true"', "ignoreNullValues"),
    ("base/autoscaler.yaml", "    type: Recreate", "    type: RollingUpdate", "two would decide at once"),
    ("overlays/sim-autoscaled/kustomization.yaml", "  - ../../components/monitoring\n", "", "no ServiceMonitor scrapes the autoscaler"),
    (AGGREGATED_SCALEDOBJECT, "query: sum(kvlane_balancer_held_from_zero)", "query: max(kvlane_balancer_held_from_zero)",
     "must read sum(kvlane_balancer_held_from_zero)"),
    (AGGREGATED_SCALEDOBJECT, 'threshold: "100000"', 'threshold: "1"', "never asks for more than one replica"),
    (AGGREGATED_SCALEDOBJECT, 'activationThreshold: "0"', 'activationThreshold: "5"', "activationThreshold must be 0"),
    (AGGREGATED_SCALEDOBJECT, 'ignoreNullValues: "true"', 'ignoreNullValues: "false"', "no request was ever held"),
    # Down to 0 on both sides, but without the trigger that wakes it.
    (AGGREGATED_SCALEDOBJECT, "minReplicaCount: 1\n  maxReplicaCount: 4\n  triggers:",
     "minReplicaCount: 0\n  maxReplicaCount: 4\n  triggers:", "differ from [autoscaler.aggregated] min..max 1..4"),
]


def test_a_pool_scaled_to_zero_on_both_sides_is_accepted_and_needs_the_held_requests_trigger(tmp_path: Path) -> None:
    copy = tmp_path / "k8s"
    shutil.copytree(K8S, copy)
    config, scaled_object = copy / "base/config/kvlane.toml", copy / AGGREGATED_SCALEDOBJECT
    config.write_text(config.read_text().replace("[autoscaler.aggregated]\nmin = 1", "[autoscaler.aggregated]\nmin = 0", 1))
    text = scaled_object.read_text()
    scaled_object.write_text(text.replace("minReplicaCount: 1", "minReplicaCount: 0", 1))
    assert problems(render(copy / "overlays" / "sim-autoscaled")) == []
    without_wake = text.replace("minReplicaCount: 1", "minReplicaCount: 0", 1).split("    # Wakes the pool from zero")[0]
    scaled_object.write_text(without_wake)
    common = copy / "components/keda/common/kustomization.yaml"
    common.write_text(common.read_text().replace(
        "      - op: add\n        path: /spec/triggers/1/metadata/serverAddress\n        value: http://prometheus-operated.monitoring.svc:9090\n", ""))
    found = problems(render(copy / "overlays" / "sim-autoscaled"))
    assert any("without a trigger on kvlane_balancer_held_from_zero" in problem for problem in found), found


def test_a_query_may_select_the_model_its_deployment_serves(tmp_path: Path) -> None:
    """A worker Deployment runs one model: its query may name it, and another model's bounds are not its own."""
    copy = tmp_path / "k8s"
    shutil.copytree(K8S, copy)
    config, scaled_object = copy / "base/config/kvlane.toml", copy / AGGREGATED_SCALEDOBJECT
    scaled_object.write_text(scaled_object.read_text().replace(QUERY, QUERY.replace('pool="aggregated"', 'pool="aggregated", model_name="kvlane-sim"')))
    config.write_text(config.read_text() + '\n[autoscaler.models."another-model".aggregated]\nmin = 0\nmax = 9\n')
    assert problems(render(copy / "overlays" / "sim-autoscaled")) == []


@pytest.mark.parametrize(("path", "old", "new", "expected"), KEDA_BREAKAGES, ids=[f"{b[0]}:{b[3]}" for b in KEDA_BREAKAGES])
def test_a_broken_keda_copy_is_refused(tmp_path: Path, autoscaled_without_changes: None, path: str, old: str, new: str, expected: str) -> None:
    found = broken_copy_problems(tmp_path, "sim-autoscaled", path, old, new)
    assert any(expected in problem for problem in found), found


def test_strict_schema_validation_refuses_an_unknown_field() -> None:
    docs = [dict(d) for d in rendered("overlays/sim")]
    deployment = next(d for d in docs if d["kind"] == "Deployment")
    broken = {**deployment, "spec": {**deployment["spec"], "replica": 2}}
    assert any("replica" in error for error in schema_errors([broken]))
    monitor = next(d for d in rendered("sim+monitoring+external-redis") if d["kind"] == "ServiceMonitor")
    assert any("interval" in error for error in schema_errors([{**monitor, "spec": {**monitor["spec"], "endpoints": [{"port": "x", "interval": "soon"}]}}]))
    scaled = next(d for d in rendered("overlays/sim-autoscaled") if d["kind"] == "ScaledObject")
    trigger = scaled["spec"]["triggers"][0]
    assert any("minReplicas" in error for error in schema_errors([{**scaled, "spec": {**scaled["spec"], "minReplicas": 1}}]))
    misspelt = {**trigger, "metadata": {**trigger["metadata"], "ignoreNullValue": "false"}}
    assert any("ignoreNullValue" in error for error in schema_errors([{**scaled, "spec": {**scaled["spec"], "triggers": [misspelt]}}]))
    assert any("Average" in error for error in schema_errors([{**scaled, "spec": {**scaled["spec"], "triggers": [{**trigger, "metricType": "Average"}]}}]))
    assert schema_errors([{"apiVersion": "example.com/v1", "kind": "Unknown", "metadata": {"name": "x"}}])
