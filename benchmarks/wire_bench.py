"""Wire-format benchmark: encode + decode time and bytes of the hot internal NATS messages.

    python -m benchmarks.wire_bench [--quick] [--out PATH]

For each message sent on every request or every engine step (route request
and decision, generate request, token chunk, a step's stream batch, stream
end, request finished, route withdrawn, allocate / release and their
replies, load report, heartbeat, KV events) a realistic instance is encoded
to msgpack and decoded with a typed decoder, as the bus does. Every message
is measured in three shapes built from the same fields:

- `map`: the `contracts.messages.Compact` Structs as plain msgpack maps
  (tag and field names on the wire, every field sent, tracked by the
  garbage collector), the others as defined: the format before `Compact`,
- `contracts`: the Structs as `contracts/` defines them,
- `all array`: `array_like=True, gc=False, omit_defaults=True` on every
  Struct of the message, nested ones included (what is left to gain).

Times are CPU seconds (time.process_time) per encode+decode, the three
shapes interleaved round by round so that a noisy machine slows them alike.
Prints a table and writes JSON.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import random
import statistics
import sys
import time
import types
import typing
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any

import msgspec
from rich.console import Console
from rich.table import Table

from contracts import subjects
from contracts.cache import AllocateReply, AllocateRequest, Allocation, CacheRequest, Released, ReleaseRequest
from contracts.messages import (
    AddressedFrame,
    Compact,
    EngineStats,
    GenerateRequest,
    Heartbeat,
    HeartbeatMessage,
    KvEvents,
    LoadReport,
    PackedStats,
    RequestFinished,
    RouteDecision,
    RouteReply,
    RouteRequest,
    RouteWithdrawn,
    SamplingParams,
    StepTime,
    StreamBatch,
    StreamEnd,
    StreamMessage,
    Timings,
    TokenChunk,
    Usage,
    WorkerRegistration,
    WorkerRequest,
)

SHAPES = ("map", "contracts", "all array")
PROMPT_TOKENS = 2048
BLOCK_SIZE = 16
STREAMS_PER_STEP = 32


# --- building the same message in another shape ----------------------------------------------


class Reshaper:
    """Copies of Struct types with other options, and of instances into those copies.

    `options` apply to every Struct reachable from the types asked for (field types, union members,
    list items) that is a subclass of `only`, so a union never mixes array-like and map-like members,
    which msgspec refuses.
    """

    def __init__(self, only: type[msgspec.Struct] = msgspec.Struct, **options: bool) -> None:
        self._only = only
        self._options = options
        self._copies: dict[type, type] = {}

    def type_of(self, tp: Any) -> Any:
        if isinstance(tp, type) and issubclass(tp, msgspec.Struct):
            return self._struct(tp)
        origin, args = typing.get_origin(tp), typing.get_args(tp)
        if origin is Annotated:
            return Annotated[(self.type_of(args[0]), *tp.__metadata__)]
        if origin in (typing.Union, types.UnionType):
            reshaped = [self.type_of(a) for a in args]
            union = reshaped[0]
            for member in reshaped[1:]:
                union = union | member
            return union
        if origin is list:
            return list[self.type_of(args[0])]
        if origin is dict:
            return dict[self.type_of(args[0]), self.type_of(args[1])]
        return tp

    def _struct(self, cls: type[msgspec.Struct]) -> type[msgspec.Struct]:
        copy = self._copies.get(cls)
        if copy is not None:
            return copy
        config = cls.__struct_config__
        fields = []
        for field in msgspec.structs.fields(cls):
            entry: tuple = (field.name, self.type_of(field.type))
            if field.default is not msgspec.NODEFAULT:
                entry += (field.default,)
            elif field.default_factory is not msgspec.NODEFAULT:
                entry += (msgspec.field(default_factory=field.default_factory),)
            fields.append(entry)
        options = {"omit_defaults": config.omit_defaults, "array_like": config.array_like, "gc": config.gc}
        if issubclass(cls, self._only):
            options |= self._options
        copy = msgspec.defstruct(cls.__name__, fields, tag=config.tag, tag_field=config.tag_field, frozen=config.frozen,
                                 kw_only=True, **options)
        self._copies[cls] = copy
        return copy

    def value(self, value: Any) -> Any:
        if isinstance(value, msgspec.Struct):
            copy = self._struct(type(value))
            return copy(**{name: self.value(getattr(value, name)) for name in value.__struct_fields__})
        if isinstance(value, list):
            return [self.value(v) for v in value]
        if isinstance(value, dict):
            return {k: self.value(v) for k, v in value.items()}
        return value


# --- realistic messages ---------------------------------------------------------------------


def request_id(rng: random.Random) -> str:
    return f"chatcmpl-{rng.getrandbits(96):024x}"


def hashes(rng: random.Random, count: int) -> list[int]:
    return [rng.getrandbits(64) for _ in range(count)]


def tokens(rng: random.Random, count: int) -> list[int]:
    return [rng.randrange(150_000) for _ in range(count)]


def registration(worker_id: str) -> WorkerRegistration:
    return WorkerRegistration(worker_id, "aggregated", "Qwen/Qwen3-8B", "vllm", subjects.worker_inbox(worker_id), BLOCK_SIZE, 32768,
                              "Qwen/Qwen3-8B", 1.76e9, host="gpu-node-17", max_num_seqs=256,
                              step_time=StepTime(0.006, 2.1e-5, 1.4e-4, 1.1e-8))


def stats(rng: random.Random) -> EngineStats:
    return EngineStats(running=rng.randint(1, 64), waiting=rng.randint(0, 8), kv_blocks_total=40_000, kv_blocks_used=rng.randint(0, 40_000),
                       prefix_query_tokens=rng.getrandbits(30), prefix_hit_tokens=rng.getrandbits(28),
                       prefill_tokens_per_s=rng.uniform(1e3, 3e4), decode_tokens_per_s=rng.uniform(1e3, 5e3), gpu_utilization=0.83)


def chunk(rng: random.Random, rid: str, seq: int) -> TokenChunk:
    return TokenChunk(rid, seq, tokens(rng, 1), " word")


def messages() -> dict[str, tuple[Any, msgspec.Struct]]:
    """name -> (the type its receiver decodes with, a realistic instance)."""
    rng = random.Random(7)
    rid, worker = request_id(rng), "w-3f9a2c"
    prompt_blocks = PROMPT_TOKENS // BLOCK_SIZE
    usage = Usage(PROMPT_TOKENS, 256, 1024)
    beat_stats = stats(rng)
    stream_ids = [request_id(rng) for _ in range(STREAMS_PER_STEP)]
    return {
        "RouteRequest": (RouteRequest, RouteRequest(rid, "Qwen/Qwen3-8B", PROMPT_TOKENS, 256, 29.97, block_hashes=hashes(rng, prompt_blocks),
                                                    prefix_token_ids=tokens(rng, PROMPT_TOKENS), tenant="acme")),
        "RouteRequest (short, 256 tok)": (RouteRequest, RouteRequest(rid, "Qwen/Qwen3-8B", 256, 64, 29.97,
                                                                     block_hashes=hashes(rng, 16), prefix_token_ids=tokens(rng, 256))),
        "RouteDecision": (RouteReply, RouteDecision(rid, worker, subjects.worker_inbox(worker), "jffc", cached_blocks=64, max_tokens=256)),
        "RouteWithdrawn": (RouteWithdrawn, RouteWithdrawn(rid)),
        "GenerateRequest": (WorkerRequest, GenerateRequest(rid, "Qwen/Qwen3-8B", tokens(rng, PROMPT_TOKENS),
                                                           SamplingParams(256, temperature=0.7, top_p=0.95),
                                                           subjects.stream_subject("i-8c1d2e", rid), 29.9)),
        "GenerateRequest (short)": (WorkerRequest, GenerateRequest(rid, "Qwen/Qwen3-8B", tokens(rng, 256), SamplingParams(64),
                                                                   subjects.stream_subject("i-8c1d2e", rid), 29.9)),
        "TokenChunk": (StreamMessage, chunk(rng, rid, 17)),
        f"StreamBatch ({STREAMS_PER_STEP} streams)": (StreamMessage, StreamBatch(
            [AddressedFrame(s, chunk(rng, s, rng.randint(1, 200))) for s in stream_ids])),
        "StreamEnd": (StreamMessage, StreamEnd(rid, 256, "stop", usage, Timings(0.041, 2.93), worker)),
        "RequestFinished": (RequestFinished, RequestFinished(rid, worker, "stop", usage, 2.94)),
        "AllocateRequest": (CacheRequest, AllocateRequest(rid, "Qwen/Qwen3-8B", PROMPT_TOKENS, 256, block_hashes=hashes(rng, prompt_blocks),
                                                          worker_id=worker, may_preempt=False)),
        "Allocation": (AllocateReply, Allocation(rid, worker, 144, 64, "general", 30.0)),
        "ReleaseRequest": (CacheRequest, ReleaseRequest(rid)),
        "Released": (AllocateReply | Released, Released(rid, 144, True)),
        "LoadReport": (HeartbeatMessage, LoadReport(worker, PackedStats(*msgspec.structs.astuple(beat_stats)), 1.7648e9, 4711, 2**47 - 5)),
        "Heartbeat": (HeartbeatMessage, Heartbeat(registration(worker), beat_stats, 1.7648e9, 4711, registration_digest=2**47 - 5)),
        "KvEvents": (KvEvents, KvEvents(worker, 90210, BLOCK_SIZE, stored=hashes(rng, 8), removed=hashes(rng, 4))),
    }


# --- measuring ---------------------------------------------------------------------------------


def codec(decode_type: Any, message: msgspec.Struct) -> tuple[Callable[[], Any], bytes]:
    encoder, decoder = msgspec.msgpack.Encoder(), msgspec.msgpack.Decoder(decode_type)
    wire = encoder.encode(message)
    if decoder.decode(wire) != message:
        raise AssertionError(f"{type(message).__name__} does not survive its round trip")

    def round_trip() -> Any:
        return decoder.decode(encoder.encode(message))

    return round_trip, wire


def time_per_call(call: Callable[[], Any], calls: int) -> float:
    started = time.process_time()
    for _ in range(calls):
        call()
    return (time.process_time() - started) / calls


def measure(rounds: int, target_s: float) -> list[dict[str, Any]]:
    as_map = Reshaper(Compact, array_like=False, gc=True, omit_defaults=False)
    as_array = Reshaper(array_like=True, gc=False, omit_defaults=True)
    rows = []
    for name, (decode_type, message) in messages().items():
        shapes = {
            "map": codec(as_map.type_of(decode_type), as_map.value(message)),
            "contracts": codec(decode_type, message),
            "all array": codec(as_array.type_of(decode_type), as_array.value(message)),
        }
        # Enough calls per round for ~target_s of CPU.
        calls = max(10, int(target_s / max(time_per_call(shapes["map"][0], 200), 1e-7)))
        samples: dict[str, list[float]] = {shape: [] for shape in SHAPES}
        for _ in range(rounds):
            for shape in SHAPES:
                samples[shape].append(time_per_call(shapes[shape][0], calls))
        row: dict[str, Any] = {"message": name}
        for shape in SHAPES:
            row[shape] = {"us": statistics.median(samples[shape]) * 1e6, "bytes": len(shapes[shape][1])}
        rows.append(row)
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.wire_bench")
    parser.add_argument("--quick", action="store_true", help="fewer rounds, for a smoke run")
    parser.add_argument("--out", default="benchmarks/results/wire_bench.json")
    args = parser.parse_args(argv)
    rounds, target_s = (3, 0.005) if args.quick else (15, 0.02)
    gc.collect()
    rows = measure(rounds, target_s)
    table = Table(title="msgpack encode+decode per message (CPU us, median of rounds) and bytes")
    for column in ("message", "map us", "contracts us", "ratio", "map B", "contracts B", "all array us", "all array B"):
        table.add_column(column, justify="left" if column == "message" else "right")
    for row in rows:
        m, c, a = row["map"], row["contracts"], row["all array"]
        table.add_row(row["message"], f"{m['us']:.2f}", f"{c['us']:.2f}", f"{c['us'] / m['us']:.2f}", str(m["bytes"]), str(c["bytes"]),
                      f"{a['us']:.2f}", str(a["bytes"]))
    Console(width=160).print(table)
    result = {"machine": {"cpus": os.cpu_count(), "python": sys.version.split()[0], "msgspec": msgspec.__version__,
                          "platform": platform.platform()}, "timestamp": time.time(), "messages": rows}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
