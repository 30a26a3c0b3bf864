"""Fair share between tenants in the central queue (pure): virtual token counters, as VTC does.

Sheng et al., "Fairness in Serving Large Language Models" (OSDI 2024), serve
the waiting request of the tenant that has been served least: each tenant has
a counter of the tokens it was served, prompt and output tokens each at their
cost, divided by its weight. Within a priority class the central queue hands
a freed slot to the oldest request of the tenant with the lowest counter.

* **Charged as placed, settled as finished.** A placement charges the prompt
  and the output the request is expected to give (the fleet's mean output so
  far, at most its `max_tokens`); its end settles the difference with the
  output it gave. Charging output only at the end would let a tenant whose
  requests are all running look unserved and take every slot that frees
  meanwhile.
* **No banked credit.** A tenant that has nothing waiting is lifted, when its
  next request comes, to the lowest counter of the tenants that do (or, with
  none waiting, of those running; with nothing active at all, the highest):
  being idle earns no priority later, as VTC's counter lift.
* **Bound.** Among tenants that keep requests waiting, the one served next is
  always the one with the lowest counter, so any two counters differ by at
  most one request's charge (`tests/unit/test_fair_share.py` checks it).
* **Shared.** A tenant's counter is its service (the sum of its charges) plus
  its lift. With several balancer replicas the charges go to Redis in the
  slot reservation and release scripts and the lifts with them; every replica
  reads back the sums (`SharedCounters`) as it reads the slot counts, so the
  replicas order their queues on the same counters. Lifts merge by maximum,
  so two replicas lifting one tenant at once lift it once.
"""

from __future__ import annotations

import heapq
from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence

from msgspec import Struct

from contracts.messages import RouteRequest

# How fast the mean output follows the newest requests' (an exponential moving average's weight).
_OUTPUT_SMOOTHING = 0.05


class TenantCharge(Struct, frozen=True, gc=False):
    """What one placement adds to its tenant's counter: `service` (weighted tokens), and the tenant's lift
    (an offset that only grows; the counter is service plus lift)."""

    tenant: str
    service: float
    lift: float


class SharedCounters(Struct, frozen=True, gc=False):
    """Every replica's charges as the store holds them: each tenant's service and lift."""

    service: Mapping[str, float]
    lift: Mapping[str, float]


class TenantShares:
    """Each tenant's virtual counter, and the order the queue serves tenants in."""

    def __init__(self, prompt_cost: float = 1.0, output_cost: float = 2.0) -> None:
        self._prompt_cost = prompt_cost
        self._output_cost = output_cost
        self._service: dict[str, float] = defaultdict(float)
        self._lift: dict[str, float] = defaultdict(float)
        # Placed and not yet finished: request id -> (tenant, output tokens charged, output cost per token).
        self._running: dict[str, tuple[str, float, float]] = {}
        self._running_per_tenant: dict[str, int] = defaultdict(int)
        self._mean_output: float | None = None

    def counter(self, tenant: str) -> float:
        return self._service.get(tenant, 0.0) + self._lift.get(tenant, 0.0)

    def counters(self) -> dict[str, float]:
        return {tenant: self.counter(tenant) for tenant in self._service.keys() | self._lift.keys()}

    # --- events ------------------------------------------------------------------------------

    def arrived(self, tenant: str, waiting: Mapping[str, int]) -> None:
        """A request of `tenant` arrives while `waiting` (tenant -> requests queued) wait: lift the tenant if it has
        none waiting (the lift reaches a shared store with the tenant's next charge)."""
        if waiting.get(tenant):
            return
        others = [self.counter(t) for t, count in waiting.items() if count]
        if not others:
            others = [self.counter(t) for t, count in self._running_per_tenant.items() if count and t != tenant]
        if others:
            floor = min(others)
        else:
            # Nothing is active: everyone starts level, at the top, so no idle tenant is owed anything.
            floor = max(self.counters().values(), default=0.0)
        lifted = floor - self.counter(tenant)
        if lifted > 0.0:
            self._lift[tenant] += lifted

    def charge_of(self, request: RouteRequest) -> float:
        """The request's expected cost to its tenant, in weighted tokens."""
        output = self._expected_output(request)
        return (self._prompt_cost * request.prompt_tokens + self._output_cost * output) / _weight(request)

    def placed(self, request: RouteRequest) -> TenantCharge | None:
        """The request took a slot: charge its tenant; None when it was charged already (it routes again)."""
        request_id, tenant = request.request_id, request.tenant
        if request_id in self._running:
            return None
        service = self.charge_of(request)
        self._running[request_id] = (tenant, self._expected_output(request), self._output_cost / _weight(request))
        self._running_per_tenant[tenant] += 1
        self._add(tenant, service)
        return TenantCharge(tenant, service, self._lift.get(tenant, 0.0))

    def finished(self, request_id: str, output_tokens: int) -> TenantCharge | None:
        """The request ended having given `output_tokens`: settle its charge (None: it was not charged here)."""
        running = self._drop(request_id)
        if running is None:
            return None
        tenant, charged, per_token = running
        self._mean_output = (float(output_tokens) if self._mean_output is None
                             else self._mean_output + _OUTPUT_SMOOTHING * (output_tokens - self._mean_output))
        correction = (output_tokens - charged) * per_token
        self._add(tenant, correction)
        return TenantCharge(tenant, correction, self._lift.get(tenant, 0.0))

    def released(self, request_id: str) -> None:
        """The request's slot was freed without an end it reported (withdrawn, expired, its node gone): it keeps
        its charge."""
        self._drop(request_id)

    def read(self, shared: SharedCounters) -> None:
        """The store's counters, every replica's charges in them: they replace what this replica knew (a charge of
        its own the store had not yet applied is missing until the next read, a tick later)."""
        self._service.update(shared.service)
        for tenant, lift in shared.lift.items():
            if lift > self._lift.get(tenant, 0.0):
                self._lift[tenant] = lift

    def forget_idle(self, waiting: Mapping[str, int]) -> None:
        """Drop the counters of tenants with nothing waiting or running that are at or below every active one's:
        their next request lifts them to at least that anyway."""
        active = [self.counter(t) for t in self._active(waiting)]
        if not active:
            return
        floor = min(active)
        for tenant in [t for t in self.counters() if self.counter(t) <= floor and t not in self._active(waiting)]:
            self._service.pop(tenant, None)
            self._lift.pop(tenant, None)

    # --- order -------------------------------------------------------------------------------

    def order(self, entries: Sequence[RouteRequest]) -> list[int]:
        """The order (indexes into `entries`, oldest first per tenant) that serves the tenant with the lowest counter
        first, counting each request's expected charge as it is served."""
        fifo: dict[str, list[int]] = defaultdict(list)
        for index, request in enumerate(entries):
            fifo[request.tenant].append(index)
        if len(fifo) < 2:
            return list(range(len(entries)))
        heap = [(self.counter(tenant), indexes[0], tenant) for tenant, indexes in fifo.items()]
        heapq.heapify(heap)
        heads = dict.fromkeys(fifo, 0)
        ordered: list[int] = []
        while heap:
            counter, index, tenant = heapq.heappop(heap)
            ordered.append(index)
            heads[tenant] += 1
            indexes = fifo[tenant]
            if heads[tenant] < len(indexes):
                # Ties go to the older request, whoever's it is.
                heapq.heappush(heap, (counter + self.charge_of(entries[index]), indexes[heads[tenant]], tenant))
        return ordered

    # --- helpers -----------------------------------------------------------------------------

    def _expected_output(self, request: RouteRequest) -> float:
        if self._mean_output is None:
            return float(request.max_tokens)
        return min(float(request.max_tokens), self._mean_output)

    def _add(self, tenant: str, service: float) -> None:
        self._service[tenant] += service

    def _drop(self, request_id: str) -> tuple[str, float, float] | None:
        running = self._running.pop(request_id, None)
        if running is not None:
            tenant = running[0]
            self._running_per_tenant[tenant] -= 1
            if not self._running_per_tenant[tenant]:
                del self._running_per_tenant[tenant]
        return running

    def _active(self, waiting: Mapping[str, int]) -> Iterable[str]:
        return {t for t, count in waiting.items() if count} | set(self._running_per_tenant)


def _weight(request: RouteRequest) -> float:
    return request.tenant_weight if request.tenant_weight > 0.0 else 1.0
