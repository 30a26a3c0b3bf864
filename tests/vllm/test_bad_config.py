"""A vllm worker with a configuration that can never work stops at once: exit 2, one line naming the problem.

The checks run before vLLM is imported or started, so no NATS or Redis is needed.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from shared.config import KvlaneConfig, WorkerSettings, to_env
from tests.vllm.conftest import MODEL, vllm_settings

pytestmark = pytest.mark.vllm

REPO = Path(__file__).resolve().parents[2]


def head_dim_16_model(tiny_model: Path, directory: Path) -> Path:
    shutil.copytree(tiny_model, directory)
    config = json.loads((directory / "config.json").read_text())
    config.update(hidden_size=32, head_dim=16, num_attention_heads=2)
    (directory / "config.json").write_text(json.dumps(config))
    return directory


def test_bad_engine_configuration_fails_at_start_with_one_message(tiny_model: Path, tmp_path: Path) -> None:
    cases = {
        "missing model": (vllm_settings(tmp_path / "no-such-model"), "does not exist"),
        "head_dim 16": (vllm_settings(head_dim_16_model(tiny_model, tmp_path / "hd16")), "head_dim 16"),
        "kv cache too small": (vllm_settings(tiny_model, kv_cache_gib=0.0001), "kv_cache_gib"),
    }
    # All three at once: each is a Python start-up, nothing more.
    running = {}
    for name, (settings, _) in cases.items():
        config = KvlaneConfig(worker=WorkerSettings(model=MODEL, engine="vllm", vllm=settings))
        env = {**os.environ, **to_env(config)}
        running[name] = subprocess.Popen([sys.executable, "-m", "services.worker"], env=env, cwd=REPO,
                                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    for name, process in running.items():
        stdout, stderr = process.communicate(timeout=60)
        expected = cases[name][1]
        assert process.returncode == 2, f"{name}: exit {process.returncode}\n{stdout}\n{stderr}"
        lines = (stdout + stderr).strip().splitlines()
        problems = [line for line in lines if line.startswith("kvlane worker: ")]
        assert len(problems) == 1 and expected in problems[0], f"{name}: {stderr}"
        # Besides that line only the structured "service_starting" log: no traceback, no vLLM output.
        others = [json.loads(line)["event"] for line in lines if line not in problems]
        assert others == ["service_starting"], f"{name}: {stdout}{stderr}"
