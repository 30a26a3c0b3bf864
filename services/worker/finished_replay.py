"""Finished-request events that a balancer started just now may have missed, published to it again.

A balancer frees a request's slot (and its KV lease) when it hears the
request's `RequestFinished`. Those published while no balancer ran (the only
one restarting) reach nobody, and their slots stay taken in the shared store
until the requests' deadlines: the restarted balancer would find the nodes
full and queue every request until it timed out. So a worker keeps what it
published lately, and when it hears a balancer replica that is new to it
while no other replica beats (one that does heard every event and freed its
slot for all), it publishes again the events published since shortly
before it last heard any balancer. Freeing is idempotent: an event heard
twice frees nothing twice.

"Beats" is stricter than the heartbeat TTL: a replica killed and restarted
at once (a new id) comes back well within the TTL of the dead one, so one
silent for `silence_s` (a heartbeat and a half) counts as gone here.

A pure record: the worker says what it published and which heartbeats it
heard, and when; this says what to publish again.
"""

from __future__ import annotations

from collections import deque

from contracts.balancer import BalancerHeartbeat
from contracts.messages import RequestFinished


class FinishedReplay:
    def __init__(self, silence_s: float, keep_s: float = 300.0, keep_at_most: int = 20_000) -> None:
        if silence_s <= 0 or keep_s <= 0 or keep_at_most < 1:
            raise ValueError(f"silence_s and keep_s must be positive and keep_at_most at least 1, not {silence_s!r}, "
                             f"{keep_s!r}, {keep_at_most!r}")
        self._silence_s = silence_s
        self._keep_s = keep_s
        self._published: deque[tuple[float, RequestFinished]] = deque(maxlen=keep_at_most)
        # Each live replica's last heartbeat (one that said it stops is live no more), and the last heartbeat of any.
        self._live: dict[str, float] = {}
        self._last_heard: float | None = None

    def published(self, event: RequestFinished, now: float) -> None:
        self._published.append((now, event))
        while self._published and now - self._published[0][0] > self._keep_s:
            self._published.popleft()

    def heard(self, heartbeat: BalancerHeartbeat, now: float) -> list[RequestFinished]:
        """What to publish again now that `heartbeat` came: the events since shortly before any balancer was last
        heard, when it comes from a replica not live to this worker while no other was; else nothing."""
        balancer_id = heartbeat.balancer_id
        last_heard, self._last_heard = self._last_heard, now
        if heartbeat.stopping:
            self._live.pop(balancer_id, None)
            return []
        live = {other: at for other, at in self._live.items() if now - at <= self._silence_s}
        was_live = balancer_id in live
        others_live = len(live) > (1 if was_live else 0)
        self._live = live | {balancer_id: now}
        if was_live or others_live or last_heard is None:
            return []
        # The last replica heard at `last_heard` died after it; the margin is for events then on their way.
        since = last_heard - self._silence_s
        return [event for at, event in self._published if at >= since]
