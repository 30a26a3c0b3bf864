"""Uncached prompt tokens each node still has to prefill, as far as this balancer knows (pure, no I/O).

A node that has just been sent several long uncached prompts will not
start the next request's prefill until those are done: that wait is most
of the next request's time to first token, and neither the node's last
heartbeat (up to an interval old) nor its batch size shows it. The
balancer knows what it sent, so each placement adds the request's uncached
prompt tokens to the node's backlog, and the backlog drains at the node's
prefill rate (a fluid estimate). A heartbeat that shows an empty waiting
queue caps the backlog, so errors in the drain rate do not accumulate: at
what was sent after that heartbeat, plus what the prompts sent before it,
which had all started by then, cannot have prefilled yet at the node's
prefill rate. Started is not done: an engine prefills a long prompt in
chunks over many steps (a 28k-token prompt takes seconds on an A100), and
capping at the unseen prompts alone forgot it while it still held the node.

Once a prompt has started, though, only the drain rate bounds it, and a
node whose measured speed is far off keeps a backlog it no longer has. A
heartbeat that counts no request still prefilling (`EngineStats.prefilling`)
says every prompt sent well before it is done: the backlog is capped at what
was sent after. A node that does not report the count keeps the estimate above.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable

# A request routed this long before a heartbeat may not have reached the
# engine by then (ingress hop, a loaded host): the heartbeat cannot vouch for it.
_TRANSIT_S = 0.25


class PrefillBacklog:
    def __init__(self) -> None:
        self._tokens: dict[str, float] = {}
        self._since: dict[str, float] = {}
        self._sent: dict[str, deque[tuple[float, int]]] = {}

    def tokens(self, worker_id: str, drain_per_s: float, now: float) -> float:
        """Tokens still queued for prefill on the node at `now`."""
        left = self._tokens.get(worker_id)
        if not left:
            return 0.0
        # max(0.0, x) as conditional expressions (it runs per routing decision): x if x > 0.0 else 0.0, NaN included.
        elapsed = now - self._since[worker_id]
        left -= drain_per_s * (elapsed if elapsed > 0.0 else 0.0)
        return left if left > 0.0 else 0.0

    def state(self, worker_id: str) -> tuple[float, float]:
        """(tokens left, when they were counted); (0.0, 0.0) for a node with no backlog."""
        return self._tokens.get(worker_id, 0.0), self._since.get(worker_id, 0.0)

    def add(self, worker_id: str, tokens: int, drain_per_s: float, now: float) -> None:
        self._tokens[worker_id] = self.tokens(worker_id, drain_per_s, now) + tokens
        self._since[worker_id] = now
        self._sent.setdefault(worker_id, deque()).append((now, tokens))

    def withdraw(self, worker_id: str, tokens: int, drain_per_s: float, now: float) -> None:
        """A placement was undone: its tokens never went to the node."""
        if worker_id in self._tokens:
            self._tokens[worker_id] = max(0.0, self.tokens(worker_id, drain_per_s, now) - tokens)
            self._since[worker_id] = now

    def observe(
        self, worker_id: str, sent_at: float, waiting: int, drain_per_s: float, now: float, prefilling: int | None = None
    ) -> None:
        """A heartbeat sent at `sent_at` showed `waiting` requests queued on the node, and `prefilling`
        not yet prefilled, the waiting ones included (None: the node does not say)."""
        sent = self._sent.get(worker_id)
        if sent is None:
            return
        seen_before = sent_at - _TRANSIT_S
        if prefilling == 0:
            # Every prompt the node had by then is prefilled: what it may still have to do is what it had not seen.
            while sent and sent[0][0] < seen_before:
                sent.popleft()
            self._cap(worker_id, float(sum(tokens for _, tokens in sent)), drain_per_s, now)
            return
        # The prompts sent well before the heartbeat, as a fluid queue draining at the node's prefill rate:
        # `started` is what of them it cannot have prefilled by now. A prompt sent when that queue was
        # empty makes every earlier one surely done (`done`), and so does an empty queue now.
        started, last, done, count = 0.0, 0.0, 0, 0
        for at, tokens in sent:
            if at >= seen_before:
                break
            if count:
                started = max(0.0, started - drain_per_s * (at - last))
            if started == 0.0:
                done = count
            started, last, count = started + tokens, at, count + 1
        if count:
            started = max(0.0, started - drain_per_s * (now - last))
            if started == 0.0:
                done = count
        for _ in range(done):
            sent.popleft()
        if waiting == 0:
            # Everything sent well before the heartbeat had started prefilling by then; the rest is unseen.
            self._cap(worker_id, started + float(sum(tokens for at, tokens in sent if at >= seen_before)), drain_per_s, now)

    def _cap(self, worker_id: str, cap: float, drain_per_s: float, now: float) -> None:
        """Lower the node's backlog to `cap` tokens at `now`; never raise it."""
        if cap < self.tokens(worker_id, drain_per_s, now):
            self._tokens[worker_id] = cap
            self._since[worker_id] = now

    def forget(self, worker_ids: Iterable[str]) -> None:
        for worker_id in worker_ids:
            self._tokens.pop(worker_id, None)
            self._since.pop(worker_id, None)
            self._sent.pop(worker_id, None)
