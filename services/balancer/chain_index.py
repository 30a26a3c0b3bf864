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

A decision then reads whole columns: every policy's `choose_indexed`
scores every free chain in one compiled call (numba; a loop over the rows,
where numpy would take some twenty calls over them, each a microsecond or
two at 256 nodes) and never looks at a busy one. Only what belongs to the
request (its cached prefix blocks, the workers it excludes) and what
drifts with time (the prefill backlog) is computed per decision. The
kernels are compiled when this module is imported, not at the first
request.

Columns are computed with the same operations in the same order as the
scalar `ChainState` and `StepModel` code, so every figure equals the one a
snapshot would give and policies choose exactly as they would on it
(tests/unit/test_chain_index.py replays random event sequences against the
snapshot path to check that). Node facts are read from the builder at the
same moments as the snapshot path reads them (a node a request excludes is
not read until a request that does not exclude it), because facts take
the trackers' values of the moment they are first read.

A list with decode nodes (two-node chains are costed per request) or one
worker twice is not indexed (`sync` says so): the router takes the snapshot
path for it. So does a decision whose figures hold a NaN (`Decision.settled`),
where `min` over the chains' keys, which the snapshot path takes, is not
defined by value alone.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Mapping, Sequence

import msgspec
import numba
import numpy as np

from contracts.messages import Heartbeat, RouteRequest
from services.balancer.slot_table import SlotTable
from services.balancer.snapshot import ChainState, NodeFacts, SnapshotBuilder, chain_id_of


# The columns of each block, in block row order; the kernels below read them by position.
FLOAT_COLUMNS = ("a", "b", "c", "d", "per_request", "step_at_batch", "present", "health", "drain_per_s", "backlog_left",
                 "backlog_since", "load", "speed", "kv_usage", "growth_penalty", "utilisation", "adapter_s",
                 "pull_s")
INT_COLUMNS = ("block_size", "kv_tokens", "request_blocks", "slots_total", "slots_used", "finished", "in_flight", "heard",
               "waiting", "kv_blocks_used", "kv_blocks_total")
BOOL_COLUMNS = ("busy", "eligible", "free")
_A, _B, _C, _D, _PER_REQUEST, _STEP_AT_BATCH, _PRESENT, _HEALTH, _DRAIN_PER_S, _BACKLOG_LEFT, _BACKLOG_SINCE = map(
    FLOAT_COLUMNS.index, ("a", "b", "c", "d", "per_request", "step_at_batch", "present", "health", "drain_per_s", "backlog_left",
                          "backlog_since"))
_GROWTH_PENALTY, _UTILISATION, _ADAPTER_S, _PULL_S = map(FLOAT_COLUMNS.index, ("growth_penalty", "utilisation", "adapter_s", "pull_s"))
_BLOCK_SIZE, _KV_TOKENS, _REQUEST_BLOCKS, _SLOTS_TOTAL, _SLOTS_USED = map(
    INT_COLUMNS.index, ("block_size", "kv_tokens", "request_blocks", "slots_total", "slots_used"))
_IN_FLIGHT, _HEARD, _WAITING, _KV_BLOCKS_USED, _KV_BLOCKS_TOTAL = map(
    INT_COLUMNS.index, ("in_flight", "heard", "waiting", "kv_blocks_used", "kv_blocks_total"))
_BUSY = BOOL_COLUMNS.index("busy")


class ChainIndex:
    # Views of the column blocks (`_allocate`), one value per row.
    a: np.ndarray
    b: np.ndarray
    c: np.ndarray
    d: np.ndarray
    per_request: np.ndarray
    step_at_batch: np.ndarray
    present: np.ndarray
    health: np.ndarray
    drain_per_s: np.ndarray
    backlog_left: np.ndarray
    backlog_since: np.ndarray
    load: np.ndarray
    speed: np.ndarray
    kv_usage: np.ndarray
    growth_penalty: np.ndarray
    utilisation: np.ndarray  # `ChainState.utilisation`
    # Seconds the last decision's request would spend loading its LoRA adapter on each row (`ChainState.adapter_load_s`).
    adapter_s: np.ndarray
    # Seconds until a prefix pulled for the last decision's request is on each row (`ChainState.pull_s`).
    pull_s: np.ndarray
    block_size: np.ndarray
    kv_tokens: np.ndarray
    # The leading blocks of the last decision's request cached on each row (a column, not a
    # Python dict, so that the request-cost kernel reads it with the others).
    request_blocks: np.ndarray
    slots_total: np.ndarray
    slots_used: np.ndarray
    finished: np.ndarray
    in_flight: np.ndarray  # `ChainState.in_flight`
    heard: np.ndarray  # running + waiting in the last heartbeat
    waiting: np.ndarray
    kv_blocks_used: np.ndarray
    kv_blocks_total: np.ndarray
    busy: np.ndarray
    eligible: np.ndarray
    free: np.ndarray

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
        self._decisions = 0  # a `Decision` reads `request_blocks` only while it is the last one made
        self._allocate(0)

    def _allocate(self, rows: int) -> None:
        # One block per dtype, each column a view of one of its rows: the request-cost kernel takes
        # three arguments instead of twenty (a compiled call's cost grows with its array arguments).
        self._floats = np.zeros((len(FLOAT_COLUMNS), rows), dtype=np.float64)
        self._ints = np.zeros((len(INT_COLUMNS), rows), dtype=np.int64)
        self._bools = np.zeros((len(BOOL_COLUMNS), rows), dtype=bool)
        for block, names in ((self._floats, FLOAT_COLUMNS), (self._ints, INT_COLUMNS), (self._bools, BOOL_COLUMNS)):
            for i, name in enumerate(names):
                setattr(self, name, block[i])
        # A row can be chosen (`eligible`): a generating node whose facts are current and whose health is above 0.
        # `busy`: present > 0. Kept per row from the facts: requests on the node plus queue growth
        # (`present`), that per unit of health (`load`), and a decode step's cost at the batch a
        # newcomer would join (`step_at_batch`, `a + c * (present + 1)`).
        self.health[:] = 1.0
        # Rows by chain id (ties by row): round-robin's order.
        self.chain_order = np.zeros(rows, dtype=np.int64)
        # What the request-cost kernel writes: every row's cost, and the free rows tied at the lowest.
        self._seconds = np.zeros(rows, dtype=np.float64)
        self._tied = np.zeros(rows, dtype=np.int64)
        self._extent = np.zeros(2, dtype=np.float64)
        self._request_rows: list[int] = []  # rows of `request_blocks` that are not 0
        self._adapter_rows: list[int] = []  # rows of `adapter_s` that are not 0
        self._pull_rows: list[int] = []  # rows of `pull_s` that are not 0

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
        self._touched = set()
        self._recount = set()
        self._order_chains()

    def _order_chains(self) -> None:
        ids = [chain_id_of(hb) for hb in self._heartbeats]
        self.chain_order = np.array(sorted(range(len(ids)), key=ids.__getitem__), dtype=np.int64)

    def decision(self, request: RouteRequest, cached_blocks: Mapping[str, int],
                 adapter_s: Mapping[str, float | None] | None = None, pull_s: Mapping[str, float] | None = None) -> Decision:
        """The columns as `request` sees them now (call `sync` first). `adapter_s`: for a request with a LoRA
        adapter, the seconds its load takes on each node, None where the node cannot run it now; `pull_s`: the
        seconds until a prefix pulled for it is on a node (`cached_blocks` counting that prefix there)."""
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
        free, eligible = self.free, self.eligible
        # Rows the request's adapter cannot run on now are read as any other (as the snapshot path reads them), not offered.
        unfit = [] if adapter_s is None else [row for worker_id, row in self._row_of_worker.items() if adapter_s.get(worker_id) is None]
        if excluded or unfit:
            free, eligible = free.copy(), eligible.copy()
            free[excluded] = eligible[excluded] = False
            free[unfit] = eligible[unfit] = False
        request_blocks = self.request_blocks
        for row in self._request_rows:
            request_blocks[row] = 0
        cached: dict[int, int] = {}
        for worker_id, blocks in cached_blocks.items():
            row = self._row_of_worker.get(worker_id)
            if row is not None:
                cached[row] = request_blocks[row] = blocks
        self._request_rows = list(cached)
        self._adapter_rows = self._set_seconds(self.adapter_s, self._adapter_rows, adapter_s)
        self._pull_rows = self._set_seconds(self.pull_s, self._pull_rows, pull_s)
        self._decisions += 1
        return Decision(self, free, eligible, cached, self._builder.clock())

    def _set_seconds(self, column: np.ndarray, rows: list[int], seconds_of: Mapping[str, float | None] | None) -> list[int]:
        """Zero the request column's `rows` (the last decision's), then set it from `seconds_of` (worker id -> seconds);
        the rows now not 0."""
        for row in rows:
            column[row] = 0.0
        set_rows: list[int] = []
        if seconds_of:
            for worker_id, seconds in seconds_of.items():
                row = self._row_of_worker.get(worker_id)
                if row is not None and seconds:
                    column[row] = seconds
                    set_rows.append(row)
        return set_rows

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
        self.kv_blocks_used[row], self.kv_blocks_total[row] = facts.kv_blocks_used, facts.kv_blocks_total
        self.heard[row], self.waiting[row] = facts.running + facts.waiting, facts.waiting
        self.growth_penalty[row] = facts.growth_penalty
        # A node out of routing keeps a weight of 1 here: it is never chosen, and scores divide by it.
        self.health[row] = facts.health_weight if facts.health_weight > 0 else 1.0
        self.speed[row] = facts.speed
        self.a[row], self.b[row], self.c[row], self.d[row], self.per_request[row] = model.a, model.b, model.c, model.d, model.per_request
        if model.b > 0:
            self.drain_per_s[row] = 1.0 / model.b
            self.backlog_left[row], self.backlog_since[row] = self._builder.backlog_state(facts.worker_id)
        else:
            # A node that prefills for free drains any backlog at once.
            self.drain_per_s[row] = self.backlog_left[row] = self.backlog_since[row] = 0.0
        self.finished[row] = self._builder.finished_since_heartbeat(facts.worker_id)
        self.eligible[row] = facts.health_weight > 0
        self._count(row)

    def _touch(self, row: int) -> None:
        """The node's backlog or finished count changed (its facts did not)."""
        facts = self._facts[row]
        assert facts is not None
        if facts.model.b > 0:
            self.backlog_left[row], self.backlog_since[row] = self._builder.backlog_state(facts.worker_id)
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
        self.in_flight[row] = in_flight
        self.present[row] = present
        self.load[row] = present / facts.health_weight if facts.health_weight > 0 else float("inf")
        self.step_at_batch[row] = facts.model.a + facts.model.c * (present + 1)
        self.busy[row] = present > 0
        self.free[row] = bool(self.eligible[row]) and facts.slots_total - used > 0
        # As `ChainState.utilisation` computes it, so that it is the same float.
        if facts.gpu_utilization is not None:
            self.utilisation[row] = facts.gpu_utilization
        else:
            kv_usage = facts.kv_blocks_used / facts.kv_blocks_total if facts.kv_blocks_total else 0.0
            self.utilisation[row] = max(kv_usage, used / facts.slots_total if facts.slots_total else 1.0)

    def state(self, row: int, cached_blocks: int, now: float) -> ChainState:
        facts = self._facts[row]
        assert facts is not None
        state = self._builder.state(facts, int(self.slots_used[row]), cached_blocks, now)
        adapter_s, pull_s = self.adapter_s[row], self.pull_s[row]
        if adapter_s or pull_s:
            return msgspec.structs.replace(state, adapter_load_s=float(adapter_s), pull_s=float(pull_s))
        return state


class Decision:
    """One request's view of the index: the chains free for it and the per-request columns."""

    def __init__(self, index: ChainIndex, free: np.ndarray, eligible: np.ndarray, cached: dict[int, int], now: float) -> None:
        self.index = index
        self.free = free
        self.eligible = eligible  # the rows the request may take, free or not
        self.cached = cached  # row -> leading prompt blocks cached there
        self.now = now
        # False once a figure a policy asked for was NaN: the decision is then left to a snapshot (`Router.place`).
        self.settled = True
        self._serial = index._decisions

    @functools.cached_property
    def free_rows(self) -> np.ndarray:
        return self.free.nonzero()[0]

    def limit_backlog(self, bound_s: float, prompt_tokens: int) -> None:
        """Leave out the free rows where the first token comes more than `bound_s` seconds later than by waiting.

        A row's first token comes after its prefill backlog and the request's
        own uncached prefill there (`ChainState.first_token_wait_s`). Waiting
        for a slot elsewhere ends in a prefill of the whole prompt, at best at
        the fastest prefill rate of the rows it may take: a slow node's own
        slow prefill of the prompt earns it no allowance for backlog, but the
        prefill its cached prefix saves does. On a fleet of one kind this is
        the backlog less what the row's cache saves.
        """
        index = self.index
        # One compiled call, not the ten numpy calls (each a microsecond or two) the same columns would take.
        within = np.empty_like(self.free)
        _within_backlog(index._floats, index._ints, self.eligible, self.free, self.now, float(bound_s), prompt_tokens, within)
        self.free = within
        self.__dict__.pop("free_rows", None)

    def prefer(self, rows: np.ndarray) -> None:
        """Offer only the free rows that `rows` (a mask) marks, when it marks any; else leave the free rows as they are."""
        preferred = self.free & rows
        if preferred.any():
            self.free = preferred
            self.__dict__.pop("free_rows", None)

    def request_seconds(self, prompt_tokens: int, output_tokens: int, imposed_weight: float) -> np.ndarray:
        """Every row's `JffcPerRequest.expected_seconds` for a request of this size (a new array)."""
        self._cost(prompt_tokens, output_tokens, imposed_weight)
        return self.index._seconds.copy()

    def cheapest(self, prompt_tokens: int, output_tokens: int, imposed_weight: float) -> list[int]:
        """The free rows of least `request_seconds`, in row order; empty when none is free or one is NaN (`settled`)."""
        return self._tied(self._cost(prompt_tokens, output_tokens, imposed_weight))

    def _cost(self, prompt_tokens: int, output_tokens: int, imposed_weight: float) -> int:
        index = self._current()
        return _request_seconds(index._floats, index._ints, index._bools, self.free, prompt_tokens, output_tokens,
                                self.now, float(imposed_weight), index._seconds, index._tied)

    def least_kv_cost(self, prompt_tokens: int, output_tokens: int, overlap_weight: float) -> list[int]:
        """The free rows of least `KvCost.cost`, in row order; empty when none is free or one is NaN (`settled`)."""
        index = self._current()
        return self._tied(_kv_cost(index._floats, index._ints, self.free, prompt_tokens, output_tokens, float(overlap_weight),
                                   index._seconds, index._tied))

    def best_scored(self, prompt_tokens: int, output_tokens: int, request_blocks: int, load_weight: float,
                    cache_weight: float, fit_weight: float) -> list[int]:
        """The free rows of highest `ScoreBased.score`, in row order; empty when none is free or one is NaN (`settled`)."""
        index = self._current()
        return self._tied(_negated_score(index._floats, index._ints, self.free, prompt_tokens, output_tokens, request_blocks,
                                         float(load_weight), float(cache_weight), float(fit_weight), index._seconds, index._tied))

    def load_extent(self) -> tuple[float, float] | None:
        """(least, most) load of the rows the request may take, as `min` and `max` over them; None when a load is NaN (`settled`)."""
        extent = self.index._extent
        if not _extent(self.index.load, self.eligible, extent):
            self.settled = False
            return None
        return extent.item(0), extent.item(1)

    def _current(self) -> ChainIndex:
        index = self.index
        if self._serial != index._decisions:
            raise RuntimeError("this decision's request columns belong to a later decision now")
        return index

    def _tied(self, count: int) -> list[int]:
        """The rows a kernel wrote to `_tied`; a negative count (a NaN) unsettles the decision."""
        if count < 0:
            self.settled = False
            return []
        return [self.index._tied.item(0)] if count == 1 else self.index._tied[:count].tolist()

    def least(self, *columns: str) -> list[int]:
        """Free rows with the smallest values of these float columns, compared as tuples, in row order.

        A name with a leading "-" compares that column's negation (largest first). A NaN
        on a row still in the running unsettles the decision (`settled`) and gives no rows.
        """
        keys = _KEYS.get(columns)
        if keys is None:
            unknown = [c for c in columns if c.removeprefix("-") not in FLOAT_COLUMNS]
            if unknown or not columns:
                raise ValueError(f"not float columns of the chain index: {unknown or columns}")
            keys = _KEYS[columns] = (np.array([FLOAT_COLUMNS.index(c.removeprefix("-")) for c in columns], dtype=np.int64),
                                     np.array([c.startswith("-") for c in columns], dtype=bool))
        index = self.index
        return self._tied(_least(index._floats, self.free, keys[0], keys[1], index._tied))

    def state(self, row: int) -> ChainState:
        return self.index.state(row, self.cached.get(row, 0), self.now)


def _compiled(signature: str) -> Callable[[Callable[..., int]], Callable[..., int]]:
    """Compiles the function now, at import (a signature makes it eager), from the on-disk cache when it is there."""
    def compile_(function: Callable[..., int]) -> Callable[..., int]:
        try:
            return numba.njit(signature, cache=True, nogil=True)(function)
        except RuntimeError:
            # No writable cache directory (a read-only install without NUMBA_CACHE_DIR): compile without caching.
            return numba.njit(signature, nogil=True)(function)
    return compile_


@_compiled("int64(float64[:, ::1], int64[:, ::1], boolean[:, ::1], boolean[::1], int64, int64, float64, float64, float64[::1], int64[::1])")
def _request_seconds(floats: np.ndarray, ints: np.ndarray, bools: np.ndarray, free: np.ndarray, prompt: int, output: int,
                     now: float, imposed_weight: float, seconds: np.ndarray, tied: np.ndarray) -> int:
    """Writes each row's `JffcPerRequest.expected_seconds` to `seconds` and the free rows tied at the least to `tied`.

    Returns how many are tied (0: no row is free; -1: a free row's figure is NaN). The
    operations are the scalar code's (`StepModel.request_seconds` at factor 1, the prefill
    backlog, `StepModel.imposed_seconds`), in its order, so every figure equals the one it
    gives: a term that is 0 on a row (no KV term, no per-request cost, no backlog, weight 1)
    adds 0 or divides by 1 there, which leaves the figure as it is.
    """
    rows = seconds.shape[0]
    a, b, c, d = floats[_A], floats[_B], floats[_C], floats[_D]
    per_request, step_at_batch, present, health = floats[_PER_REQUEST], floats[_STEP_AT_BATCH], floats[_PRESENT], floats[_HEALTH]
    drain_per_s, backlog_left, backlog_since = floats[_DRAIN_PER_S], floats[_BACKLOG_LEFT], floats[_BACKLOG_SINCE]
    adapter_s, pull_s = floats[_ADAPTER_S], floats[_PULL_S]
    block_size, kv_tokens, request_blocks, busy = ints[_BLOCK_SIZE], ints[_KV_TOKENS], ints[_REQUEST_BLOCKS], bools[_BUSY]
    context = prompt + output / 2  # the request's own, on average
    lowest = np.inf
    count = 0
    for row in range(rows):
        uncached = max(0, prompt - request_blocks[row] * block_size[row])  # ChainState.uncached_tokens
        prefill_cost = b[row] * uncached
        prefill = a[row] + prefill_cost if uncached > 0 else 0.0
        decode = output * (step_at_batch[row] + d[row] * ((kv_tokens[row] + prompt) + output / 2))
        cost = (per_request[row] + prefill) + decode
        # The backlog as `PrefillBacklog.tokens` drains it (max(0.0, x), NaN included), in seconds.
        elapsed = now - backlog_since[row]
        elapsed = elapsed if elapsed > 0.0 else 0.0
        left = backlog_left[row] - drain_per_s[row] * elapsed
        cost = (left if left > 0.0 else 0.0) * b[row] + cost
        if imposed_weight != 0.0 and busy[row]:
            per_decode_step = c[row] + d[row] * context
            cost = cost + imposed_weight * (present[row] * (prefill_cost + per_decode_step * output / 2))
        cost = (cost + adapter_s[row] + pull_s[row]) / health[row]
        seconds[row] = cost
        if not free[row]:
            continue
        if cost != cost:
            return -1
        if cost < lowest or count == 0:
            lowest = cost
            tied[0] = row
            count = 1
        elif cost == lowest:
            tied[count] = row
            count += 1
    return count


@_compiled("int64(float64[:, ::1], boolean[::1], int64[::1], boolean[::1], int64[::1])")
def _least(floats: np.ndarray, free: np.ndarray, keys: np.ndarray, negated: np.ndarray, tied: np.ndarray) -> int:
    """`Decision.least` on the float columns `keys` (negated where `negated`): writes the rows to `tied`, returns how many.

    -1 when a key is NaN on a row still in the running; the first key is compared even on a
    single free row, a later one only while rows are tied.
    """
    count = 0
    for row in range(free.shape[0]):
        if free[row]:
            tied[count] = row
            count += 1
    if count == 0:
        return 0
    for k in range(keys.shape[0]):
        column, negate = floats[keys[k]], negated[k]
        lowest = np.inf
        for i in range(count):
            value = -column[tied[i]] if negate else column[tied[i]]
            if value != value:
                return -1
            if value < lowest or i == 0:
                lowest = value
        kept = 0
        for i in range(count):
            value = -column[tied[i]] if negate else column[tied[i]]
            if value == lowest:
                tied[kept] = tied[i]
                kept += 1
        count = kept
        if count == 1:
            break
    return count



@_compiled("int64(float64[:, ::1], int64[:, ::1], boolean[::1], int64, int64, float64, float64[::1], int64[::1])")
def _kv_cost(floats: np.ndarray, ints: np.ndarray, free: np.ndarray, prompt: int, output: int, overlap_weight: float,
             costs: np.ndarray, tied: np.ndarray) -> int:
    """Writes each free row's `KvCost.cost` to `costs` and the free rows tied at the least to `tied`; returns how many.

    0: no row is free; -1: a free row's cost is NaN. The scalar code's operations in its order.
    """
    health = floats[_HEALTH]
    block_size, request_blocks, in_flight, heard, kv_blocks_used = (
        ints[_BLOCK_SIZE], ints[_REQUEST_BLOCKS], ints[_IN_FLIGHT], ints[_HEARD], ints[_KV_BLOCKS_USED])
    lowest = np.inf
    count = 0
    for row in range(free.shape[0]):
        if not free[row]:
            continue
        size = block_size[row]
        prompt_blocks = math.ceil(prompt / size)
        new_blocks = math.ceil((prompt + output) / size)
        prefill_blocks = max(0, prompt_blocks - request_blocks[row])
        unseen = max(0, in_flight[row] - heard[row])  # reservations the last heartbeat does not show yet
        decode_blocks = kv_blocks_used[row] + (unseen + 1) * new_blocks
        cost = (overlap_weight * prefill_blocks + decode_blocks) / health[row]
        costs[row] = cost
        if cost != cost:
            return -1
        if cost < lowest or count == 0:
            lowest = cost
            tied[0] = row
            count = 1
        elif cost == lowest:
            tied[count] = row
            count += 1
    return count


@_compiled("int64(float64[:, ::1], int64[:, ::1], boolean[::1], int64, int64, int64, float64, float64, float64, float64[::1], int64[::1])")
def _negated_score(floats: np.ndarray, ints: np.ndarray, free: np.ndarray, prompt: int, output: int, request_blocks: int,
                   load_weight: float, cache_weight: float, fit_weight: float, keys: np.ndarray, tied: np.ndarray) -> int:
    """Writes each free row's `-ScoreBased.score` to `keys` and the free rows tied at the least to `tied`; returns how many.

    0: no row is free; -1: a free row's score is NaN. The scalar code's operations in its order.
    """
    health, utilisation, growth_penalty = floats[_HEALTH], floats[_UTILISATION], floats[_GROWTH_PENALTY]
    block_size, cached, waiting = ints[_BLOCK_SIZE], ints[_REQUEST_BLOCKS], ints[_WAITING]
    kv_blocks_used, kv_blocks_total, slots_total, slots_used = (
        ints[_KV_BLOCKS_USED], ints[_KV_BLOCKS_TOTAL], ints[_SLOTS_TOTAL], ints[_SLOTS_USED])
    lowest = np.inf
    count = 0
    for row in range(free.shape[0]):
        if not free[row]:
            continue
        queue = waiting[row] + growth_penalty[row]
        load = (0.4 * utilisation[row] + 0.3 * queue / 10) / health[row]
        need = max(1, math.ceil((prompt + output) / block_size[row]) - cached[row])
        free_blocks = max(0, kv_blocks_total[row] - kv_blocks_used[row])
        fit = 0.5 * min(1.0, free_blocks / need) + 0.5 * (slots_total[row] - slots_used[row]) / max(1, slots_total[row])
        match = cached[row] / request_blocks if request_blocks else 0.0  # match_ratio
        key = -(-load_weight * load + cache_weight * match + fit_weight * fit)
        keys[row] = key
        if key != key:
            return -1
        if key < lowest or count == 0:
            lowest = key
            tied[0] = row
            count = 1
        elif key == lowest:
            tied[count] = row
            count += 1
    return count


@_compiled("boolean(float64[::1], boolean[::1], float64[::1])")
def _extent(values: np.ndarray, rows: np.ndarray, extent: np.ndarray) -> bool:
    """Writes `min` and `max` of `values` over `rows` to `extent` as Python's builtins take them; False on a NaN."""
    found = False
    lowest = highest = 0.0
    for row in range(values.shape[0]):
        if not rows[row]:
            continue
        value = values[row]
        if value != value:
            return False
        if not found:
            lowest = highest = value
            found = True
        elif value < lowest:
            lowest = value
        elif value > highest:
            highest = value
    extent[0], extent[1] = lowest, highest
    return True


@_compiled("void(float64[:, ::1], int64[:, ::1], boolean[::1], boolean[::1], float64, float64, int64, boolean[::1])")
def _within_backlog(floats: np.ndarray, ints: np.ndarray, eligible: np.ndarray, free: np.ndarray, now: float, bound_s: float,
                    prompt: int, within: np.ndarray) -> None:
    """`Decision.limit_backlog`: writes to `within` the rows of `free` it keeps.

    The operations are `Router.place`'s bound (`ClusterSnapshot.fastest_prefill_per_token_s`,
    `ChainState.first_token_wait_s`) and `SnapshotBuilder.backlog_s`'s, in their order: a row
    with no backlog drains from 0 and stays at 0, and a NaN drains to 0 as `max(0.0, x)` has
    it; a NaN figure is never within the bound.
    """
    b, drain_per_s, backlog_left, backlog_since = floats[_B], floats[_DRAIN_PER_S], floats[_BACKLOG_LEFT], floats[_BACKLOG_SINCE]
    block_size, request_blocks = ints[_BLOCK_SIZE], ints[_REQUEST_BLOCKS]
    fastest, found = 0.0, False
    for row in range(free.shape[0]):
        if eligible[row] and (not found or b[row] < fastest):
            fastest, found = b[row], True
    bound_s = bound_s + prompt * fastest
    for row in range(free.shape[0]):
        if not free[row]:
            within[row] = False
            continue
        elapsed = now - backlog_since[row]
        elapsed = elapsed if elapsed > 0.0 else 0.0
        left = backlog_left[row] - drain_per_s[row] * elapsed
        backlog = (left if left > 0.0 else 0.0) * b[row]
        uncached = max(0, prompt - request_blocks[row] * block_size[row])  # ChainState.uncached_tokens
        within[row] = backlog + uncached * b[row] <= bound_s


# Key column sets `Decision.least` was asked for, as the kernel takes them.
_KEYS: dict[tuple[str, ...], tuple[np.ndarray, np.ndarray]] = {}
