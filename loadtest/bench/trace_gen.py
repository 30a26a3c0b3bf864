"""A Mooncake-format trace with production-like statistics, generated from a seed.

Mooncake's published traces give, per request, an arrival `timestamp` (ms),
`input_length`, `output_length` and the `hash_ids` of its 512-token blocks
(equal ids: equal content). This generator writes the same format with the
properties that make routing matter, as reported for chat and agent
serving: long prompts (4-8k tokens on average), most blocks seen before
(70-80% reuse), tenants whose traffic is Zipf-distributed, and multi-turn
conversations whose every turn resends the history.

* Tenants: `--tenants` of them, each with its own system prompt (2-8 blocks);
  a conversation picks its tenant with probability proportional to
  1 / rank^`--zipf`.
* Conversations start as a Poisson process at `--rate` per second. Each has
  1-12 turns (geometric, mean `--turns`); a turn's prompt is the tenant's
  system prompt, the whole history (earlier questions and answers) and a
  new question of 1-3 blocks. Turns follow each other after a think time
  (exponential, mean `--think-time` seconds) plus the previous answer's time.
* Answers: lognormal lengths, mean about 300 tokens, 16-1024.

    python -m loadtest.bench.trace_gen --requests 20000 --rate 4 --out loadtest/results/trace.jsonl
"""

from __future__ import annotations

import argparse
import heapq
import itertools
import json
import math
import random
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

BLOCK_TOKENS = 512
_OUTPUT_MEAN, _OUTPUT_SIGMA = 300.0, 0.7
# Seconds an answer takes to stream, for spacing a conversation's turns: about 30 tokens per second.
_ANSWER_TOKENS_PER_S = 30.0


@dataclass(frozen=True)
class TraceSpec:
    requests: int = 20_000
    rate: float = 4.0  # conversations per second
    tenants: int = 64
    zipf: float = 1.1
    turns: float = 3.0  # mean turns per conversation
    think_time_s: float = 20.0
    seed: int = 0


@dataclass(frozen=True)
class TraceRow:
    timestamp_ms: float
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]

    def to_json(self) -> str:
        return json.dumps({"timestamp": round(self.timestamp_ms, 3), "input_length": self.input_length,
                           "output_length": self.output_length, "hash_ids": list(self.hash_ids)})


def generate(spec: TraceSpec) -> Iterator[TraceRow]:
    """The trace's rows in arrival order."""
    rng = random.Random(f"{spec.seed}:trace")
    block_ids = itertools.count()
    systems = [tuple(next(block_ids) for _ in range(rng.randint(2, 8))) for _ in range(spec.tenants)]
    weights = [1.0 / (rank + 1) ** spec.zipf for rank in range(spec.tenants)]
    # Turns waiting to be emitted, by arrival time: (ms, tie-break, row).
    pending: list[tuple[float, int, TraceRow]] = []
    order = itertools.count()
    started_ms = 0.0
    emitted = 0
    while emitted < spec.requests:
        started_ms += rng.expovariate(spec.rate) * 1000.0
        # Turns that arrive before this conversation starts go out first.
        while pending and pending[0][0] <= started_ms and emitted < spec.requests:
            yield heapq.heappop(pending)[2]
            emitted += 1
        tenant = rng.choices(range(spec.tenants), weights)[0]
        turns = min(12, 1 + int(rng.expovariate(1.0 / max(spec.turns - 1.0, 1e-9)))) if spec.turns > 1 else 1
        history: tuple[int, ...] = systems[tenant]
        at_ms = started_ms
        for _ in range(turns):
            question = tuple(next(block_ids) for _ in range(rng.randint(1, 3)))
            blocks = history + question
            output = _output_length(rng)
            # The last block is partly filled.
            length = len(blocks) * BLOCK_TOKENS - rng.randrange(BLOCK_TOKENS)
            heapq.heappush(pending, (at_ms, next(order), TraceRow(at_ms, length, output, blocks)))
            answer = tuple(next(block_ids) for _ in range(math.ceil(output / BLOCK_TOKENS)))
            history = blocks + answer
            at_ms += (output / _ANSWER_TOKENS_PER_S + rng.expovariate(1.0 / spec.think_time_s)) * 1000.0


def _output_length(rng: random.Random) -> int:
    mu = math.log(_OUTPUT_MEAN) - _OUTPUT_SIGMA**2 / 2
    return max(16, min(1024, round(rng.lognormvariate(mu, _OUTPUT_SIGMA))))


def statistics_of(rows: list[TraceRow]) -> dict[str, float]:
    """Mean input and output tokens, and the share of blocks an earlier request already had."""
    seen: set[int] = set()
    reused = total = 0
    for row in sorted(rows, key=lambda r: r.timestamp_ms):
        reused += sum(1 for block in row.hash_ids if block in seen)
        total += len(row.hash_ids)
        seen.update(row.hash_ids)
    count = max(1, len(rows))
    span_s = (rows[-1].timestamp_ms - rows[0].timestamp_ms) / 1000.0 if len(rows) > 1 else 0.0
    return {
        "requests": len(rows),
        "mean_input_tokens": sum(r.input_length for r in rows) / count,
        "mean_output_tokens": sum(r.output_length for r in rows) / count,
        "block_reuse": reused / total if total else 0.0,
        "span_s": span_s,
        "requests_per_s": len(rows) / span_s if span_s > 0 else 0.0,
    }


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m loadtest.bench.trace_gen", description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    defaults = TraceSpec()
    parser.add_argument("--requests", type=int, default=defaults.requests)
    parser.add_argument("--rate", type=float, default=defaults.rate, help="conversations started per second")
    parser.add_argument("--tenants", type=int, default=defaults.tenants)
    parser.add_argument("--zipf", type=float, default=defaults.zipf, help="tenant popularity exponent")
    parser.add_argument("--turns", type=float, default=defaults.turns, help="mean turns per conversation")
    parser.add_argument("--think-time", type=float, default=defaults.think_time_s, help="mean seconds between turns")
    parser.add_argument("--seed", type=int, default=defaults.seed)
    parser.add_argument("--out", type=Path, required=True, help="JSONL file to write")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.requests < 1 or args.rate <= 0 or args.tenants < 1 or args.turns < 1 or args.think_time < 0 or args.zipf < 0:
        print("--requests, --rate, --tenants and --turns must be positive; --zipf and --think-time not negative",
              file=sys.stderr)
        return 2
    spec = TraceSpec(args.requests, args.rate, args.tenants, args.zipf, args.turns, args.think_time, args.seed)
    rows = list(generate(spec))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text("".join(row.to_json() + "\n" for row in rows))
    print(json.dumps(statistics_of(rows) | {"out": str(args.out)}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
