"""Bounds on JFFC's mean response time, and the slot count they recommend (pure).

Model (Sun, He and Hou): Poisson arrivals at rate λ, chain k has s_k slots
each serving at rate μ_k. Under JFFC the number of requests in the system
is bracketed by two birth-death chains:

* lower bound: requests always sit on the fastest slots, so in state n the
  total service rate is the sum of the n fastest slot rates;
* upper bound: they sit on the slowest slots first.

Beyond the total slot count S both chains serve at the full rate and the
tail is geometric, which gives E[N] in closed form; Little's law turns it
into mean response time E[N]/λ. Both are infinite when λ reaches the total
service rate.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

from msgspec import Struct


class ChainRate(Struct, frozen=True):
    chain_id: str
    slots: int
    rate_per_slot: float  # requests per second one slot completes


class ResponseBounds(Struct, frozen=True):
    lower_s: float
    upper_s: float


def mean_response(death_rates: Sequence[float], arrival_rate: float) -> float:
    """Mean response time of the birth-death chain whose state-n service rate is `death_rates[n-1]` (n <= S)."""
    if arrival_rate <= 0 or not death_rates:
        return math.inf if not death_rates else 1.0 / death_rates[0]
    full_rate = death_rates[-1]
    rho = arrival_rate / full_rate
    if rho >= 1.0:
        return math.inf
    # log of the unnormalised stationary weights, shifted to avoid overflow.
    logs = [0.0]
    for rate in death_rates:
        logs.append(logs[-1] + math.log(arrival_rate / rate))
    shift = max(logs)
    weights = [math.exp(x - shift) for x in logs]
    top = len(death_rates)
    tail_mass = weights[-1] * rho / (1 - rho)
    # sum_{m>=1} (S+m) rho^m = S*rho/(1-rho) + rho/(1-rho)^2
    tail_mean = weights[-1] * (top * rho / (1 - rho) + rho / (1 - rho) ** 2)
    total = sum(weights) + tail_mass
    mean_n = (sum(n * w for n, w in enumerate(weights)) + tail_mean) / total
    return mean_n / arrival_rate


def _cumulative(rates: Sequence[float]) -> list[float]:
    out, running = [], 0.0
    for rate in rates:
        running += rate
        out.append(running)
    return out


# Slots the bounds consider at most: their cost grows with the slot count, which a node only
# reports (an unbounded fleet has 2^30 per chain; a bogus heartbeat any number). Beyond a few
# thousand slots the last ones change the bounds by nothing measurable at any arrival rate that
# the first ones do not already serve.
MAX_SLOTS = 4096


def _slot_rates(chains: Sequence[ChainRate], fastest: bool) -> list[float]:
    """The per-slot rates of the `MAX_SLOTS` fastest (or slowest) slots, in that order."""
    rates: list[float] = []
    for chain in sorted((c for c in chains if c.rate_per_slot > 0 and c.slots > 0), key=lambda c: c.rate_per_slot,
                        reverse=fastest):
        rates.extend([chain.rate_per_slot] * min(chain.slots, MAX_SLOTS - len(rates)))
        if len(rates) >= MAX_SLOTS:
            break
    return rates


def response_bounds(chains: Sequence[ChainRate], arrival_rate: float) -> ResponseBounds:
    return ResponseBounds(
        lower_s=mean_response(_cumulative(_slot_rates(chains, fastest=True)), arrival_rate),
        upper_s=mean_response(_cumulative(_slot_rates(chains, fastest=False)), arrival_rate),
    )


def candidate_caps(limit: int) -> list[int]:
    """1..8, then roughly 1.5x steps up to `limit`: enough resolution for a knee, cheap to evaluate."""
    caps, cap = [], 1
    while cap <= limit:
        caps.append(cap)
        cap = cap + 1 if cap < 8 else int(cap * 1.5)
    if caps and caps[-1] != limit:
        caps.append(limit)
    return caps


def recommend_slots(
    kv_slots: Sequence[tuple[str, int]],
    rate_at: Callable[[str, int], float],
    arrival_rate: float,
) -> tuple[int, ResponseBounds] | None:
    """The per-chain slot cap that minimises the lower bound at `arrival_rate`.

    More slots add capacity but slow every slot down (a bigger batch per
    step): `rate_at(chain_id, slots)` gives the per-slot rate at that
    occupancy. Each chain gets min(its KV slots, cap). None when there are
    no chains or no arrivals to size for.
    """
    if not kv_slots or arrival_rate <= 0:
        return None
    best: tuple[int, ResponseBounds] | None = None
    for cap in candidate_caps(min(max(s for _, s in kv_slots), MAX_SLOTS)):
        chains = [ChainRate(c, min(s, cap), rate_at(c, min(s, cap))) for c, s in kv_slots]
        bounds = response_bounds(chains, arrival_rate)
        if best is None or bounds.lower_s < best[1].lower_s:
            best = (cap, bounds)
    return best
