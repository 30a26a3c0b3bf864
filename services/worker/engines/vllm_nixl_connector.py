"""vLLM's NixlConnector, with NIXL agents that run no progress thread.

NIXL's UCX progress thread busy-polls: ~a whole core per engine, idle or
not, which on a small host starves the engines it serves (measured here:
an idle prefill engine's worker at 95% of a core). vLLM 0.32 builds its
agents with the thread on and offers no setting for it, so this module
offers the same connector under the same name (vLLM's own checks for
"NixlConnector" keep applying) and builds its agents without the thread;
vLLM's worker then drives transfers from its step loop, as it polls them anyway.

vLLM imports this module in its engine processes by name
(`kv_connector_module_path`), never kvlane's worker itself.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator

from vllm.distributed.kv_transfer.kv_connector.v1.nixl import base_worker
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.connector import NixlPullConnector


@contextlib.contextmanager
def _agents_without_progress_thread() -> Iterator[None]:
    # vLLM's worker reads nixl_agent_config from its module when it builds
    # its agent, in __init__ and nowhere else: swap it for that call only.
    # A vLLM internal: tests/vllm/test_vllm_internals.py pins it.
    original = base_worker.nixl_agent_config
    if original is None:  # NIXL missing: let vLLM report that its own way
        yield
        return
    base_worker.nixl_agent_config = functools.partial(original, enable_prog_thread=False)
    try:
        yield
    finally:
        base_worker.nixl_agent_config = original


class NixlConnector(NixlPullConnector):
    def __init__(self, vllm_config, role, kv_cache_config) -> None:
        with _agents_without_progress_thread():
            super().__init__(vllm_config, role, kv_cache_config)
