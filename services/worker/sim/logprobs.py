"""The sim model's log probabilities: a pure function of the stream key, the position and the token.

The sim samples no distribution, so these are made up, yet shaped as a real
model's: the sampled token is the most likely at its position (logprob <= 0),
the others ranked after it with lower ones. Being a function of the stream,
a resumed request reports what an uninterrupted run would have.
"""

from __future__ import annotations

from collections.abc import Callable

from contracts.messages import TokenLogprob, TopLogprob
from services.worker.sim.tokens import MASK64, splitmix64

# Keeps the logprob draws apart from the token draws of the same stream key.
_LOGPROB_SALT = 0x51D3_9A0C_E7B2_4F68
_UNIT = 1 / (1 << 64)


def _draws(key: int, position: int, token_id: int):
    state = splitmix64(((key ^ _LOGPROB_SALT) + position) & MASK64) ^ splitmix64(token_id & MASK64)
    while True:
        state = splitmix64(state)
        yield state


def token_logprob(key: int, position: int, token_id: int, ranked: int, alternatives: tuple[int, int],
                  text_of: Callable[[int], str]) -> TokenLogprob:
    """The sampled token at output `position` and `ranked` entries in its `top`: the sampled one first, then
    others drawn from the `alternatives` id range (half-open), each less likely than the one before."""
    draws = _draws(key, position, token_id)
    logprob = -next(draws) * _UNIT * 2.5
    text = text_of(token_id)
    top = [TopLogprob(text, logprob, list(text.encode()), token_id)] if ranked > 0 else []
    low, high = alternatives
    seen = {token_id}
    current = logprob
    while len(top) < min(ranked, high - low + (token_id not in range(low, high))):
        other = low + next(draws) % (high - low)
        if other in seen:
            continue
        seen.add(other)
        current -= 0.05 + next(draws) * _UNIT * 1.5
        other_text = text_of(other)
        top.append(TopLogprob(other_text, current, list(other_text.encode()), other))
    return TokenLogprob(text, logprob, list(text.encode()), top, token_id)
