"""Whether a node runs a request on a prefix pulled from the node that caches it (pure).

Under load a request's prefix is often cached on a busy node while another
node has the free slot. Waiting for the busy node leaves the slot idle;
computing the prefix again on the free one costs prefill the fleet has
already paid for. Between kv_share nodes there is a third way: the node
caching the prefix (the source) runs a prefill-only step over it, which
hits its cache, and exposes its blocks; the free node (the runner) pulls
them over the link and computes only the rest (vLLM's NixlConnector with
`kv_both`, Dynamo's KVBM and LMCache do the moving; this decides when).

For each runner the pull is offered when it has the prefix sooner than
computing it again, both from now:

* pull: the source's next step (it joins the source's batch), the bytes
  already queued on the source's link (`LinkQueue`), then the blocks the
  runner lacks over the slower of the two links;
* recompute: those tokens at the runner's prefill rate, plus the delay that
  prefill imposes on the requests running there (the transfer imposes none:
  the engine pulls beside its batch).

An offered pull then stands in for the runner's own cache: the runner is
costed with the source's prefix and the pull's seconds, and the policy
weighs it against every other node, the source included (run on the source:
take its slot if free, or wait for it, `Router.holds_for_cache`).

At least one prompt token is left to the runner: an engine samples the
first output token from a step that computes something.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

from msgspec import Struct

from services.balancer.snapshot import NodeFacts
from shared.balancer_settings import PrefixPullSettings
from shared.kv.links import hand_off_seconds


class PrefixPull(Struct, frozen=True):
    """A request's prefix, pulled to its runner from `source`."""

    source: NodeFacts
    # Leading prompt blocks the source exposes (it caches them); the runner pulls those it lacks.
    blocks: int
    pulled_tokens: int
    pulled_bytes: int
    # Until the prefix is on the runner: the source's step, its link's queue, the transfer.
    seconds: float
    # What computing the pulled tokens again on the runner would take, with the delay it imposes there.
    recompute_s: float

    @property
    def exposed_tokens(self) -> int:
        return self.blocks * self.source.block_size


class LinkQueue:
    """Bytes each source still has to send of the pulls this balancer placed, as a fluid queue draining at its link's
    bandwidth: a second pull from one busy source waits for the first."""

    def __init__(self) -> None:
        self._bytes: dict[str, tuple[float, float]] = {}  # worker id -> (bytes left, when counted)

    def seconds(self, worker_id: str, bytes_per_s: float, now: float) -> float:
        return self._left(worker_id, bytes_per_s, now) / bytes_per_s

    def add(self, worker_id: str, num_bytes: int, bytes_per_s: float, now: float) -> None:
        self._bytes[worker_id] = (self._left(worker_id, bytes_per_s, now) + num_bytes, now)

    def withdraw(self, worker_id: str, num_bytes: int, bytes_per_s: float, now: float) -> None:
        if worker_id in self._bytes:
            self._bytes[worker_id] = (max(0.0, self._left(worker_id, bytes_per_s, now) - num_bytes), now)

    def forget(self, worker_ids: Iterable[str]) -> None:
        for worker_id in worker_ids:
            self._bytes.pop(worker_id, None)

    def _left(self, worker_id: str, bytes_per_s: float, now: float) -> float:
        entry = self._bytes.get(worker_id)
        if entry is None:
            return 0.0
        left, since = entry
        return max(0.0, left - bytes_per_s * max(0.0, now - since))


class PullCandidate(Struct, frozen=True):
    """A kv_share node as a pull sees it: its facts, the request's leading blocks it caches, requests on it now."""

    facts: NodeFacts
    cached_blocks: int
    in_flight: float


class PrefixPulls:
    def __init__(self, settings: PrefixPullSettings, imposed_delay_weight: float) -> None:
        self._settings = settings
        self._imposed_weight = imposed_delay_weight
        self.links = LinkQueue()
        # Placed requests that some node could have pulled their prefix for, by what was chosen
        # (`kvlane_balancer_prefix_pull_choices_total`), and the bytes pulled from each source.
        self.choices = {"pull": 0, "recompute": 0, "run_on_source": 0}
        self.pulled_bytes: dict[str, int] = {}

    @property
    def enabled(self) -> bool:
        return self._settings.enabled

    def offers(self, prompt_tokens: int, candidates: Sequence[PullCandidate], now: float) -> dict[str, PrefixPull]:
        """Runner worker id -> the pull it would run the request on, for the runners where pulling is sooner."""
        if not self._settings.enabled or len(candidates) < 2:
            return {}
        source = max(candidates, key=lambda c: (c.cached_blocks, -self._link_wait_s(c.facts, now), c.facts.worker_id))
        facts = source.facts
        # Leave the runner at least one prompt token to compute.
        blocks = min(source.cached_blocks, (prompt_tokens - 1) // facts.block_size)
        if blocks * facts.block_size < self._settings.min_tokens:
            return {}
        # The source's next step, which its exposure joins; the prefill that step does is at most one block.
        source_s = facts.model.a + facts.model.c * (source.in_flight + 1) + facts.model.b * facts.block_size * (
            1 + self._imposed_weight * source.in_flight)
        queued_s = self._link_wait_s(facts, now)
        pulls: dict[str, PrefixPull] = {}
        for runner in candidates:
            if runner is source:
                continue
            tokens = blocks * facts.block_size - runner.cached_blocks * runner.facts.block_size
            if tokens < self._settings.min_tokens:
                continue
            model = runner.facts.model
            recompute_s = tokens * model.b * (1 + self._imposed_weight * runner.in_flight)
            pull_s = source_s + queued_s + hand_off_seconds(tokens, facts.kv_transfer, runner.facts.kv_transfer)
            if pull_s < recompute_s:
                kv = facts.kv_transfer or runner.facts.kv_transfer
                pulls[runner.facts.worker_id] = PrefixPull(
                    source=facts, blocks=blocks, pulled_tokens=tokens,
                    pulled_bytes=tokens * kv.bytes_per_token if kv is not None else 0,
                    seconds=pull_s, recompute_s=recompute_s)
        return pulls

    def chosen(self, runner_id: str, pull: PrefixPull | None, source_id: str, now: float) -> str:
        """A request with pull offers was placed on `runner_id`, on `pull` (None: without one); what was chosen."""
        if pull is None:
            choice = "run_on_source" if runner_id == source_id else "recompute"
            self.choices[choice] += 1
            return choice
        self.choices["pull"] += 1
        self.pulled_bytes[source_id] = self.pulled_bytes.get(source_id, 0) + pull.pulled_bytes
        if pull.source.kv_transfer is not None:
            # Its bytes queue on the source's link.
            self.links.add(source_id, pull.pulled_bytes, pull.source.kv_transfer.link_bytes_per_s, now)
        return "pull"

    def undone(self, choice: str, pull: PrefixPull | None, now: float) -> None:
        """A placement `chosen` counted was undone (the request is placed again): as if it had not been made."""
        self.choices[choice] -= 1
        if pull is None:
            return
        source_id = pull.source.worker_id
        self.pulled_bytes[source_id] -= pull.pulled_bytes
        if pull.source.kv_transfer is not None:
            self.links.withdraw(source_id, pull.pulled_bytes, pull.source.kv_transfer.link_bytes_per_s, now)

    def _link_wait_s(self, facts: NodeFacts, now: float) -> float:
        link = facts.kv_transfer
        return self.links.seconds(facts.worker_id, link.link_bytes_per_s, now) if link is not None else 0.0


def merged_cached(cached: Mapping[str, int], pulls: Mapping[str, PrefixPull]) -> dict[str, int]:
    """Each node's leading cached blocks of the prompt, a runner's as the prefix it would pull."""
    merged = dict(cached)
    for worker_id, pull in pulls.items():
        merged[worker_id] = pull.blocks
    return merged
