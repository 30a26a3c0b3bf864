"""Bending rather than breaking under overload (pure).

A request the balancer cannot place now waits in the central queue. How
long it would wait is predicted from the requests ahead of it (its class
and higher classes are served first) and the rate at which slots free:

* predicted past its deadline (with `shed`): it is refused at once, 429
  with `Retry-After`, rather than after waiting for nothing; the lowest
  class, with the most ahead of it, is shed first;
* predicted past the TTFT target, and of a priority below
  `below_priority`: it waits for a shorter answer (`max_tokens` times
  `max_tokens_factor`), which frees slots sooner for everyone;
* a full queue makes room for a request by refusing the newest waiting
  request of the lowest class below it (`evict_lower_when_full`).

The same prediction bounds where a request may be placed at once
(`backlog_bound_s`): a free slot behind more prefill than the TTFT target
and the queue's predicted wait is not the faster way to a first token.
"""

from __future__ import annotations

import math
from collections import deque

import msgspec

from contracts.messages import ErrorReply, RouteRequest
from services.balancer.central_queue import CentralQueue, QueuedRequest
from shared.config import DegradationSettings


class DepartureRate:
    """Slots freed per second over a sliding window: the rate the central queue drains at."""

    def __init__(self, window_s: float) -> None:
        self._window_s = window_s
        self._times: deque[float] = deque()
        self._started: float | None = None

    def note(self, now: float) -> None:
        self._times.append(now)
        if self._started is None:
            self._started = now

    def per_s(self, now: float) -> float:
        while self._times and self._times[0] < now - self._window_s:
            self._times.popleft()
        if self._started is None:
            return 0.0
        # Before a full window has passed, over the time observed so far (never under a second).
        span = min(self._window_s, max(1.0, now - self._started))
        return len(self._times) / span


def predicted_wait_s(queue: CentralQueue, priority: int, departures_per_s: float, tenant: str | None = None) -> float:
    """Seconds until a request of `priority` queued now would get a slot (inf when nothing leaves); with `tenant`,
    its class serves tenants in turn (fair share)."""
    ahead = queue.ahead_of(priority, tenant)
    if departures_per_s <= 0:
        return math.inf
    # Those ahead leave first, then its own turn comes (it waits only because every slot is busy).
    return (ahead + 1) / departures_per_s


class Degradation:
    def __init__(self, settings: DegradationSettings, retry_after_s: float, fair_share: bool = False) -> None:
        """`fair_share`: the queue serves the tenants of a class in turn, not in arrival order."""
        self._settings = settings
        self._retry_after_s = retry_after_s
        self._fair_share = fair_share
        self.departures = DepartureRate(settings.rate_window_s)
        # What was done, for the metrics: shed, evicted, max_tokens, and local_prefill (the router's:
        # a decode node prefilling itself because the prefill pool is saturated).
        self.counts = {"shed": 0, "evicted": 0, "max_tokens": 0, "local_prefill": 0}

    def before_queueing(self, request: RouteRequest, queue: CentralQueue, deadline: float, now: float) -> RouteRequest | ErrorReply:
        """The request as it should wait (perhaps for fewer tokens), or its refusal."""
        settings = self._settings
        wait = self.predicted_wait_s(queue, request, now)
        if settings.shed and wait > deadline - now and self.departures.per_s(now) > 0:
            self.counts["shed"] += 1
            return ErrorReply(
                code="overloaded", status=429, retry_after_s=max(self._retry_after_s, min(wait, 60.0)),
                message=f"overloaded: a priority-{request.priority} request would wait about {wait:.1f}s for a slot, "
                        f"past its deadline",
            )
        if settings.reduce_max_tokens and wait > settings.ttft_target_s and request.priority < settings.below_priority:
            reduced = max(settings.min_max_tokens, math.ceil(request.max_tokens * settings.max_tokens_factor))
            if reduced < request.max_tokens:
                self.counts["max_tokens"] += 1
                return msgspec.structs.replace(request, max_tokens=reduced)
        return request

    @property
    def ttft_target_s(self) -> float:
        return self._settings.ttft_target_s

    def predicted_wait_s(self, queue: CentralQueue, request: RouteRequest, now: float) -> float:
        return predicted_wait_s(queue, request.priority, self.departures.per_s(now), request.tenant if self._fair_share else None)

    def backlog_bound_s(self, queue: CentralQueue, request: RouteRequest, now: float) -> float:
        """The most prefill backlog a free chain may have for `request` to be placed there now.

        A node busy prefilling long prompts can still have free slots; a
        request placed there waits behind all of that prefill, bound to the
        node, while a slot on another node frees in about the queue's
        predicted wait. Beyond the TTFT target and that wait, the request is
        better off queued. With no departures measured yet there is no
        prediction, and no bound (inf).
        """
        return max(self._settings.ttft_target_s, self.predicted_wait_s(queue, request, now))

    def make_room(self, request: RouteRequest, queue: CentralQueue) -> QueuedRequest | None:
        """Take the newest waiting request of the lowest class below `request`'s out of a full queue (it is refused)."""
        if not self._settings.evict_lower_when_full:
            return None
        lower = [cls for cls in queue.lengths() if cls < request.priority]
        if not lower:
            return None
        victim = queue.newest_of(min(lower))
        if victim is not None:
            queue.remove(victim.request_id)
            self.counts["evicted"] += 1
        return victim

    def evicted_reply(self, victim: QueuedRequest) -> ErrorReply:
        return ErrorReply(code="overloaded", status=429, retry_after_s=self._retry_after_s,
                          message=f"overloaded: a higher-priority request, or one of a tenant with fewer waiting, took this "
                                  f"priority-{victim.request.priority} request's place in the queue")
