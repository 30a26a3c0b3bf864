"""Benchmark workloads, generated locally and deterministically from a seed.

A workload is a stream of `Session`s. A session is one or more `Turn`s sent
one after another (a multi-turn conversation feeds each answer back into
the next prompt); sessions start at their `arrival_s` offset (open loop) or
whenever a closed-loop client is free. Single requests are one-turn sessions.

Prompt text is built from the sim tokenizer's output vocabulary: each
" word" there is exactly one token, so a text of N words is N tokens, and
equal texts are equal token sequences (prefix caching sees them as shared).
Each session draws its content from its own `random.Random(f"{seed}:...")`
(string seeds are stable across processes and Python hash seeds), so the
same seed gives the same sessions in any order they are consumed.

Kinds (`WorkloadSpec.kind`):
* `shared-prefix`: G groups, each with a system prompt of S tokens; each
  request is that prompt plus its own question of Q tokens, O output tokens.
* `multi-turn`: conversations of T turns; turn k's prompt holds the system
  prompt, every earlier question and the answers the client received.
* `long-context`: ShareGPT-like requests with a share of 16k-128k-token
  prompts (clamped to `max_model_len`).
* `sharegpt`: lognormal input/output lengths with means near ShareGPT's
  (input ~300, output ~200 tokens). An approximation of the published
  distribution's shape and means, not a sample of the data set.
* `trace`: JSONL lines `{"timestamp", "input_length", "output_length",
  "hash_ids"}` (Mooncake format, timestamps in ms); equal hash ids become
  identical 512-token text blocks.

With `WorkloadSpec.adapters` = N > 0, every session of any kind runs with a
LoRA adapter, `adapter-<k>` for k in 0..N-1, drawn from a Zipf law of
exponent `adapter_zipf` (rank k+1 has weight 1 / (k+1)^s) by its own seeded
generator, independently of its group: the same session gets the same
adapter in any run, and a conversation keeps its adapter for every turn.

With `WorkloadSpec.tenants`, every session belongs to one tenant, drawn by
the tenants' shares of the arrivals (`TenantShare`, `--tenants
NAME:SHARE[:WEIGHT],...`) by its own seeded generator: tenant k's requests
arrive at its share of the rate.
"""

from __future__ import annotations

import bisect
import functools
import itertools
import json
import math
import random
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Literal

from shared.tokenizer import SimTokenizer

WorkloadKind = Literal["shared-prefix", "multi-turn", "long-context", "sharegpt", "trace"]
WORKLOAD_KINDS: tuple[str, ...] = ("shared-prefix", "multi-turn", "long-context", "sharegpt", "trace")
Api = Literal["chat", "completions"]

TRACE_BLOCK_TOKENS = 512
# Room the chat template and rounding may take beyond a prompt's own words.
_CONTEXT_MARGIN_TOKENS = 16
_SHAREGPT_INPUT_MEAN, _SHAREGPT_INPUT_SIGMA = 300.0, 1.0
_SHAREGPT_OUTPUT_MEAN, _SHAREGPT_OUTPUT_SIGMA = 200.0, 0.8
_SHAREGPT_OUTPUT_MAX = 2048


@dataclass(frozen=True)
class TenantShare:
    """A tenant of the workload: its share of the arrivals (relative to the others') and its weight."""

    name: str
    share: float
    weight: float = 1.0


def parse_tenants(value: str) -> tuple[TenantShare, ...]:
    """`NAME:SHARE[:WEIGHT],...` (`--tenants`): shares relative to each other, weights 1 unless given."""
    tenants = []
    for part in (p.strip() for p in value.split(",") if p.strip()):
        name, _, rest = part.partition(":")
        share_text, _, weight_text = rest.partition(":")
        try:
            share, weight = float(share_text), float(weight_text or 1.0)
        except ValueError:
            share = weight = -1.0
        if not name or not (math.isfinite(share) and share > 0) or not (math.isfinite(weight) and weight > 0):
            raise ValueError(f"--tenants {part!r}: expected NAME:SHARE[:WEIGHT] with a share and weight above 0")
        tenants.append(TenantShare(name, share, weight))
    if len({t.name for t in tenants}) < len(tenants):
        raise ValueError(f"--tenants {value!r}: a tenant is named twice")
    return tuple(tenants)


@dataclass(frozen=True)
class Turn:
    text: str  # chat: this turn's user message; completions: the whole prompt
    max_tokens: int
    text_tokens: int  # tokens of `text` alone (no template, no history)


@dataclass(frozen=True)
class Session:
    session_id: str
    group: str  # shared-prefix group, conversation or trace prefix: for analysis only
    arrival_s: float  # offset from the run's start; 0 for closed loops
    turns: tuple[Turn, ...]
    api: Api = "completions"
    system: str | None = None  # chat only
    think_time_s: float = 0.0  # pause between a turn's answer and the next turn
    priority: int = 0  # the requests' `priority` (higher is served first)
    adapter: str = ""  # the LoRA adapter its requests name as their model ("": the base model)
    tenant: str = ""  # who sends it ("": nobody named)
    tenant_weight: float = 1.0  # the tenant's weight in fair sharing

    @property
    def requests(self) -> int:
        return len(self.turns)


@dataclass(frozen=True)
class ArrivalSpec:
    """Open loop at `rate` requests/s (gamma inter-arrivals of coefficient of variation `cv`; 1 = Poisson), or closed."""

    mode: Literal["poisson", "gamma", "closed"] = "poisson"
    rate: float = 1.0
    cv: float = 1.0
    # A rate that changes over time: (from second, rate) pairs in order; `rate` holds before the first.
    steps: tuple[tuple[float, float], ...] = ()

    def rate_at(self, t: float) -> float:
        rate = self.rate
        for start, stepped in self.steps:
            if t < start:
                break
            rate = stepped
        return rate

    def offsets(self, seed: int) -> Iterator[float]:
        if self.mode == "closed":
            yield from itertools.repeat(0.0)
            return
        if self.rate <= 0 or any(rate <= 0 for _, rate in self.steps):
            raise ValueError("arrival rate must be positive")
        rng = random.Random(f"{seed}:arrivals")
        cv = 1.0 if self.mode == "poisson" else self.cv
        boundaries = [start for start, _ in self.steps]
        now = 0.0
        while True:
            yield now
            gap = _interarrival(rng, self.rate_at(now), cv)
            # A step's new rate takes over at its boundary (exact for Poisson arrivals, which have no memory).
            crossed = next((b for b in boundaries if now < b <= now + gap), None)
            if crossed is not None:
                now = crossed
                gap = _interarrival(rng, self.rate_at(now), cv)
            now += gap


def _interarrival(rng: random.Random, rate: float, cv: float) -> float:
    if cv <= 0:
        return 1.0 / rate
    shape = 1.0 / (cv * cv)
    return rng.gammavariate(shape, 1.0 / (rate * shape))


@dataclass(frozen=True)
class WorkloadSpec:
    kind: WorkloadKind = "shared-prefix"
    seed: int = 0
    max_requests: int = 100  # hard cap on requests (turns), whatever the duration
    duration_s: float | None = None  # open loop: no session arrives later than this
    arrival: ArrivalSpec = field(default_factory=ArrivalSpec)
    max_model_len: int = 4096
    # shared-prefix and multi-turn
    groups: int = 8
    system_tokens: int = 1024
    question_tokens: int = 64
    output_tokens: int = 128
    # multi-turn
    turns: int = 4
    think_time_s: float = 0.0
    # long-context
    long_share: float = 0.05
    long_min_tokens: int = 16_384
    long_max_tokens: int = 131_072
    # trace
    trace_path: Path | None = None
    trace_time_scale: float = 1.0  # multiplies trace timestamps; 0.5 replays twice as fast
    trace_use_timestamps: bool = True  # False: the arrival spec replaces the trace's timestamps
    # Share of sessions whose requests carry priority 1 (the rest 0), drawn per session.
    high_priority_share: float = 0.0
    # LoRA adapters the sessions run with (0: the base model), and the exponent of their Zipf popularity.
    adapters: int = 0
    adapter_zipf: float = 1.0
    # The tenants sessions belong to, and their shares of the arrivals (none: no tenant named).
    tenants: tuple[TenantShare, ...] = ()

    def check(self) -> None:
        if self.max_requests < 1:
            raise ValueError("max_requests must be at least 1")
        if min(self.groups, self.turns, self.output_tokens, self.question_tokens) < 1 or self.system_tokens < 0:
            raise ValueError("groups, turns, question and output tokens must be at least 1")
        if not 0.0 <= self.long_share <= 1.0:
            raise ValueError("long_share must be in [0, 1]")
        if not 0.0 <= self.high_priority_share <= 1.0:
            raise ValueError("high_priority_share must be in [0, 1]")
        if self.adapters < 0 or not math.isfinite(self.adapter_zipf) or self.adapter_zipf < 0:
            raise ValueError("adapters must be 0 or more, and their Zipf exponent a number 0 or more")
        if len({t.name for t in self.tenants}) < len(self.tenants):
            raise ValueError("tenants must have different names")
        if self.kind == "trace" and self.trace_path is None:
            raise ValueError("the trace workload needs a trace file")
        if self.kind in ("shared-prefix", "multi-turn"):
            budget = self.system_tokens + self.turns_per_session * (self.question_tokens + self.output_tokens + 8)
            if budget + _CONTEXT_MARGIN_TOKENS > self.max_model_len:
                raise ValueError(f"prompts of this workload reach ~{budget} tokens, over max_model_len {self.max_model_len}")

    def tenant_weights(self) -> dict[str, float]:
        return {tenant.name: tenant.weight for tenant in self.tenants}

    @property
    def timed(self) -> bool:
        """Whether sessions carry real arrival times (open loop or trace timestamps), not closed-loop zeros."""
        return self.arrival.mode != "closed" or (self.kind == "trace" and self.trace_use_timestamps)

    @property
    def turns_per_session(self) -> int:
        return self.turns if self.kind == "multi-turn" else 1


class TextMaker:
    """Texts of an exact number of sim tokens, each a function of a string key."""

    def __init__(self) -> None:
        tokenizer = SimTokenizer()
        first, end = tokenizer.output_token_range
        self._words = tuple(tokenizer.token_text(token_id) for token_id in range(first, end))

    def words(self, tokens: int, key: str) -> list[str]:
        return random.Random(key).choices(self._words, k=tokens)

    def text(self, tokens: int, key: str) -> str:
        return "".join(self.words(tokens, key))

    @functools.lru_cache(maxsize=1024)  # noqa: B019 - one maker per workload, and texts are pure functions of the key
    def shared_text(self, tokens: int, key: str) -> str:
        """`text`, remembered: for texts many sessions repeat (system prompts)."""
        return self.text(tokens, key)


def sessions(spec: WorkloadSpec) -> Iterator[Session]:
    """The workload's sessions in arrival order, at most `max_requests` requests in all."""
    spec.check()
    makers = {
        "shared-prefix": _shared_prefix,
        "multi-turn": _multi_turn,
        "long-context": _long_context,
        "sharegpt": _sharegpt,
    }
    if spec.kind == "trace":
        generated = _trace(spec)
    else:
        make = makers[spec.kind]
        maker = TextMaker()
        generated = (make(spec, maker, index, arrival) for index, arrival in enumerate(spec.arrival.offsets(spec.seed)))
    budget = spec.max_requests
    for index, session in enumerate(generated):
        if spec.high_priority_share and random.Random(f"{spec.seed}:priority:{index}").random() < spec.high_priority_share:
            session = replace(session, priority=1)
        if spec.adapters:
            session = replace(session, adapter=adapter_name(spec, index))
        if spec.tenants:
            tenant = tenant_of(spec, index)
            session = replace(session, tenant=tenant.name, tenant_weight=tenant.weight)
        if spec.duration_s is not None and spec.timed and session.arrival_s > spec.duration_s:
            return
        if session.requests > budget:
            session = replace(session, turns=session.turns[:budget])
        budget -= session.requests
        yield session
        if budget <= 0:
            return


def adapter_name(spec: WorkloadSpec, index: int) -> str:
    """Session `index`'s LoRA adapter: rank k (from 0) drawn with weight 1 / (k + 1)^adapter_zipf."""
    cumulative = _zipf_cumulative(spec.adapters, spec.adapter_zipf)
    draw = random.Random(f"{spec.seed}:adapter:{index}").random() * cumulative[-1]
    return adapter_names(spec.adapters)[min(bisect.bisect_right(cumulative, draw), spec.adapters - 1)]


@functools.lru_cache(maxsize=16)
def adapter_names(count: int) -> tuple[str, ...]:
    """The names of a workload's `count` adapters, from the most popular on."""
    return tuple(f"adapter-{rank}" for rank in range(count))


@functools.lru_cache(maxsize=16)
def tenant_of(spec: WorkloadSpec, index: int) -> TenantShare:
    """Session `index`'s tenant, drawn by the tenants' shares."""
    cumulative = list(itertools.accumulate(t.share for t in spec.tenants))
    draw = random.Random(f"{spec.seed}:tenant:{index}").random() * cumulative[-1]
    return spec.tenants[min(bisect.bisect_right(cumulative, draw), len(spec.tenants) - 1)]


def _zipf_cumulative(count: int, exponent: float) -> tuple[float, ...]:
    return tuple(itertools.accumulate(1.0 / (rank ** exponent) for rank in range(1, count + 1)))


def _session_rng(spec: WorkloadSpec, index: int) -> random.Random:
    return random.Random(f"{spec.seed}:{spec.kind}:session:{index}")


def _shared_prefix(spec: WorkloadSpec, maker: TextMaker, index: int, arrival_s: float) -> Session:
    group = _session_rng(spec, index).randrange(spec.groups)
    question = maker.text(spec.question_tokens, f"{spec.seed}:question:{index}")
    return Session(f"s{index}", f"g{group}", arrival_s, (Turn(question, spec.output_tokens, spec.question_tokens),),
                   api="chat", system=_system_prompt(spec, maker, group))


def _multi_turn(spec: WorkloadSpec, maker: TextMaker, index: int, arrival_s: float) -> Session:
    group = _session_rng(spec, index).randrange(spec.groups)
    turns = tuple(
        Turn(maker.text(spec.question_tokens, f"{spec.seed}:conversation:{index}:turn:{k}"), spec.output_tokens,
             spec.question_tokens)
        for k in range(spec.turns)
    )
    return Session(f"c{index}", f"c{index}", arrival_s, turns, api="chat", system=_system_prompt(spec, maker, group),
                   think_time_s=spec.think_time_s)


def _system_prompt(spec: WorkloadSpec, maker: TextMaker, group: int) -> str | None:
    # The same words for every session of a group: that is what makes the prefix shared.
    return maker.shared_text(spec.system_tokens, f"{spec.seed}:system:{group}") if spec.system_tokens else None


def sharegpt_lengths(rng: random.Random, max_model_len: int) -> tuple[int, int]:
    """(input, output) tokens drawn from lognormals with ShareGPT-like means, clamped to the context."""
    output = _lognormal_int(rng, _SHAREGPT_OUTPUT_MEAN, _SHAREGPT_OUTPUT_SIGMA, 1, _SHAREGPT_OUTPUT_MAX)
    output = min(output, max(1, max_model_len // 4))
    prompt = _lognormal_int(rng, _SHAREGPT_INPUT_MEAN, _SHAREGPT_INPUT_SIGMA, 4, max_model_len)
    return min(prompt, max_model_len - output - _CONTEXT_MARGIN_TOKENS), output


def _lognormal_int(rng: random.Random, mean: float, sigma: float, low: int, high: int) -> int:
    # mu chosen so that the distribution's mean (before clamping) is `mean`.
    mu = math.log(mean) - sigma * sigma / 2.0
    return max(low, min(high, round(rng.lognormvariate(mu, sigma))))


def _sharegpt(spec: WorkloadSpec, maker: TextMaker, index: int, arrival_s: float) -> Session:
    prompt_tokens, output_tokens = sharegpt_lengths(_session_rng(spec, index), spec.max_model_len)
    prompt = maker.text(prompt_tokens, f"{spec.seed}:prompt:{index}")
    return Session(f"s{index}", "short", arrival_s, (Turn(prompt, output_tokens, prompt_tokens),))


def _long_context(spec: WorkloadSpec, maker: TextMaker, index: int, arrival_s: float) -> Session:
    rng = _session_rng(spec, index)
    prompt_tokens, output_tokens = sharegpt_lengths(rng, spec.max_model_len)
    group = "short"
    if rng.random() < spec.long_share:
        ceiling = spec.max_model_len - output_tokens - _CONTEXT_MARGIN_TOKENS
        low, high = min(spec.long_min_tokens, ceiling), min(spec.long_max_tokens, ceiling)
        # Log-uniform: as many 16k-32k prompts as 64k-128k ones.
        prompt_tokens = round(math.exp(rng.uniform(math.log(max(low, 1)), math.log(max(high, 1)))))
        group = "long"
    prompt = maker.text(prompt_tokens, f"{spec.seed}:prompt:{index}")
    return Session(f"s{index}", group, arrival_s, (Turn(prompt, output_tokens, prompt_tokens),))


# --- trace replay -----------------------------------------------------------------------


@dataclass(frozen=True)
class TraceRecord:
    timestamp_ms: float
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]


def read_trace(path: Path) -> Iterator[TraceRecord]:
    with Path(path).open() as lines:
        for number, line in enumerate(lines, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
                yield TraceRecord(float(row["timestamp"]), int(row["input_length"]), int(row["output_length"]),
                                  tuple(int(h) for h in row.get("hash_ids", ())))
            except (ValueError, KeyError, TypeError) as exc:
                raise ValueError(f"{path}:{number}: not a trace record ({exc})") from exc


def trace_prompt(maker: TextMaker, seed: int, record: TraceRecord, index: int, tokens: int) -> str:
    """Hash id h -> the same 512 words everywhere; the last block is cut to `tokens`."""
    words: list[str] = []
    for hash_id in record.hash_ids:
        if len(words) >= tokens:
            break
        words += maker.words(TRACE_BLOCK_TOKENS, f"{seed}:block:{hash_id}")
    if len(words) < tokens:  # a record longer than its blocks: the rest is its own
        words += maker.words(tokens - len(words), f"{seed}:trace-tail:{index}")
    return "".join(words[:tokens])


def _trace(spec: WorkloadSpec) -> Iterator[Session]:
    maker = TextMaker()
    arrivals = spec.arrival.offsets(spec.seed)
    first_ms: float | None = None
    for index, record in enumerate(read_trace(spec.trace_path)):
        if first_ms is None:
            first_ms = record.timestamp_ms
        if spec.trace_use_timestamps:
            arrival_s = (record.timestamp_ms - first_ms) / 1000.0 * spec.trace_time_scale
        else:
            arrival_s = next(arrivals)
        output = max(1, min(record.output_length, spec.max_model_len // 4))
        tokens = max(1, min(record.input_length, spec.max_model_len - output - _CONTEXT_MARGIN_TOKENS))
        group = f"h{record.hash_ids[0]}" if record.hash_ids else "none"
        prompt = trace_prompt(maker, spec.seed, record, index, tokens)
        yield Session(f"t{index}", group, arrival_s, (Turn(prompt, output, tokens),))
