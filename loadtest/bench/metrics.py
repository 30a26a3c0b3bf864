"""Serving metrics from request records (pure: no I/O, no clocks).

Definitions (all wall-clock, seconds in, milliseconds out):
* TTFT: first content chunk - send.
* TPOT: (end-to-end - TTFT) / (completion tokens - 1); undefined for 1-token answers.
* ITL: gaps between consecutive content chunks, pooled over requests.
* E2E: end of stream - send.
* Throughput: successful requests (and tokens) / span, the span running from
  the first send to the last end.
* Goodput: successful requests meeting BOTH the TTFT and the TPOT SLO, per
  second of the same span (a 1-token answer meets the TPOT SLO).
* Prefix-cache hit rate: cached prompt tokens / prompt tokens (from usage).
* Wait before the worker: E2E - the worker's own duration (`RequestFinished.
  duration_s`): routing, the balancer's central queue and dispatch.
* Load spread: coefficient of variation (population std / mean) of requests
  per worker, every worker of the fleet counted, idle ones as 0.
"""

from __future__ import annotations

import math
import statistics
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from loadtest.bench.client import RequestRecord


@dataclass(frozen=True)
class WorkerRun:
    """What a worker's `RequestFinished` event says about one request."""

    worker_id: str
    duration_s: float
    finish_reason: str = ""


@dataclass(frozen=True)
class Slo:
    ttft_s: float
    tpot_s: float


def percentile(sorted_values: Sequence[float], q: float) -> float:
    """Linear interpolation between closest ranks (numpy's default)."""
    if not sorted_values:
        raise ValueError("no values")
    position = (len(sorted_values) - 1) * q / 100.0
    low = int(position)
    high = min(low + 1, len(sorted_values) - 1)
    return sorted_values[low] + (sorted_values[high] - sorted_values[low]) * (position - low)


def distribution_ms(values_s: Iterable[float]) -> dict[str, float | int | None]:
    values = sorted(v * 1000.0 for v in values_s)
    if not values:
        return {"count": 0, "mean": None, "p50": None, "p90": None, "p99": None, "max": None}
    return {"count": len(values), "mean": sum(values) / len(values), "p50": percentile(values, 50),
            "p90": percentile(values, 90), "p99": percentile(values, 99), "max": values[-1]}


def latency_summary(latencies_s: Sequence[float]) -> dict[str, float | int | None]:
    """Count, p50/p90/p99, mean, min and max of latencies, in ms."""
    values = sorted(x * 1000.0 for x in latencies_s)
    if not values:
        return {"count": 0, "p50_ms": None, "p90_ms": None, "p99_ms": None, "mean_ms": None, "min_ms": None, "max_ms": None}
    return {
        "count": len(values),
        "p50_ms": percentile(values, 50),
        "p90_ms": percentile(values, 90),
        "p99_ms": percentile(values, 99),
        "mean_ms": sum(values) / len(values),
        "min_ms": values[0],
        "max_ms": values[-1],
    }


def completion_tokens(record: RequestRecord) -> int:
    return record.completion_tokens if record.completion_tokens is not None else len(record.token_times_s)


def ttft_s(record: RequestRecord) -> float | None:
    return None if record.first_token_s is None else record.first_token_s - record.sent_s


def e2e_s(record: RequestRecord) -> float | None:
    return None if record.end_s is None else record.end_s - record.sent_s


def tpot_s(record: RequestRecord) -> float | None:
    ttft, e2e, tokens = ttft_s(record), e2e_s(record), completion_tokens(record)
    if ttft is None or e2e is None or tokens < 2:
        return None
    return (e2e - ttft) / (tokens - 1)


def inter_token_s(record: RequestRecord) -> list[float]:
    times = record.token_times_s
    return [later - earlier for earlier, later in zip(times, times[1:])]


def meets_slo(record: RequestRecord, slo: Slo) -> bool:
    if not record.ok:
        return False
    ttft, tpot = ttft_s(record), tpot_s(record)
    return ttft is not None and ttft <= slo.ttft_s and (tpot is None or tpot <= slo.tpot_s)


def error_kind(error: str) -> str:
    return error.split(":", 1)[0].strip() or "error"


def coefficient_of_variation(counts: Sequence[float]) -> float | None:
    if not counts:
        return None
    mean = sum(counts) / len(counts)
    return statistics.pstdev(counts) / mean if mean > 0 else None


def load_per_worker(records: Sequence[RequestRecord], runs: Mapping[str, WorkerRun],
                    worker_ids: Sequence[str] = ()) -> dict[str, int]:
    """Requests of this run per worker: every listed worker (0 if idle) plus any other that ran one."""
    counts: Counter[str] = Counter({worker_id: 0 for worker_id in worker_ids})
    for record in records:
        run = runs.get(record.request_id or "")
        if run is not None:
            counts[run.worker_id] += 1
    return dict(sorted(counts.items()))


def span_s(records: Sequence[RequestRecord]) -> float:
    sent = [r.sent_s for r in records]
    ends = [r.end_s for r in records if r.end_s is not None]
    if not sent or not ends:
        return 0.0
    return max(0.0, max(ends) - min(sent))


def late_attainment(records: Sequence[RequestRecord], slo: Slo, share: float = 0.25) -> float | None:
    """SLO attainment of the requests scheduled in the last `share` of the time new sessions kept arriving.

    A fleet given more than it can sustain falls behind a little more every
    second, so a short run can still keep most of its requests within the
    SLO; the last arrivals show it first. Later turns of conversations sent
    after the last session arrived (the fleet emptying) are left out. None
    without requests in that stretch.
    """
    starts = [r.scheduled_s for r in records if r.turn == 0]
    if not starts:
        return None
    first, last = min(r.scheduled_s for r in records), max(starts)
    late = [r for r in records if last - share * (last - first) <= r.scheduled_s <= last]
    return sum(1 for r in late if meets_slo(r, slo)) / len(late) if late else None


def jain_index(values: Sequence[float]) -> float | None:
    """Jain's fairness index, (sum x)^2 / (n sum x^2): 1 when all are equal, 1/n when one has everything."""
    squares = sum(v * v for v in values)
    return sum(values) ** 2 / (len(values) * squares) if values and squares > 0 else None


def fair_level(demands: Mapping[str, float], weights: Mapping[str, float], total: float) -> float:
    """The water level L of a max-min fair split of `total` (per unit of weight): each tenant gets
    min(its demand, its weight x L), and they add up to `total` (or everyone gets its demand)."""
    by_ratio = sorted((demand / weights.get(t, 1.0), demand, weights.get(t, 1.0)) for t, demand in demands.items())
    left, weight_left = total, sum(w for *_, w in by_ratio)
    for ratio, demand, weight in by_ratio:
        if ratio * weight_left >= left:
            return left / weight_left
        left -= demand
        weight_left -= weight
    return by_ratio[-1][0] if by_ratio else 0.0


def tenant_summary(records: Sequence[RequestRecord], slo: Slo, weights: Mapping[str, float]) -> dict[str, Any]:
    """Per tenant: requests, SLO attainment, TTFT p99 and served tokens (prompt and output, per unit of weight);
    and Jain's index of served tokens per weight over the backlogged tenants: those that asked for more than a
    max-min fair split of what was served would give them (the others got what they asked for)."""
    by_tenant: dict[str, list[RequestRecord]] = {}
    for record in records:
        by_tenant.setdefault(record.tenant, []).append(record)
    served = {t: float(sum((r.prompt_tokens or 0) + completion_tokens(r) for r in rs if r.ok)) for t, rs in by_tenant.items()}
    asked = {t: float(sum((r.prompt_tokens or 0) + r.max_tokens for r in rs)) for t, rs in by_tenant.items()}
    level = fair_level(asked, weights, sum(served.values()))
    # Within 5% of the level: a tenant that asked for about its fair share is not held back by the others.
    backlogged = sorted(t for t in by_tenant if asked[t] > 1.05 * weights.get(t, 1.0) * level)
    tenants = {}
    for tenant, tenant_records in sorted(by_tenant.items()):
        ok = [r for r in tenant_records if r.ok]
        tenants[tenant] = {
            "requests": len(tenant_records), "succeeded": len(ok), "weight": weights.get(tenant, 1.0),
            "slo_attainment": sum(1 for r in tenant_records if meets_slo(r, slo)) / len(tenant_records),
            "ttft_p99_ms": distribution_ms(t for r in ok if (t := ttft_s(r)) is not None)["p99"],
            "served_tokens": served[tenant], "asked_tokens": asked[tenant],
            "served_tokens_per_weight": served[tenant] / weights.get(tenant, 1.0), "backlogged": tenant in backlogged,
        }
    return {"per_tenant": tenants, "backlogged": backlogged,
            "jain_index_backlogged": jain_index([served[t] / weights.get(t, 1.0) for t in backlogged])}


def summarize(records: Sequence[RequestRecord], slo: Slo, runs: Mapping[str, WorkerRun] | None = None,
              worker_ids: Sequence[str] = (), tenant_weights: Mapping[str, float] | None = None) -> dict[str, Any]:
    """Every metric of one run, JSON-ready; per tenant too where the requests name tenants."""
    runs = runs or {}
    ok = [r for r in records if r.ok]
    span = span_s(records)
    per_second = (lambda n: n / span) if span > 0 else (lambda n: 0.0)
    output_tokens = sum(completion_tokens(r) for r in ok)
    prompt_tokens = sum(r.prompt_tokens or 0 for r in ok)
    cached_tokens = sum(r.cached_tokens or 0 for r in ok)
    good = sum(1 for r in ok if meets_slo(r, slo))
    waits = [w for r in ok if (w := _wait_before_worker(r, runs)) is not None]
    load = load_per_worker(records, runs, worker_ids)
    return {
        "requests": len(records),
        "succeeded": len(ok),
        "failed": len(records) - len(ok),
        "errors": dict(Counter(error_kind(r.error or f"http_{r.status}") for r in records if not r.ok)),
        "span_s": span,
        "request_throughput_rps": per_second(len(ok)),
        "output_token_throughput_tps": per_second(output_tokens),
        "total_token_throughput_tps": per_second(output_tokens + prompt_tokens),
        "goodput_rps": per_second(good),
        "slo_attainment": good / len(records) if records else None,
        "slo_attainment_late": late_attainment(records, slo),
        "slo": {"ttft_ms": slo.ttft_s * 1000.0, "tpot_ms": slo.tpot_s * 1000.0},
        "ttft_ms": distribution_ms(t for r in ok if (t := ttft_s(r)) is not None),
        "tpot_ms": distribution_ms(t for r in ok if (t := tpot_s(r)) is not None),
        "itl_ms": distribution_ms(gap for r in ok for gap in inter_token_s(r)),
        "e2e_ms": distribution_ms(t for r in ok if (t := e2e_s(r)) is not None),
        "wait_before_worker_ms": distribution_ms(waits),
        "prompt_tokens": prompt_tokens,
        "cached_tokens": cached_tokens,
        "output_tokens": output_tokens,
        "prefix_cache_hit_rate": cached_tokens / prompt_tokens if prompt_tokens else None,
        "requests_per_worker": load,
        "load_cv": coefficient_of_variation(list(load.values())) if any(load.values()) else None,
        "finished_events_matched": sum(1 for r in records if (r.request_id or "") in runs),
    } | ({"tenants": tenant_summary(records, slo, tenant_weights or {})} if any(r.tenant for r in records) else {})


def _wait_before_worker(record: RequestRecord, runs: Mapping[str, WorkerRun]) -> float | None:
    run = runs.get(record.request_id or "")
    e2e = e2e_s(record)
    if run is None or e2e is None or not math.isfinite(run.duration_s):
        return None
    return max(0.0, e2e - run.duration_s)
