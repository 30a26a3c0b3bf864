"""vLLM's NixlConnector, with NIXL agents that run no progress thread, and kv_share's prefix pulls.

NIXL's UCX progress thread busy-polls: ~a whole core per engine, idle or
not, which on a small host starves the engines it serves (measured here:
an idle prefill engine's worker at 95% of a core). vLLM 0.32 builds its
agents with the thread on and offers no setting for it, so this module
offers the same connector under the same name (vLLM's own checks for
"NixlConnector" keep applying) and builds its agents without the thread;
vLLM's worker then drives transfers from its step loop, as it polls them anyway.
A GPU host that runs it for kv_share keeps the thread (`kvlane_progress_thread`).

kv_share engines pull a prefix through vLLM's bidirectional mode, which
takes the pulling request for a producer's: vLLM would hold its blocks, when
it ends, for a remote decode that kvlane never sends, and it renews no
lease for the source's blocks while the request waits. Here a prefix pull
(`vllm_kv_ref.PREFIX_PULL`) frees its blocks when it ends, and a kv_share
source's held blocks carry their expiry, which vLLM's reader checks before it
reads (a read too close to it fails the request rather than read reused blocks).

vLLM imports this module in its engine processes by name
(`kv_connector_module_path`), never kvlane's worker itself.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.nixl import base_worker
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.connector import NixlPullConnector

from services.worker.engines.vllm_kv_ref import is_prefix_pull
from services.worker.engines.vllm_nixl import PROGRESS_THREAD


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
        extra = vllm_config.kv_transfer_config.kv_connector_extra_config or {}
        if extra.get(PROGRESS_THREAD):
            super().__init__(vllm_config, role, kv_cache_config)
            return
        with _agents_without_progress_thread():
            super().__init__(vllm_config, role, kv_cache_config)

    def request_finished(self, request, block_ids) -> tuple[bool, dict[str, Any] | None]:
        if is_prefix_pull(request.kv_transfer_params):
            return self._prefix_pull_finished(request)
        return self._with_expiry(request, super().request_finished(request, block_ids))

    def request_finished_all_groups(self, request, block_ids) -> tuple[bool, dict[str, Any] | None]:
        if is_prefix_pull(request.kv_transfer_params):
            return self._prefix_pull_finished(request)
        return self._with_expiry(request, super().request_finished_all_groups(request, block_ids))

    def _prefix_pull_finished(self, request) -> tuple[bool, dict[str, Any] | None]:
        """Free the request's blocks now, as vLLM does for an aborted producer request; vLLM internals
        (its pull scheduler's bookkeeping), which tests/vllm/test_vllm_prefix_pull.py checks end to end."""
        scheduler = self.connector_scheduler
        assert scheduler is not None
        params = request.kv_transfer_params
        if not params.get("_remote_blocks_processed"):
            # Ended before it was scheduled (aborted while queued): nothing
            # read the source's blocks, so tell the source to free them, as
            # vLLM does for a decode request aborted before its pull.
            scheduler._reqs_need_recv[request.request_id] = (request, [], (), False)
            params["_remote_blocks_processed"] = True
            return False, None
        # Scheduled: vLLM's worker counts it among the requests whose blocks
        # some consumer will read; it never will.
        scheduler._reqs_not_processed.add(request.request_id)
        scheduler._reqs_need_save.pop(request.request_id, None)
        return False, None

    def _with_expiry(self, request, finished: tuple[bool, dict[str, Any] | None]) -> tuple[bool, dict[str, Any] | None]:
        """A kv_share source's held blocks with their expiry, on this engine's clock, for the reader to check."""
        delay_free, params = finished
        scheduler = self.connector_scheduler
        if (delay_free and params and params.get("do_remote_prefill") and params.get("remote_blocks_expiry_time") is None
                and scheduler is not None and scheduler.is_bidirectional_kv_xfer_enabled):
            params["remote_blocks_expiry_time"] = scheduler._reqs_need_send.get(request.request_id)
        return delay_free, params
