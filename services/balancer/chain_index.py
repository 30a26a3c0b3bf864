"""Every routable node's chain state as columns, kept current by events (pure, no I/O).

`SnapshotBuilder.snapshot` builds a `ChainState` per node for every
decision, and a policy then scores each one in Python; at hundreds of
nodes that is nearly all of a decision's cost. `ChainIndex` keeps the same
figures as one row per node of the heartbeat list it was last given, and
refreshes a row only when something about it changed:

* a different heartbeat at that row, or a health verdict (every row):
  the node's facts are read again from the builder;
* a placement, undo, finish or heartbeat on the node (the builder marks it):
  its prefill backlog and finished count;
* a reservation, release or new global count on its chain (the
  `SlotTable` marks it): its used slots, and with them its load and
  whether it is free.

A decision then reads whole columns: policies with a `choose_indexed`
score every free chain with a few numpy operations and never look at a
busy one. Only what belongs to the request (its cached prefix blocks, the
workers it excludes) and what drifts with time (the prefill backlog) is
computed per decision.

Columns are computed with the same operations in the same order as the
scalar `ChainState` and `StepModel` code, so every figure equals the one a
snapshot would give and policies choose exactly as they would on it
(tests/unit/test_chain_index.py replays random event sequences against the
snapshot path to check that). Node facts are read from the builder at the
same moments as the snapshot path reads them (a node a request excludes is
not read until a request that does not exclude it), because facts take
the trackers' values of the moment they are first read.

A list with decode nodes (two-node chains are costed per request) or one
worker twice is not indexed: the router takes the snapshot path for it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

from contracts.messages import Heartbeat, RouteRequest
from services.balancer.slot_table import SlotTable
from services.balancer.snapshot import ChainState, NodeFacts, SnapshotBuilder, chain_id_of


class Unindexable(Exception):
    """The indexed figures cannot settle this decision (a NaN score): decide on a snapshot instead."""


class ChainIndex:
    def __init__(self, builder: SnapshotBuilder, table: SlotTable) -> None:
        self._builder = builder
        self._table = table
        self._heartbeats: list[Heartbeat] = []
        self._version = builder.version
        self._indexable = True
        self._row_of_worker: dict[str, int] = {}
        self._row_of_chain: dict[str, int] = {}
        self._facts: list[NodeFacts | None] = []
        # Rows whose facts must be read again before they can be chosen.
        self._stale: set[int] = set()
        # Rows whose node's backlog or finished count changed (or its facts, if the builder read them anew).
        self._touched: set[int] = set()
        # Rows whose chain's used slots changed.
        self._recount: set[int] = set()
        # Rows whose step time has a KV term (d != 0) or a per-request cost, whose health weight is
        # not 1, or with a prefill backlog: while there are none, scores skip those operations
        # (adding 0, dividing by 1).
        self._kv_rows: set[int] = set()
        self._overhead_rows: set[int] = set()
        self._weighted_rows: set[int] = set()
        self._backlog_rows: set[int] = set()
        self._allocate(0)

    def _allocate(self, rows: int) -> None:
        ints = lambda: np.zeros(rows, dtype=np.int64)  # noqa: E731
        floats = lambda: np.zeros(rows, dtype=np.float64)  # noqa: E731
        # A row can be chosen: a generating node whose facts are current and whose health is above 0.
        self.eligible = np.zeros(rows, dtype=bool)
        self.free = np.zeros(rows, dtype=bool)
        self.busy = np.zeros(rows, dtype=bool)  # present > 0
        self.slots_total, self.slots_used = ints(), ints()
        self.finished = ints()
        self.block_size, self.kv_tokens = ints(), ints()
        self.kv_usage, self.growth_penalty, self.speed = floats(), floats(), floats()
        self.health = np.ones(rows, dtype=np.float64)
        self.a, self.b, self.c, self.d, self.per_request = floats(), floats(), floats(), floats(), floats()
        self.drain_per_s, self.backlog_left, self.backlog_since = floats(), floats(), floats()
        # Kept per row from the above: requests on the node plus queue growth (`present`), that per unit
        # of health, and a decode step's cost at the batch a newcomer would join (`a + c * (present + 1)`).
        self.present, self.load, self.step_at_batch = floats(), floats(), floats()
        # Rows by chain id (ties by row): round-robin's order.
        self.chain_order = np.zeros(rows, dtype=np.int64)

    def sync(self, heartbeats: Sequence[Heartbeat]) -> bool:
        """Note what changed since the last call; False when this list cannot be indexed."""
        current = heartbeats if isinstance(heartbeats, list) else list(heartbeats)
        if current != self._heartbeats:
            self._take_list(current)
        if self._builder.version != self._version:
            self._version = self._builder.version
            self._stale.update(range(len(self._heartbeats)))
        for worker_id in self._builder.take_changed():
            row = self._row_of_worker.get(worker_id)
            if row is not None:
                self._touched.add(row)
        for chain_id in self._table.take_changed():
            row = self._row_of_chain.get(chain_id)
            if row is not None:
                self._recount.add(row)
        return self._indexable

    def _take_list(self, heartbeats: list[Heartbeat]) -> None:
        old = self._heartbeats
        if len(old) == len(heartbeats):
            moved = [i for i, (was, now) in enumerate(zip(old, heartbeats)) if was is not now]
            same_nodes = all(
                (old[i].registration.worker_id, old[i].registration.role) == (heartbeats[i].registration.worker_id, heartbeats[i].registration.role)
                for i in moved)
            if same_nodes:
                self._heartbeats = list(heartbeats)
                reordered = False
                for i in moved:
                    chain_id = chain_id_of(heartbeats[i])
                    if self._row_of_chain.get(chain_id) != i:
                        self._row_of_chain = {k: r for k, r in self._row_of_chain.items() if r != i}
                        self._row_of_chain[chain_id] = i
                        reordered = True
                    self._stale.add(i)
                    self.eligible[i] = self.free[i] = False
                if reordered:
                    self._order_chains()
                return
        self._heartbeats = list(heartbeats)
        self._allocate(len(heartbeats))
        self._facts = [None] * len(heartbeats)
        self._row_of_worker = {hb.registration.worker_id: i for i, hb in enumerate(heartbeats)}
        self._row_of_chain = {chain_id_of(hb): i for i, hb in enumerate(heartbeats)}
        self._indexable = (len(self._row_of_worker) == len(heartbeats)
                           and not any(hb.registration.role == "decode" for hb in heartbeats))
        self._stale = set(range(len(heartbeats)))
        self._kv_rows, self._overhead_rows, self._weighted_rows, self._backlog_rows = set(), set(), set(), set()
        self._touched = set()
        self._recount = set()
        self._order_chains()

    def _order_chains(self) -> None:
        ids = [chain_id_of(hb) for hb in self._heartbeats]
        self.chain_order = np.array(sorted(range(len(ids)), key=ids.__getitem__), dtype=np.int64)

    def decision(self, request: RouteRequest, cached_blocks: Mapping[str, int]) -> Decision:
        """The columns as `request` sees them now (call `sync` first)."""
        excluded = [self._row_of_worker[w] for w in request.exclude_workers if w in self._row_of_worker]
        counted: set[int] = set()
        if self._touched:
            for row in self._touched.difference(self._stale):
                facts = self._facts[row]
                if facts is not None and self._builder.cached_facts(facts.worker_id) is facts:
                    self._touch(row)
                    counted.add(row)
                else:
                    # The builder dropped or re-read the node's facts: read them as a stale row's.
                    self._stale.add(row)
            self._touched.clear()
        if self._stale:
            # A node the request excludes is not read now: the snapshot path would not read it either.
            for row in self._stale.difference(excluded):
                self._refresh(row)
            self._stale.intersection_update(excluded)
        if self._recount:
            for row in self._recount.difference(self._stale, counted):
                self._count(row)
            self._recount.clear()
        free = self.free
        if excluded:
            free = free.copy()
            free[excluded] = False
        cached: dict[int, int] = {}
        for worker_id, blocks in cached_blocks.items():
            row = self._row_of_worker.get(worker_id)
            if row is not None:
                cached[row] = blocks
        return Decision(self, free, cached, self._builder.clock())

    def _refresh(self, row: int) -> None:
        heartbeat = self._heartbeats[row]
        self._facts[row] = None
        if heartbeat.registration.role != "aggregated":
            self.eligible[row] = self.free[row] = False
            return
        facts = self._facts[row] = self._builder.facts(heartbeat)
        model = facts.model
        self.slots_total[row] = facts.slots_total
        self.block_size[row] = facts.block_size
        self.kv_tokens[row] = facts.kv_blocks_used * facts.block_size
        self.kv_usage[row] = facts.kv_blocks_used / facts.kv_blocks_total if facts.kv_blocks_total else 0.0
        self.growth_penalty[row] = facts.growth_penalty
        # A node out of routing keeps a weight of 1 here: it is never chosen, and scores divide by it.
        self.health[row] = facts.health_weight if facts.health_weight > 0 else 1.0
        self.speed[row] = facts.speed
        self.a[row], self.b[row], self.c[row], self.d[row], self.per_request[row] = model.a, model.b, model.c, model.d, model.per_request
        _mark(self._kv_rows, row, model.d != 0)
        _mark(self._overhead_rows, row, model.per_request != 0)
        _mark(self._weighted_rows, row, self.health[row] != 1.0)
        if model.b > 0:
            self.drain_per_s[row] = 1.0 / model.b
            self.backlog_left[row], self.backlog_since[row] = self._builder.backlog_state(facts.worker_id)
        else:
            # A node that prefills for free drains any backlog at once.
            self.drain_per_s[row] = self.backlog_left[row] = self.backlog_since[row] = 0.0
        _mark(self._backlog_rows, row, self.backlog_left[row] != 0)
        self.finished[row] = self._builder.finished_since_heartbeat(facts.worker_id)
        self.eligible[row] = facts.health_weight > 0
        self._count(row)

    def _touch(self, row: int) -> None:
        """The node's backlog or finished count changed (its facts did not)."""
        facts = self._facts[row]
        assert facts is not None
        if facts.model.b > 0:
            self.backlog_left[row], self.backlog_since[row] = self._builder.backlog_state(facts.worker_id)
            _mark(self._backlog_rows, row, self.backlog_left[row] != 0)
        self.finished[row] = self._builder.finished_since_heartbeat(facts.worker_id)
        self._count(row)

    def _count(self, row: int) -> None:
        """Bring the row's used slots, and what follows from them, up to date."""
        facts = self._facts[row]
        if facts is None:
            return
        used = self._table.used(facts.chain_id)
        self.slots_used[row] = used
        in_flight = max(used, facts.running + facts.waiting - int(self.finished[row]))
        present = in_flight + facts.growth_penalty
        self.present[row] = present
        self.load[row] = present / facts.health_weight if facts.health_weight > 0 else float("inf")
        self.step_at_batch[row] = facts.model.a + facts.model.c * (present + 1)
        self.busy[row] = present > 0
        self.free[row] = bool(self.eligible[row]) and facts.slots_total - used > 0

    def backlog_s(self, now: float) -> np.ndarray:
        """Each row's prefill backlog in seconds at `now` (as `SnapshotBuilder.backlog_s`)."""
        # fmax(x, 0.0) is Python's max(0.0, x), NaN included; drain rates are finite, so a row
        # with no backlog drains from 0 and stays at 0, as `PrefillBacklog.tokens` returns.
        elapsed = np.fmax(now - self.backlog_since, 0.0)
        return np.fmax(self.backlog_left - self.drain_per_s * elapsed, 0.0) * self.b

    def has_backlog(self) -> bool:
        return bool(self._backlog_rows)

    def has_overhead(self) -> bool:
        """Whether some node's step time has a per-request cost."""
        return bool(self._overhead_rows)

    def has_kv_term(self) -> bool:
        """Whether some node's step time grows with the KV it holds (d != 0)."""
        return bool(self._kv_rows)

    def has_weights(self) -> bool:
        """Whether some node's health weight is below 1."""
        return bool(self._weighted_rows)

    def state(self, row: int, cached_blocks: int, now: float) -> ChainState:
        facts = self._facts[row]
        assert facts is not None
        return self._builder.state(facts, int(self.slots_used[row]), cached_blocks, now)


def _mark(rows: set[int], row: int, flagged: bool) -> None:
    if flagged:
        rows.add(row)
    else:
        rows.discard(row)


class Decision:
    """One request's view of the index: the chains free for it and the per-request columns."""

    def __init__(self, index: ChainIndex, free: np.ndarray, cached: dict[int, int], now: float) -> None:
        self.index = index
        self.free = free
        self.free_rows = free.nonzero()[0]
        self.cached = cached  # row -> leading prompt blocks cached there
        self.now = now

    def backlog_s(self) -> np.ndarray | None:
        """Each row's prefill backlog in seconds now; None when no node has any."""
        return self.index.backlog_s(self.now) if self.index.has_backlog() else None

    def uncached_tokens(self, prompt_tokens: int) -> dict[int, int]:
        """The prompt tokens not cached on each row that caches some (as `ChainState.uncached_tokens`); the rest cache none."""
        block_size = self.index.block_size
        return {row: max(0, prompt_tokens - blocks * block_size.item(row)) for row, blocks in self.cached.items()}

    def lowest(self, *keys: np.ndarray) -> list[int]:
        """Free rows with the smallest key, compared as tuples (`keys[0]` first), in row order."""
        rows = self.free_rows
        for key in keys:
            values = key[rows]
            # argmin stops at the first NaN, as min returns NaN when there is one; and it is the cheaper call.
            lowest = values[values.argmin()]
            if lowest != lowest:
                raise Unindexable("a NaN score")
            rows = rows[values == lowest]
            if len(rows) == 1:
                break
        return rows.tolist()

    def state(self, row: int) -> ChainState:
        return self.index.state(row, self.cached.get(row, 0), self.now)
