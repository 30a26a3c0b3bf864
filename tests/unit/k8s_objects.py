"""The rendered manifests' objects as the k8s checks read them (k8s_checks.py, k8s_scaling_checks.py)."""

from __future__ import annotations

from typing import Any

WORKLOAD_KINDS = {"Deployment", "StatefulSet", "DaemonSet", "Job"}
WORKER_MODULES = {"services.worker", "services.prefill_worker", "services.decode_worker"}
AUTOSCALER_MODULE = "services.autoscaler"


def pod_spec(doc: dict[str, Any]) -> dict[str, Any] | None:
    if doc["kind"] in WORKLOAD_KINDS:
        return doc["spec"]["template"]["spec"]
    return None


def pod_labels(doc: dict[str, Any]) -> dict[str, str]:
    return doc["spec"]["template"]["metadata"].get("labels", {})


def selects(selector: dict[str, Any], labels: dict[str, str]) -> bool:
    assert not selector.get("matchExpressions"), "the checks read matchLabels only"
    return all(labels.get(key) == value for key, value in selector.get("matchLabels", selector).items())


def image_repository(image: str) -> tuple[str, str]:
    name, _, tag = image.rpartition(":") if ":" in image.rsplit("/", 1)[-1] else (image, "", "")
    return name.rsplit("/", 1)[-1], tag


def configmaps(docs: list[dict[str, Any]]) -> dict[str, dict[str, str]]:
    return {doc["metadata"]["name"]: doc.get("data", {}) for doc in docs if doc["kind"] == "ConfigMap"}
