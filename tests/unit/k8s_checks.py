"""Read rendered k8s/ manifests the way a cluster and kvlane would, and say what disagrees.

`problems` checks what the Kubernetes schemas cannot: that every kvlane
container's command runs kvlane's own entry point on the configuration its
ConfigMaps, env and mounted TOML make (shared/config.py's loader, which
refuses unknown sections and keys), and that probes, grace periods,
disruption budgets, Services and ServiceMonitors agree with that
configuration and with each other, and that KEDA's ScaledObjects carry out
the autoscaler's decisions for the pool their Deployment runs, within its
bounds. Problems come back as text, so a test can also show that the checks
fail. Rendering and schemas: k8s_render.py; the autoscaling checks:
k8s_scaling_checks.py.
"""

from __future__ import annotations

import contextlib
import io
import os
import re
import runpy
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from unittest import mock
from urllib.parse import urlsplit

from contracts import subjects
from kvlane.cli import build_parser
from shared.config import CONFIG_FILE_ENV, ENV_PREFIX, ConfigError, KvlaneConfig, load_config
from shared.kv.links import get_link
from shared.kv.step_profile import get_profile
from tests.unit.k8s_objects import (
    AUTOSCALER_MODULE,
    WORKER_MODULES,
    configmaps,
    image_repository,
    pod_labels,
    pod_spec,
    selects,
)
from tests.unit.k8s_render import NAMESPACE, REPO
from tests.unit.k8s_scaling_checks import scaling_problems

# Images that are not kvlane's, by repository name: their containers run their own commands.
THIRD_PARTY_IMAGES = {"nats", "redis"}
# What a pod's downward-API fields stand for here; the pod name is the workload's plus a suffix.
POD_SUFFIX = "-5f7c9d8b6d-x7k2p"
POD_IP = "10.244.1.23"
# Seconds a pod needs beyond its drains (process exit, the last log lines).
GRACE_MARGIN_S = 5.0

# --- reading the rendered objects ------------------------------------------------------


def field_value(workload: dict[str, Any], path: str) -> str | None:
    return {
        "metadata.name": workload["metadata"]["name"] + POD_SUFFIX,
        "metadata.namespace": workload["metadata"].get("namespace", NAMESPACE),
        "status.podIP": POD_IP,
    }.get(path)


def container_env(workload: dict[str, Any], container: dict[str, Any], maps: dict[str, dict[str, str]], problems: list[str]) -> dict[str, str]:
    """The variables the container starts with (Secrets are optional and not known here)."""
    where = f"{workload['metadata']['name']}/{container['name']}"
    env: dict[str, str] = {}
    for source in container.get("envFrom", []):
        if "configMapRef" in source:  # (keys that are no valid variable names are skipped by kubelet too)
            ref = source["configMapRef"]
            if ref["name"] in maps:
                env.update({source.get("prefix", "") + key: value for key, value in maps[ref["name"]].items()})
            elif not ref.get("optional"):
                problems.append(f"{where}: envFrom ConfigMap {ref['name']} is not in the manifests")
        elif not source.get("secretRef", {}).get("optional"):
            problems.append(f"{where}: envFrom {source} must be an optional Secret (the pod would not start without it)")
    for var in container.get("env", []):
        if "value" in var:
            env[var["name"]] = var["value"]
        elif "fieldRef" in var.get("valueFrom", {}):
            value = field_value(workload, var["valueFrom"]["fieldRef"]["fieldPath"])
            if value is None:
                problems.append(f"{where}: {var['name']} reads {var['valueFrom']['fieldRef']['fieldPath']}, which the checks do not know")
            else:
                env[var["name"]] = value
        elif "configMapKeyRef" in var.get("valueFrom", {}):
            ref = var["valueFrom"]["configMapKeyRef"]
            if ref["key"] in maps.get(ref["name"], {}):
                env[var["name"]] = maps[ref["name"]][ref["key"]]
            elif not ref.get("optional"):
                problems.append(f"{where}: {var['name']} reads {ref['name']}/{ref['key']}, which is not in the manifests")
        elif "secretKeyRef" not in var.get("valueFrom", {}):
            problems.append(f"{where}: {var['name']} has a source the checks do not know")
    for name in env:
        # The loader silently ignores anything else that starts with KVLANE (a misspelt prefix).
        if name.upper().startswith("KVLANE") and not name.upper().startswith(ENV_PREFIX) and name != CONFIG_FILE_ENV:
            problems.append(f"{where}: {name} is neither KVLANE__SECTION__KEY nor {CONFIG_FILE_ENV}")
    return env


def mounted_file(pod: dict[str, Any], container: dict[str, Any], path: str, maps: dict[str, dict[str, str]]) -> str | None:
    """The text a ConfigMap volume puts at `path` in the container, if any does."""
    volumes = {volume["name"]: volume for volume in pod.get("volumes", [])}
    for mount in container.get("volumeMounts", []):
        source = volumes.get(mount["name"], {}).get("configMap")
        if source is None:
            continue
        if mount.get("subPath"):
            key = mount["subPath"] if mount["mountPath"] == path else None
        elif path.startswith(mount["mountPath"].rstrip("/") + "/"):
            key = path[len(mount["mountPath"].rstrip("/")) + 1 :]
            items = {item["path"]: item["key"] for item in source.get("items", [])}
            key = items.get(key, None if items else key)
        else:
            key = None
        if key is not None and key in maps.get(source["name"], {}):
            return maps[source["name"]][key]
    return None


def local_config_flag(args: list[str], pod: dict[str, Any], container: dict[str, Any], maps: dict[str, dict[str, str]], tmp: Path) -> list[str]:
    """`args` with a `--config PATH` that a ConfigMap mounts pointed at a local copy of that file."""
    args = [part for arg in args for part in (arg.split("=", 1) if arg.startswith("--config=") else [arg])]
    if "--config" in args[:-1]:
        at = args.index("--config") + 1
        text = mounted_file(pod, container, args[at], maps)
        if text is not None:
            Path(tmp, "from-flag.toml").write_text(text)
            args[at] = str(Path(tmp, "from-flag.toml"))
    return args


def mounts_path(container: dict[str, Any], path: str) -> bool:
    return any(path == m["mountPath"] or path.startswith(m["mountPath"].rstrip("/") + "/") for m in container.get("volumeMounts", []))


def http_routes(source: Path) -> set[str]:
    return set(re.findall(r'add_get\("([^"]+)"', source.read_text()))


ROUTES = {"services.ingress": http_routes(REPO / "services/ingress/app.py")}
METRICS_ROUTES = http_routes(REPO / "shared/metrics_http.py")


def http_endpoint(module: str, config: KvlaneConfig) -> tuple[str, int]:
    """(host, port) of the HTTP server the service opens: its API or its /metrics."""
    if module == "services.ingress":
        return config.ingress.host, config.ingress.port
    if module == "services.balancer":
        return config.balancer.metrics_host, config.balancer.metrics_port
    if module == "services.cache_manager":
        return config.cache_manager.metrics_host, config.cache_manager.metrics_port
    if module == "services.health_prober":
        return config.health.metrics_host, config.health.metrics_port
    if module == AUTOSCALER_MODULE:
        return config.autoscaler.metrics_host, config.autoscaler.metrics_port
    return config.worker.metrics_host, config.worker.metrics_port


def drain_s(module: str, config: KvlaneConfig) -> float:
    """How long the service may take to stop after SIGTERM, NATS drain included."""
    own = {"services.ingress": config.ingress.request_timeout_s}.get(module, 0.0)
    if module in WORKER_MODULES:
        own = config.worker.drain_timeout_s
    return own + config.nats.drain_timeout_s


def prestop_s(container: dict[str, Any]) -> float:
    command = container.get("lifecycle", {}).get("preStop", {}).get("exec", {}).get("command", [])
    return float(command[1]) if command[:1] == ["sleep"] else 0.0


# --- running kvlane's own entry points ----------------------------------------------------


@contextlib.contextmanager
def process_env(env: dict[str, str]) -> Iterator[None]:
    """os.environ as the container would have it: this process's, minus any KVLANE variable, plus `env`."""
    base = {key: value for key, value in os.environ.items() if not key.upper().startswith("KVLANE")}
    with mock.patch.dict(os.environ, {**base, **env}, clear=True):
        yield


def run_service_entry(module: str, args: list[str], env: dict[str, str]) -> str | None:
    """`python -m MODULE ARGS` up to where the service would start: argv parsing and config loading, for real."""
    stderr = io.StringIO()
    with (process_env(env), mock.patch.object(sys, "argv", [module, *args]), contextlib.redirect_stderr(stderr),
          mock.patch("uvloop.run", side_effect=lambda coro: coro.close()), mock.patch("shared.runner.configure_logging")):
        try:
            runpy.run_module(module, run_name="__main__", alter_sys=True)
        except SystemExit as exc:
            if exc.code not in (None, 0):
                return f"exits {exc.code}: {stderr.getvalue().strip() or exc.code}"
    return None


class _FakeRedis:
    def __init__(self, keys: set[str]) -> None:
        self.keys = keys

    def exists(self, *names: str) -> int:
        return sum(name in self.keys for name in names)


def python_probe_problems(code: str, env: dict[str, str], config: KvlaneConfig, where: str) -> list[str]:
    """A `python -c` probe must run: fail cleanly while Redis is away, pass once this worker's heartbeat is there."""
    try:
        compile(code, where, "exec")
    except SyntaxError as exc:
        return [f"{where}: probe does not compile: {exc}"]
    problems = []
    away = {**env, "KVLANE__REDIS__URL": "redis://127.0.0.1:1/0", "KVLANE__NATS__URL": "nats://127.0.0.1:1"}
    base = {key: value for key, value in os.environ.items() if not key.upper().startswith("KVLANE")}
    done = subprocess.run([sys.executable, "-c", code], env={**base, **away}, cwd=REPO, capture_output=True, text=True, timeout=60, check=False)
    if done.returncode == 0 or done.stderr.strip():
        problems.append(f"{where}: with Redis away the probe should exit non-zero quietly, got {done.returncode}: {done.stderr.strip()[-500:]}")
    if "redis" in code:
        fake = _FakeRedis({subjects.node_key(config.worker.worker_id)})
        with process_env(env), mock.patch("redis.Redis.from_url", return_value=fake):
            try:
                exec(compile(code, where, "exec"), {"__name__": "__main__"})  # noqa: S102 - the manifest's own probe
                code_ = 0
            except SystemExit as exc:
                code_ = exc.code
            except Exception as exc:  # noqa: BLE001 - whatever breaks the probe is the finding
                code_ = f"{type(exc).__name__}: {exc}"
        if code_ not in (None, 0):
            problems.append(f"{where}: the probe fails although worker {config.worker.worker_id!r} is registered (exit {code_})")
    return problems


# --- the checks ---------------------------------------------------------------------------


def problems(docs: list[dict[str, Any]]) -> list[str]:
    found: list[str] = []
    maps = configmaps(docs)
    workloads = [doc for doc in docs if pod_spec(doc) is not None]
    loaded: dict[str, tuple[str, KvlaneConfig, dict[str, Any]]] = {}
    for workload in workloads:
        pod = pod_spec(workload)
        for container in pod.get("initContainers", []) + pod["containers"]:
            repository, _ = image_repository(container["image"])
            if repository == "kvlane":
                result = kvlane_container_problems(workload, pod, container, maps, found)
                if result is not None:
                    loaded[f"{workload['metadata']['name']}/{container['name']}"] = result
            elif repository not in THIRD_PARTY_IMAGES:
                found.append(f"{workload['metadata']['name']}/{container['name']}: image {container['image']} is neither kvlane nor a known dependency")
    found += configmap_problems(maps)
    found += fleet_problems(docs, workloads, loaded)
    found += disruption_budget_problems(docs, workloads)
    found += service_problems(docs, workloads)
    found += nats_problems(docs, maps)
    found += scaling_problems(docs, workloads, loaded)
    found += [f"{doc['kind']}/{doc['metadata']['name']}: namespace {doc['metadata'].get('namespace')!r}, not {NAMESPACE!r}"
              for doc in docs if doc["kind"] != "Namespace" and doc["metadata"].get("namespace") != NAMESPACE]
    return found


def kvlane_container_problems(
    workload: dict[str, Any], pod: dict[str, Any], container: dict[str, Any], maps: dict[str, dict[str, str]], found: list[str]
) -> tuple[str, KvlaneConfig, dict[str, Any]] | None:
    where = f"{workload['metadata']['name']}/{container['name']}"
    env = container_env(workload, container, maps, found)
    argv = container.get("command", []) + container.get("args", [])
    with tempfile.TemporaryDirectory() as tmp:
        # The mounted TOML file, written where this process can read it.
        if CONFIG_FILE_ENV in env:
            text = mounted_file(pod, container, env[CONFIG_FILE_ENV], maps)
            if text is None:
                found.append(f"{where}: {CONFIG_FILE_ENV}={env[CONFIG_FILE_ENV]} is no file a ConfigMap volume mounts")
                return None
            local = Path(tmp, "kvlane.toml")
            local.write_text(text)
            env = {**env, CONFIG_FILE_ENV: str(local)}
        try:
            config = load_config(env=env)
        except ConfigError as exc:
            found.append(f"{where}: {exc}")
            return None
        if argv[:2] == ["python", "-m"] and len(argv) > 2 and argv[2].startswith("services."):
            module = argv[2]
            entry = REPO / module.replace(".", "/") / "__main__.py"
            if not entry.exists() or "run_service(" not in entry.read_text():
                found.append(f"{where}: {module} is not a kvlane service (no services/.../__main__.py calling run_service)")
                return None
            failure = run_service_entry(module, local_config_flag(argv[3:], pod, container, maps, Path(tmp)), env)
            if failure:
                found.append(f"{where}: python -m {module} {' '.join(argv[3:])} {failure}")
                return None
        elif argv[:1] == ["kvlane"]:
            try:
                with contextlib.redirect_stderr(io.StringIO()):
                    build_parser().parse_args(argv[1:])
            except SystemExit:
                found.append(f"{where}: `{' '.join(argv)}` is refused by kvlane's argument parser")
            return None
        else:
            found.append(f"{where}: command {argv} is neither `python -m services.<name>` nor `kvlane ...`")
            return None
        for kind in ("startupProbe", "readinessProbe", "livenessProbe"):
            command = container.get(kind, {}).get("exec", {}).get("command", [])
            if command[:2] == ["python", "-c"]:
                found.extend(python_probe_problems(command[2], env, config, f"{where} {kind}"))
            elif command:
                found.append(f"{where}: {kind} runs {command[:1]}; only `python -c` probes are checked")
    found.extend(service_container_problems(workload, pod, container, module, config, where))
    return module, config, container


def service_container_problems(
    workload: dict[str, Any], pod: dict[str, Any], container: dict[str, Any], module: str, config: KvlaneConfig, where: str
) -> list[str]:
    found = []
    for kind in ("readinessProbe", "livenessProbe") + (("startupProbe",) if module in WORKER_MODULES else ()):
        if kind not in container:
            found.append(f"{where}: no {kind}")
    # Its /metrics opens before the engine has loaded: only registration says a worker is up.
    if module in WORKER_MODULES and "exec" not in container.get("startupProbe", {}):
        found.append(f"{where}: a worker's startupProbe must check its registration, not a port")
    requests = container.get("resources", {}).get("requests", {})
    if not {"cpu", "memory"} <= requests.keys() or "memory" not in container.get("resources", {}).get("limits", {}):
        found.append(f"{where}: needs cpu and memory requests and a memory limit")
    host, port = http_endpoint(module, config)
    ports = {p.get("name"): p["containerPort"] for p in container.get("ports", [])}
    routes = ROUTES.get(module, METRICS_ROUTES)
    for kind in ("startupProbe", "readinessProbe", "livenessProbe"):
        get = container.get(kind, {}).get("httpGet")
        if get is None:
            continue
        probe_port = ports.get(get["port"]) if isinstance(get["port"], str) else get["port"]
        if probe_port != port or port == 0:
            found.append(f"{where}: {kind} asks port {get['port']} ({probe_port}), but the service serves HTTP on {port or 'no port'}")
        if host not in ("0.0.0.0", "::", ""):
            found.append(f"{where}: {kind} cannot reach it: the service listens on {host} only")
        if get["path"] not in routes:
            found.append(f"{where}: {kind} asks {get['path']}, which {module} does not serve ({sorted(routes)})")
    grace = pod.get("terminationGracePeriodSeconds", 30)
    needed = prestop_s(container) + drain_s(module, config) + GRACE_MARGIN_S
    if grace < needed:
        found.append(f"{where}: terminationGracePeriodSeconds {grace} < {needed:g} (preStop + drain + NATS drain + margin)")
    own_id = {"services.ingress": ("KVLANE__INGRESS__INGRESS_ID", config.ingress.ingress_id)}.get(module)
    if module in WORKER_MODULES:
        own_id = ("KVLANE__WORKER__WORKER_ID", config.worker.worker_id)
        if own_id[1] != workload["metadata"]["name"] + POD_SUFFIX:
            found.append(f"{where}: worker_id must be the pod's name (metadata.name): the startup probe looks it up")
    if own_id and own_id[1]:
        if not subjects.is_valid_token(own_id[1]):
            found.append(f"{where}: {own_id[0]}={own_id[1]!r} is not a valid id")
        if not own_id[1].endswith(POD_SUFFIX) and workload["spec"].get("replicas", 1) != 1:
            found.append(f"{where}: {own_id[0]} is one literal for {workload['spec'].get('replicas')} replicas")
    try:
        if module == "services.balancer":
            get_profile(config.balancer.speed.fallback_profile)
        if module in WORKER_MODULES and config.worker.engine == "sim":
            get_profile(config.worker.sim.profile)
            get_link(config.worker.sim.kv_link)
        if module in WORKER_MODULES and config.worker.step_profile and not config.worker.step_profile.startswith("file:"):
            get_profile(config.worker.step_profile)
    except KeyError as exc:
        found.append(f"{where}: {exc.args[0]}")
    if module in WORKER_MODULES and config.worker.engine == "vllm":
        if "vllm" not in image_repository(container["image"])[1]:
            found.append(f"{where}: engine vllm needs the vLLM image (--build-arg ENGINE=vllm), not {container['image']}")
        if not mounts_path(container, config.worker.vllm.model):
            found.append(f"{where}: model directory {config.worker.vllm.model!r} is not on a mounted volume")
        if module != "services.worker":
            port = config.worker.vllm.nixl_side_channel_port
            if port == 0 or port not in ports.values() or config.worker.vllm.nixl_side_channel_host != POD_IP:
                found.append(f"{where}: the NIXL side channel must be the pod's IP and a declared fixed port")
    return found


def configmap_problems(maps: dict[str, dict[str, str]]) -> list[str]:
    """Every KVLANE variable and TOML file in any ConfigMap loads, referenced or not."""
    found = []
    for name, data in maps.items():
        env = {key: value for key, value in data.items() if key.upper().startswith("KVLANE") and key.isidentifier()}
        for key in env:
            if not key.upper().startswith(ENV_PREFIX) and key != CONFIG_FILE_ENV:
                found.append(f"ConfigMap {name}: {key} is neither KVLANE__SECTION__KEY nor {CONFIG_FILE_ENV}")
        try:
            load_config(env={key: value for key, value in env.items() if key != CONFIG_FILE_ENV})
        except ConfigError as exc:
            found.append(f"ConfigMap {name}: {exc}")
        for key, text in data.items():
            if key.endswith(".toml"):
                with tempfile.TemporaryDirectory() as tmp:
                    Path(tmp, key).write_text(text)
                    try:
                        load_config(Path(tmp, key), env={})
                    except ConfigError as exc:
                        found.append(f"ConfigMap {name}: {exc}")
    return found


def fleet_problems(docs: list[dict[str, Any]], workloads: list[dict[str, Any]], loaded: dict[str, tuple[str, KvlaneConfig, dict[str, Any]]]) -> list[str]:
    found = []
    modules = {module for module, _, _ in loaded.values()}
    if loaded:
        for needed in ("services.ingress", "services.balancer", "services.cache_manager", "services.health_prober"):
            if needed not in modules:
                found.append(f"no {needed} in the manifests")
        if not modules & WORKER_MODULES:
            found.append("no worker in the manifests")
        if ("services.prefill_worker" in modules) != ("services.decode_worker" in modules):
            found.append("prefill workers need decode workers and the other way round")
    services = {doc["metadata"]["name"]: doc for doc in docs if doc["kind"] == "Service"}
    stateful = {doc["metadata"]["name"] for doc in workloads if doc["kind"] == "StatefulSet"}
    ingress_mounts = [c for module, _, c in loaded.values() if module == "services.ingress"]
    for where, (module, config, _) in loaded.items():
        for what, url in (("nats.url", config.nats.url), ("redis.url", config.redis.url)):
            parts = urlsplit(url)
            host = parts.hostname or ""
            if "." in host:
                continue  # outside the manifests (an existing Redis)
            service = services.get(host)
            if service is None or parts.port not in {p["port"] for p in service["spec"]["ports"]}:
                found.append(f"{where}: {what} {url} names no Service port in the manifests")
            elif what == "redis.url" and "redis" not in stateful:
                found.append(f"{where}: {what} points at Service {host} but no Redis runs here")
        if module in WORKER_MODULES and config.worker.engine == "vllm":
            for ingress in ingress_mounts:
                if not mounts_path(ingress, config.worker.vllm.model):
                    found.append(f"ingress does not mount {config.worker.vllm.model} (it reads the model's tokenizer there)")
    return sorted(set(found))


def disruption_budget_problems(docs: list[dict[str, Any]], workloads: list[dict[str, Any]]) -> list[str]:
    budgets = [doc for doc in docs if doc["kind"] == "PodDisruptionBudget"]
    found = []
    for workload in workloads:
        if workload["kind"] == "Job":
            continue
        matching = [b["metadata"]["name"] for b in budgets if selects(b["spec"]["selector"], pod_labels(workload))]
        if len(matching) != 1:
            found.append(f"{workload['kind']}/{workload['metadata']['name']}: {len(matching)} PodDisruptionBudgets select it, not 1")
    for budget in budgets:
        if not any(selects(budget["spec"]["selector"], pod_labels(w)) for w in workloads):
            found.append(f"PodDisruptionBudget/{budget['metadata']['name']} selects no pods")
    return found


def service_problems(docs: list[dict[str, Any]], workloads: list[dict[str, Any]]) -> list[str]:
    found = []
    services = [doc for doc in docs if doc["kind"] == "Service"]
    for service in services:
        name = service["metadata"]["name"]
        if not service["spec"].get("selector"):
            continue  # endpoints of its own (something outside the manifests)
        pods = [w for w in workloads if selects(service["spec"]["selector"], pod_labels(w))]
        if not pods:
            found.append(f"Service/{name} selects no pods")
        for port in service["spec"]["ports"]:
            target = port.get("targetPort", port["port"])
            for workload in pods:
                declared = {(p.get("name"), p["containerPort"]) for c in pod_spec(workload)["containers"] for p in c.get("ports", [])}
                if not any(target in pair for pair in declared):
                    found.append(f"Service/{name} port {port['name']}: {workload['metadata']['name']} declares no port {target}")
    for monitor in (doc for doc in docs if doc["kind"] == "ServiceMonitor"):
        matched = [s for s in services if selects(monitor["spec"]["selector"], s["metadata"].get("labels", {}))]
        if not matched:
            found.append(f"ServiceMonitor/{monitor['metadata']['name']} selects no Service")
        for endpoint in monitor["spec"]["endpoints"]:
            for service in matched:
                if endpoint["port"] not in {p.get("name") for p in service["spec"]["ports"]}:
                    found.append(f"ServiceMonitor/{monitor['metadata']['name']}: Service {service['metadata']['name']} has no port {endpoint['port']}")
    return found


def nats_problems(docs: list[dict[str, Any]], maps: dict[str, dict[str, str]]) -> list[str]:
    """The NATS cluster's routes name every replica, and nats-server (the one kvlane's tests run) accepts its file."""
    found = []
    services = {doc["metadata"]["name"]: doc for doc in docs if doc["kind"] == "Service"}
    for nats in (d for d in docs if d["kind"] == "StatefulSet" and image_repository(pod_spec(d)["containers"][0]["image"])[0] == "nats"):
        pod = pod_spec(nats)
        container = pod["containers"][0]
        command = container["command"]
        path = command[command.index("--config") + 1]
        text = mounted_file(pod, container, path, maps)
        if text is None:
            found.append(f"StatefulSet/{nats['metadata']['name']}: {path} is not mounted from a ConfigMap")
            continue
        headless = services.get(nats["spec"]["serviceName"], {}).get("spec", {})
        if headless.get("clusterIP") != "None" or not headless.get("publishNotReadyAddresses"):
            found.append(f"StatefulSet/{nats['metadata']['name']}: serviceName must be a headless Service publishing unready pods")
        cluster_port = next(p["containerPort"] for p in container["ports"] if p["name"] == "cluster")
        routes = set(re.findall(r"nats://([\w.-]+:\d+)", text))
        wanted = {f"{nats['metadata']['name']}-{i}.{nats['spec']['serviceName']}:{cluster_port}" for i in range(nats["spec"]["replicas"])}
        if routes != wanted:
            found.append(f"StatefulSet/{nats['metadata']['name']}: routes {sorted(routes)} should be {sorted(wanted)}")
        binary = Path(sys.executable).parent / "nats-server"
        with tempfile.TemporaryDirectory() as tmp:
            Path(tmp, "nats.conf").write_text(text)
            done = subprocess.run([str(binary), "-t", "-c", str(Path(tmp, "nats.conf"))], env={**os.environ, "POD_NAME": "nats-0"},
                                  capture_output=True, text=True, timeout=30, check=False)
            if done.returncode != 0:
                found.append(f"StatefulSet/{nats['metadata']['name']}: nats-server -t refuses the config: {(done.stdout + done.stderr).strip()}")
    return found
