"""The simulator's control-plane delays: constants (`Latencies`), or drawn per request from measured
distributions (`Spread`, `SpreadByLoad`) with seeded generators (`Delays`)."""

from __future__ import annotations

import bisect
import random
from collections.abc import Callable
from dataclasses import dataclass, fields


@dataclass(frozen=True)
class Spread:
    """One delay's empirical distribution: its quantiles at evenly spaced probabilities from 0 to 1 (at least
    two, ascending). A sample draws a probability and interpolates between the two quantiles around it, so
    a table of a live run's quantiles reproduces its median, its tail and everything between."""

    quantiles: tuple[float, ...]

    def __post_init__(self) -> None:
        values = self.quantiles
        if len(values) < 2 or not all(v >= 0 for v in values) or any(b < a for a, b in zip(values, values[1:])):
            raise ValueError(f"a spread takes at least two ascending non-negative quantiles, not {values!r}")

    def sample(self, rng: random.Random, in_flight: int = 0) -> float:
        position = rng.random() * (len(self.quantiles) - 1)
        index = int(position)
        low = self.quantiles[index]
        high = self.quantiles[min(index + 1, len(self.quantiles) - 1)]
        return low + (high - low) * (position - index)

    @property
    def longest(self) -> float:
        return self.quantiles[-1]


@dataclass(frozen=True)
class SpreadByLoad:
    """A delay whose distribution depends on the load: one `Spread` per band of requests in flight (the
    clients' count, when the request was sent). `bands[i]` holds up to `up_to[i]` requests in flight, the last
    band everything above; a load beyond what was measured takes the last band, as nothing says how it grows."""

    up_to: tuple[int, ...]
    bands: tuple[Spread, ...]

    def __post_init__(self) -> None:
        if len(self.bands) != len(self.up_to) + 1 or any(b <= a for a, b in zip(self.up_to, self.up_to[1:])):
            raise ValueError(f"a spread by load takes ascending bounds and one band more than bounds, not {self.up_to!r} "
                             f"with {len(self.bands)} bands")

    def sample(self, rng: random.Random, in_flight: int = 0) -> float:
        return self.bands[bisect.bisect_left(self.up_to, in_flight)].sample(rng)

    @property
    def longest(self) -> float:
        return max(band.longest for band in self.bands)


@dataclass(frozen=True)
class Latencies:
    """The control plane's own delays, one per stretch of a request's way that a live fleet's spans show
    apart (`loadtest.simulation.calibration` measures them on a live fleet). The defaults are what a live
    sim fleet of a few nodes shows on an idle 2-core machine (`kvlane bench`'s wait before the worker,
    about 9-10 ms at p50); a GPU host's control plane takes a fraction of that, a busy machine more."""

    # From the client's send to ingress asking for a route: HTTP, validation, chat template, tokens.
    ingress_s: float = 0.005
    # One NATS message: the route request, an event (heartbeat, KV events, RequestFinished, health).
    hop_s: float = 0.0005
    # The balancer's own time per route decision, with its slot and lease round trips to Redis.
    decision_s: float = 0.002
    # From the route decision to the worker taking the request: the reply to ingress, which opens the
    # stream and sends the request (its prompt's tokens) on to the worker.
    handover_s: float = 0.001
    # From the end of the engine step that made a token to the client reading it: the worker's stream
    # batch, NATS, ingress's relay and the SSE frame.
    stream_s: float = 0.0005
    # What a live sim engine's step takes beyond its profile time: the step is computed before its sleep
    # starts, the sleep wakes on the event loop's millisecond timer, and the worker shares its loop and
    # the host's cores with its requests' streams.
    step_overhead_s: float = 0.0
    # Delays that vary request by request, as measured (`calibration.fit_spreads`): (name, spread) for
    # any of ingress, hop, decision, handover and stream. Each request (each message, for hop) then
    # draws its own from the simulation's seeded generator; the constant above stays its typical value
    # where one number is needed (when clients start, how long messages still in flight take to land).
    spreads: tuple[tuple[str, Spread | SpreadByLoad], ...] = ()
    # Measured requests' own delays, kept together: (name, each measured request's value), the lists one
    # length. Each simulated request takes one measured request's delays for all of these at once, so a
    # moment that slowed every stretch of a live request slows every stretch of a simulated one, as
    # independent draws from each spread would not (their sum spreads less than the live sum does).
    per_request: tuple[tuple[str, tuple[float, ...]], ...] = ()

    def __post_init__(self) -> None:
        negative = [name for name, value in self.constants().items() if not value >= 0]
        negative += [name for name, values in self.per_request if not all(v >= 0 for v in values)]
        if negative:
            raise ValueError(f"latencies must not be negative: {', '.join(negative)}")
        unknown = [name for name, _ in (*self.spreads, *self.per_request) if name not in SPREAD_DELAYS]
        if unknown:
            raise ValueError(f"no delay can vary by these names: {', '.join(unknown)} (known: {', '.join(SPREAD_DELAYS)})")
        if len({len(values) for _, values in self.per_request}) > 1 or any(not values for _, values in self.per_request):
            raise ValueError("per-request delays need one value per measured request for each delay")

    def constants(self) -> dict[str, float]:
        """The constant delays by field name (`ingress_s`, ...)."""
        return {f.name: getattr(self, f.name) for f in fields(self) if f.name not in ("spreads", "per_request")}


# The delays a `Latencies.spreads` entry can make vary (the step overhead is one figure, from the TPOT).
SPREAD_DELAYS = ("ingress", "hop", "decision", "handover", "stream")


class Delays:
    """Each control-plane delay as the simulation takes it: the constant, or a draw from its spread."""

    def __init__(self, latencies: Latencies, seed: object, in_flight: Callable[[], int]) -> None:
        self._constant = {name: getattr(latencies, f"{name}_s") for name in SPREAD_DELAYS}
        self._spreads = dict(latencies.spreads)
        # One generator per delay: the n-th request draws the same ingress delay under every policy.
        self._rngs = {name: random.Random(f"{seed}:delay:{name}") for name in self._spreads}
        self._in_flight = in_flight
        self._per_request = dict(latencies.per_request)
        self._measured = len(latencies.per_request[0][1]) if latencies.per_request else 0
        self._request_rng = random.Random(f"{seed}:delay:per-request")

    def for_request(self) -> dict[str, float] | None:
        """One measured request's delays for a new request (None: it draws each delay on its own)."""
        if not self._measured:
            return None
        index = self._request_rng.randrange(self._measured)
        return {name: values[index] for name, values in self._per_request.items()}

    def __call__(self, name: str, drawn: dict[str, float] | None = None) -> float:
        """`name`'s delay: the request's own from `drawn` (`for_request`), its spread's draw, or the constant."""
        if drawn is not None and name in drawn:
            return drawn[name]
        spread = self._spreads.get(name)
        return spread.sample(self._rngs[name], self._in_flight()) if spread is not None else self._constant[name]

    def longest(self, name: str) -> float:
        spread = self._spreads.get(name)
        measured = max(self._per_request.get(name, (0.0,)))
        return max(spread.longest if spread is not None else 0.0, measured, self._constant[name])
