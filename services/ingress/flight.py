"""One request's way through the fleet as ingress decides it: a pure state machine, no I/O.

A `RequestFlight` hears what happened to the request (a route decision, a
node that did not accept it, a frame, a stream that broke off, a route
request no balancer answered, no balancer there to ask) and says what to do
next: route it (again), wait for a balancer, hand it to the chosen node,
pass a frame to the client, or fail it. The
ingress's `Dispatcher` runs these actions over the bus; the virtual-time
simulator runs the same ones on its simulated fleet.

It keeps what the request's resumptions share: the tokens the client has
had (a resumed request carries them, so the client gets no duplicated and
no missing token), the client's frame numbering, the nodes not to route
to again, the possibly degraded `max_tokens`, and the bounds: at most
`dispatch_attempts` nodes that do not accept it, `migration_attempts`
resumptions and of those `node_loss_resumes` after its node died, and
`preemption_resumes` resumptions after a preemption (counted apart: a
low-priority request may legitimately give way several times). A request
with n > 1 resumes only before its first token.

A control-plane restart is not an error: while no balancer is there to ask
(none running, or every replica silent), the route request is held and asked
again, for at most `balancer_wait_s` in a row and within the request's
deadline; only then does the client get 503.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import msgspec

from contracts.health import FeedbackKind
from contracts.messages import StreamEnd, TokenChunk
from services.ingress.errors import ApiError
from shared.config import IngressSettings


class StreamInterrupted(Exception):
    """The stream broke off; `culprit` is the node at fault (excluded next time) and `feedback` what it did.

    `restarted`: the culprit's process died and a new one runs under its id; that one is not excluded.
    `node_lost`: the culprit's process died (restarted, or gone from the cluster).
    """

    def __init__(self, reason: str, feedback: FeedbackKind | None, culprit: str = "", preempted: bool = False,
                 handed_back: bool = False, restarted: bool = False, node_lost: bool = False) -> None:
        super().__init__(reason)
        self.reason = reason
        self.feedback = feedback
        self.culprit = culprit
        self.preempted = preempted
        self.handed_back = handed_back
        self.restarted = restarted
        self.node_lost = node_lost or restarted

    @property
    def cause(self) -> str:
        """Why, in one word (the migrations metric's label): preempted, handed_back (the worker is leaving),
        error, timeout, or reconnect (frames lost)."""
        if self.preempted:
            return "preempted"
        return "handed_back" if self.handed_back else (self.feedback or "reconnect")


@dataclass(frozen=True, slots=True)
class Route:
    """Ask a balancer where to run attempt number `attempt` (from 1), on none of `exclude`, resuming after `produced`."""

    attempt: int
    exclude: tuple[str, ...]
    produced: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class AwaitBalancer:
    """No balancer to ask: wait for one to say it is there, at most `wait_s`, then ask `route`."""

    wait_s: float
    route: Route


@dataclass(frozen=True, slots=True)
class HandOver:
    """Hand the request to the node chosen, with `max_tokens` in all; `capped`: the balancer just lowered it."""

    max_tokens: int
    capped: bool


@dataclass(frozen=True, slots=True)
class Yield:
    """Pass `frame` to the client and go on relaying."""

    frame: TokenChunk | StreamEnd


@dataclass(frozen=True, slots=True)
class Done:
    """Pass `frame`, the request's last, to the client: the request is over."""

    frame: StreamEnd


@dataclass(frozen=True, slots=True)
class Fail:
    """The request is over: answer the client `error`."""

    error: ApiError


class FlightOver(RuntimeError):
    """An event came after the request's end."""


class RequestFlight:
    """The decisions of one request's route, hand-over, relay and resumptions (see the module's docstring)."""

    # Asked again after no balancer answered: soon at first (a restart takes about a second), then less often.
    FIRST_BALANCER_RETRY_S = 0.1
    MAX_BALANCER_RETRY_S = 1.0

    def __init__(self, settings: IngressSettings, max_tokens: int, n: int = 1) -> None:
        self.max_tokens = max_tokens
        self._n = n
        self._dispatch_attempts = settings.dispatch_attempts
        self._migration_attempts = settings.migration_attempts
        self._node_loss_resumes = settings.node_loss_resumes
        self._preemption_resumes = settings.preemption_resumes
        self._balancer_wait_s = settings.balancer_wait_s
        # When the present run of route requests that found no balancer began (None: the last one was answered).
        self._no_balancer_since: float | None = None
        self._balancer_retries = 0
        self.outcome: Literal["done", "failed"] | None = None
        self.attempt = 0
        self._excluded: list[str] = []
        self._produced: list[int] = []
        # The next frame's number on the client's stream; each attempt's node numbers its own from 0.
        self._client_seq = 0
        self.refusals = self.migrations = self.node_losses = self.preemptions = self.unanswered = 0
        self.balancer_waits = 0

    @property
    def produced(self) -> Sequence[int]:
        """The tokens the request has produced, over all its attempts."""
        return self._produced

    @property
    def excluded(self) -> Sequence[str]:
        """The nodes its next routes avoid."""
        return self._excluded

    @property
    def over(self) -> bool:
        return self.outcome is not None

    # --- events -----------------------------------------------------------------------

    def start(self) -> Route:
        if self.attempt:
            raise FlightOver("the request has started")
        return self._route()

    def on_unanswered(self, reason: str) -> Route | Fail:
        """No balancer answered the route request in time: it may have gone away holding the request. Asked
        again once in the request's life, as a new attempt."""
        self._running()
        self.unanswered += 1
        if self.unanswered > 1:
            return self._fail(ApiError(503, f"routing failed: {reason}", code="balancer_unavailable", retry_after_s=1.0))
        return self._route()

    def on_no_balancer(self, now: float, time_left_s: float) -> AwaitBalancer | Fail:
        """No balancer took the route request (none listens, or every replica known is silent): hold the request
        and ask again, for at most `balancer_wait_s` since the first such answer in a row and within the
        `time_left_s` of its deadline. `now`: any monotonic clock, the same on every call."""
        self._running()
        if self._no_balancer_since is None:
            self._no_balancer_since = now
            self._balancer_retries = 0
        left_s = min(self._balancer_wait_s - (now - self._no_balancer_since), time_left_s)
        if left_s <= 0:
            waited_s = now - self._no_balancer_since
            return self._fail(ApiError(503, f"no balancer is running (waited {waited_s:.1f}s for one)",
                                       code="balancer_unavailable", retry_after_s=1.0))
        self._balancer_retries += 1
        self.balancer_waits += 1
        retry_s = min(self.FIRST_BALANCER_RETRY_S * 2 ** (self._balancer_retries - 1), self.MAX_BALANCER_RETRY_S)
        return AwaitBalancer(min(retry_s, left_s), self._route())

    def on_decision(self, max_tokens: int = 0) -> HandOver:
        """A balancer chose a node; `max_tokens`: the tokens it allows from here on, when it degraded the request
        under overload (0: as asked)."""
        self._running()
        self._no_balancer_since = None
        produced = len(self._produced)
        if 0 < max_tokens < self.max_tokens - produced:
            self.max_tokens = produced + max_tokens
            return HandOver(self.max_tokens, capped=True)
        return HandOver(self.max_tokens, capped=False)

    def on_refused(self, worker_id: str) -> Route | Fail:
        """The chain's first node did not accept the request (gone, slow, draining): route it elsewhere."""
        self._running()
        self._excluded.append(worker_id)
        self.refusals += 1
        if self.refusals >= self._dispatch_attempts:
            return self._fail(ApiError(503, f"no worker accepted the request after {self.refusals} attempts",
                                       code="no_capacity", retry_after_s=1.0))
        return self._route()

    def on_tokens(self, token_ids: Sequence[int]) -> None:
        """Tokens the running node produced, where they are not relayed as frames (`on_frame` records its own)."""
        self._produced.extend(token_ids)

    def on_frame(self, frame: TokenChunk | StreamEnd) -> Yield | Done:
        """A frame of the running node's stream (in its order, none missing), renumbered to the client's stream."""
        self._running()
        if isinstance(frame, TokenChunk):
            self._produced.extend(frame.token_ids)
        # Renumbered only after a resumption: until then the node's numbering is the client's.
        if frame.seq != self._client_seq:
            frame = msgspec.structs.replace(frame, seq=self._client_seq)
        self._client_seq += 1
        if isinstance(frame, StreamEnd):
            self.outcome = "done"
            return Done(frame)
        return Yield(frame)

    def on_interrupted(self, interruption: StreamInterrupted) -> Route | Fail:
        """The stream broke off (or never started: the node died before its first frame): resume the request,
        or fail it once it has used up its resumptions."""
        self._running()
        reason = interruption.reason
        if self._n > 1 and self._produced:
            # Its choices' tokens are interleaved: a resumption would not know which to continue.
            return self._fail(ApiError(502, f"request failed: {reason} (a request with n > 1 resumes only before "
                                       "its first token)", code="stream_interrupted"))
        if interruption.preempted:
            self.preemptions += 1
            if self.preemptions > self._preemption_resumes:
                return self._fail(ApiError(503, f"preempted {self.preemptions} times", code="preempted", retry_after_s=1.0))
        elif self.migrations >= self._migration_attempts:
            return self._fail(ApiError(502, f"request failed after {self.migrations} resumptions: {reason}",
                                       code="stream_interrupted"))
        elif interruption.node_lost and self.node_losses >= self._node_loss_resumes:
            return self._fail(ApiError(
                502, f"request failed: {self.node_losses + 1} nodes died while running it (the last: {reason})",
                code="stream_interrupted",
            ))
        else:
            self.migrations += 1
            self.node_losses += interruption.node_lost
        if interruption.culprit and not interruption.restarted:
            self._excluded.append(interruption.culprit)
        return self._route()

    # --- helpers ----------------------------------------------------------------------

    def _running(self) -> None:
        if self.outcome is not None:
            raise FlightOver(f"the request is over ({self.outcome})")

    def _route(self) -> Route:
        self.attempt += 1
        return Route(self.attempt, tuple(self._excluded), tuple(self._produced))

    def _fail(self, error: ApiError) -> Fail:
        self.outcome = "failed"
        return Fail(error)
