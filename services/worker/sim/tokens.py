"""The sim model's "weights": a pure function from (seed, prompt, position) to a token.

A request's k-th output token depends only on its seed, its prompt and k.
That is what lets a request migrate: replay the prompt with the same seed on
another node (or after a preemption, on the same node) and generation
continues with exactly the tokens it would have produced.

Everything here is stable across processes and Python versions: no salted
``hash()``, no global random state.
"""

from __future__ import annotations

from collections.abc import Sequence
from hashlib import blake2b

from shared.kv.block_hash import pack_token_ids

MASK64 = (1 << 64) - 1
_GOLDEN_GAMMA = 0x9E3779B97F4A7C15
# blake2b's personalisation keeps prompt digests apart from block hashes.
_PROMPT_PERSON = b"kvlane-prompt"


def splitmix64(value: int) -> int:
    """Steele/Lea/Flood's SplitMix64 finaliser: a fast, well-mixed 64-bit bijection."""
    z = (value + _GOLDEN_GAMMA) & MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK64
    return z ^ (z >> 31)


def prompt_digest(token_ids: Sequence[int]) -> int:
    """64-bit digest of a prompt's token ids (each in ``0 .. 2**32 - 1``).

    blake2b over the packed ids runs in C, which beats mixing the ids one
    by one in Python by more than an order of magnitude for long prompts.
    """
    digest = blake2b(pack_token_ids(token_ids), digest_size=8, person=_PROMPT_PERSON)
    return int.from_bytes(digest.digest(), "big")


def stream_key(seed: int, prompt_digest: int) -> int:
    """Per-request key of the token stream; ``token_at`` reads tokens off it."""
    return splitmix64((seed & MASK64) ^ splitmix64(prompt_digest & MASK64))


def token_at(key: int, position: int, low: int, span: int) -> int:
    """Token at output ``position`` of the stream ``key``, in ``[low, low + span)``.

    The scheduler's per-token hot path: the key is computed once per request.
    """
    return low + splitmix64((key + position) & MASK64) % span


def output_token(seed: int, prompt_digest: int, position: int, token_range: tuple[int, int]) -> int:
    """Token at output ``position`` (0-based) of a request; ``token_range`` is half-open."""
    low, high = token_range
    if high <= low:
        raise ValueError(f"token_range must be non-empty, got {token_range}")
    return token_at(stream_key(seed, prompt_digest), position, low, high - low)
