"""vLLM NixlConnector's `kv_transfer_params` <-> kvlane's `KvRef` (pure: no vllm import).

A prefill (kv_producer) engine finishes a request with a dict that names
where its KV waits: engine, request, blocks, side channel. kvlane carries
that dict to the decode node as a `KvRef`, whose named fields are what
kvlane itself reads (routing, stats, expiry) and whose `engine_extras` keep
every other key so the decode engine gets back exactly what vLLM wrote.
A kv_share engine that pulls only a prefix of its prompt gets the same
dict, reshaped for vLLM's partial pull (`prefix_pull_params`).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from contracts.messages import KvRef

# What a request sent to a producer carries so that vLLM holds its KV for a
# remote decode instead of freeing it (NixlConnector's documented request side).
_PRODUCER_REQUEST = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}
# Keys KvRef names; every other key rides in engine_extras.
_NAMED = ("remote_engine_id", "remote_request_id", "remote_block_ids", "remote_host", "remote_port", "remote_num_tokens")
# engine_extras holds scalars only (its wire type); a list or table that a
# later vLLM may add travels JSON-encoded under this prefix instead of
# breaking the message's validation on the decode node.
_JSON_PREFIX = "json:"
# Read by vLLM's output processor on the decode node: the prompt tokens the
# prefill node found in its own prefix cache, which the decode request then
# reports as cached (rather than counting every pulled token as a cache hit).
REMOTE_CACHED_TOKENS = "remote_prefill_cached_tokens"
# Marks a request that pulls a prefix of its prompt from another kv_share
# engine: kvlane's connector (vllm_nixl_connector.py) frees its blocks when it
# ends, where vLLM would hold them for the remote decode that its
# `do_remote_decode` announces and that never comes.
PREFIX_PULL = "kvlane_prefix_pull"
# vLLM's guard against shortening a `do_remote_decode` request's prompt twice:
# it drops the tokens a decode node would recompute (Mamba state, multi-token
# prediction) and caps the output at one token. The request that pulls a
# prefix decodes itself, so its prompt must stay whole.
_P_SIDE_TRUNCATED = "_p_side_truncated"


def producer_request_params() -> dict[str, Any]:
    """`kv_transfer_params` for a request run on the prefill node."""
    return dict(_PRODUCER_REQUEST)


def kv_ref_from_params(
    params: Mapping[str, Any],
    *,
    source_worker_id: str,
    prompt_tokens: int,
    kv_bytes_per_token: int,
    block_size: int,
    hold_s: float,
) -> KvRef:
    """The `KvRef` for a producer's finished-request `kv_transfer_params`.

    ValueError when the dict lacks what a decode node needs to pull (the
    request was not held, e.g. aborted, or the engine has no connector).
    """
    missing = [key for key in ("remote_engine_id", "remote_request_id", "remote_block_ids") if params.get(key) is None]
    if missing:
        raise ValueError(f"kv_transfer_params lack {', '.join(missing)}: {dict(params)!r}")
    num_tokens = int(params.get("remote_num_tokens") or prompt_tokens)
    block_ids = [list(group) for group in params["remote_block_ids"]]
    # A pull moves whole blocks (the last one partly filled), so that is what it costs.
    held_tokens = max((len(group) for group in block_ids), default=0) * block_size or num_tokens
    extras: dict[str, Any] = {}
    for key, value in params.items():
        if key in _NAMED:
            continue
        if value is None or isinstance(value, str | int | float | bool):
            extras[key] = value
        else:
            extras[_JSON_PREFIX + key] = json.dumps(value)
    return KvRef(
        source_worker_id=source_worker_id,
        engine_id=str(params["remote_engine_id"]),
        request_id=str(params["remote_request_id"]),
        num_tokens=num_tokens,
        hold_s=hold_s,
        block_ids=block_ids,
        host=params.get("remote_host") or "",
        port=int(params.get("remote_port") or 0),
        kv_bytes=held_tokens * kv_bytes_per_token,
        cached_tokens=int(params.get(REMOTE_CACHED_TOKENS) or 0),
        engine_extras=extras,
    )


def params_from_kv_ref(ref: KvRef) -> dict[str, Any]:
    """`kv_transfer_params` for the decode node's request: the producer's dict, rebuilt."""
    params: dict[str, Any] = {}
    for key, value in ref.engine_extras.items():
        if key.startswith(_JSON_PREFIX) and isinstance(value, str):
            params[key.removeprefix(_JSON_PREFIX)] = json.loads(value)
        else:
            params[key] = value
    params.update(
        remote_engine_id=ref.engine_id,
        remote_request_id=ref.request_id,
        remote_block_ids=[list(group) for group in ref.block_ids],
        remote_host=ref.host,
        remote_port=ref.port,
        remote_num_tokens=ref.num_tokens,
        # What makes the consumer pull; the producer already writes it so,
        # but a hand-built or edited reference must not turn into a prefill.
        do_remote_prefill=True,
        do_remote_decode=False,
    )
    return params


def prefix_pull_params(ref: KvRef) -> dict[str, Any]:
    """`kv_transfer_params` for a kv_share engine's request whose prompt starts with the `ref.num_tokens` held by `ref`.

    vLLM's partial pull: a `do_remote_decode` request naming remote blocks
    loads min(`remote_num_tokens`, prompt) tokens, less those its own prefix
    cache holds, and computes the rest. The prompt must not be shorter than
    the reference (vLLM would pair the reference's last blocks with its first).
    """
    params = params_from_kv_ref(ref)
    params.pop(REMOTE_CACHED_TOKENS, None)
    params.update(do_remote_prefill=False, do_remote_decode=True)
    params[PREFIX_PULL] = True
    params[_P_SIDE_TRUNCATED] = True
    return params


def is_prefix_pull(params: Mapping[str, Any] | None) -> bool:
    return bool(params) and bool(params.get(PREFIX_PULL))  # type: ignore[union-attr]
