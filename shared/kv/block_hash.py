"""kvlane's KV-block hash: the one prefix identity every service agrees on.

The router, the cache-manager and every worker name a block of KV cache by
the hash of the tokens it holds *and of every token before it*, so equal
hashes mean equal prefixes, and a request's cached prefix on a node is the
run of its leading block hashes that the node reports as stored.

Scheme (version 1), for token ids split into blocks of ``block_size``:

* Only FULL blocks get a hash; a trailing partial block has none (a partial
  block's KV keeps changing while the sequence grows, so it cannot be shared).
* ``hash_k = blake2b(digest_size=8)(parent_k + tokens_k)`` read as an
  unsigned 64-bit integer, big-endian, where
    - ``tokens_k`` is block k's token ids packed as little-endian uint32
      (``4 * block_size`` bytes; token ids must lie in ``0 .. 2**32 - 1``);
    - ``parent_k`` is ``hash_{k-1}`` as 8 bytes big-endian, or, for the
      first block, ``ROOT_MARKER`` (14 bytes). The marker's length differs
      from 8 modulo 4, so a first block can never produce the same hashed
      bytes as a later block: the two cases are structurally distinct, not
      just unlikely to collide.
* ``parent`` lets a caller continue a chain: the hashes of
  ``tokens[n*block_size:]`` with ``parent=hash_{n-1}`` are the tail of the
  hashes of ``tokens``.

The hash does not cover the model or the block size as such: keep indexes
per (model, block size). A LoRA adapter's KV differs from its base model's
for the same tokens, so a prompt run with an adapter chains from the
adapter's root (``adapter_root``) instead of ``None``: the adapter is in
every hash, as vLLM puts the LoRA name in its own. vLLM's own block hashes
(in its KV events) are sha256-derived and differ; re-hash the events'
``token_ids`` with this module instead of trusting them.
"""

from __future__ import annotations

import sys
from array import array
from collections.abc import Sequence
from hashlib import blake2b

ROOT_MARKER = b"kvlane/root/v1"

_UINT32 = "I"
if array(_UINT32).itemsize != 4:  # pragma: no cover - every mainstream ABI has 4-byte unsigned int
    _UINT32 = "L" if array("L").itemsize == 4 else ""
    if not _UINT32:
        raise ImportError("no 4-byte unsigned array type on this platform")
_NEEDS_BYTESWAP = sys.byteorder != "little"


def pack_token_ids(token_ids: Sequence[int]) -> bytes:
    """Pack token ids as little-endian uint32 (OverflowError outside that range)."""
    packed = array(_UINT32, token_ids)
    if _NEEDS_BYTESWAP:  # pragma: no cover - big-endian hosts only
        packed.byteswap()
    return packed.tobytes()


def _parent_bytes(parent: int | None) -> bytes:
    return ROOT_MARKER if parent is None else parent.to_bytes(8, "big")


def adapter_root(adapter: str) -> int:
    """The parent of the first block of a prompt run with LoRA adapter `adapter` (by the name clients use)."""
    return int.from_bytes(blake2b(b"kvlane/lora/v1/" + adapter.encode(), digest_size=8).digest(), "big")


def next_block_hash(parent: int | None, block_token_ids: Sequence[int]) -> int:
    """Hash of one full block that follows the block hashed ``parent``.

    ``parent`` is None for a sequence's first block. The caller guarantees
    that ``block_token_ids`` is exactly one full block.
    """
    digest = blake2b(_parent_bytes(parent), digest_size=8)
    digest.update(pack_token_ids(block_token_ids))
    return int.from_bytes(digest.digest(), "big")


def chained_block_hashes(
    token_ids: Sequence[int], block_size: int, parent: int | None = None
) -> list[int]:
    """One chained hash per full block of ``token_ids`` (see the module doc)."""
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    num_full = len(token_ids) // block_size
    if num_full == 0:
        return []
    # Pack everything once and hash memoryview slices: one C-level conversion
    # instead of one per block.
    packed = memoryview(pack_token_ids(token_ids[: num_full * block_size]))
    stride = 4 * block_size
    hashes: list[int] = []
    parent_bytes = _parent_bytes(parent)
    for start in range(0, num_full * stride, stride):
        digest = blake2b(parent_bytes, digest_size=8)
        digest.update(packed[start : start + stride])
        value = digest.digest()
        hashes.append(int.from_bytes(value, "big"))
        parent_bytes = value
    return hashes
