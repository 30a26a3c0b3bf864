"""Hypothesis strategies derived from msgspec types (the wire Structs in contracts/).

`wire_values(T)` draws *builtins* (dicts, lists, numbers, text) shaped like
`T` as msgspec would encode it: tag fields, array-like Structs, the `Meta`
bounds, lengths and patterns, optional fields present or left out. Encode a
draw with `msgspec.msgpack.encode` (or `msgspec.json.encode`) to get bytes a
kvlane service decodes as a `T`. Builtins rather than Struct instances, so a
fuzzer can also break them (`near_misses`).

`hints` maps a field name to the strategy to draw it from instead of the
schema's (a real model name or random text, a live worker's id, a time
left of a few seconds): random text alone seldom gets past the first check
of a handler, and a valid long time left holds what it reserves that long.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import msgspec
import msgspec.inspect as mi
from hypothesis import strategies as st

# Big enough to be interesting, small enough for a message a second.
MAX_ITEMS = 6
MAX_TEXT = 24
INT64 = (-(2**63), 2**64 - 1)  # what msgpack carries

Hints = Mapping[str, st.SearchStrategy[Any]]


def json_values(max_leaves: int = 12) -> st.SearchStrategy[Any]:
    """Any JSON value (what a peer that ignores the schema might send)."""
    leaves = st.none() | st.booleans() | st.integers(*INT64) | st.floats(allow_nan=False) | st.text(max_size=MAX_TEXT)
    return st.recursive(
        leaves,
        lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
        max_leaves=max_leaves,
    )


def wire_values(tp: Any, hints: Hints | None = None) -> st.SearchStrategy[Any]:
    return _strategy(mi.type_info(tp), dict(hints or {}), None)


def _strategy(info: mi.Type, hints: dict[str, st.SearchStrategy[Any]], field: str | None) -> st.SearchStrategy[Any]:
    hint = hints.get(field) if field is not None else None
    return _own(info, hints) if hint is None else hint


def _own(info: mi.Type, hints: dict[str, st.SearchStrategy[Any]]) -> st.SearchStrategy[Any]:
    match info:
        case mi.Metadata(type=inner):
            return _own(inner, hints)
        case mi.StructType():
            return _struct(info, hints)
        case mi.UnionType(types=types):
            return st.one_of([_own(t, hints) for t in types])
        case mi.LiteralType(values=values):
            return st.sampled_from(values)
        case mi.NoneType():
            return st.none()
        case mi.BoolType():
            return st.booleans()
        case mi.IntType():
            lows = [INT64[0], info.ge, None if info.gt is None else info.gt + 1]
            highs = [INT64[1], info.le, None if info.lt is None else info.lt - 1]
            return st.integers(max(v for v in lows if v is not None), min(v for v in highs if v is not None))
        case mi.FloatType():
            low = info.ge if info.ge is not None else info.gt
            high = info.le if info.le is not None else info.lt
            return st.floats(low, high, exclude_min=info.gt is not None, exclude_max=info.lt is not None,
                             allow_nan=low is None and high is None, allow_infinity=low is None or high is None)
        case mi.StrType(pattern=pattern):
            low, high = info.min_length or 0, info.max_length if info.max_length is not None else max(MAX_TEXT, info.min_length or 0)
            if pattern is not None:
                return st.from_regex(pattern, fullmatch=True).filter(lambda s: low <= len(s) <= high)
            return st.text(min_size=low, max_size=high)
        case mi.BytesType() | mi.ByteArrayType() | mi.MemoryViewType():
            return st.binary(max_size=MAX_TEXT)
        case mi.ListType() | mi.VarTupleType() | mi.SetType() | mi.FrozenSetType():
            low = info.min_length or 0
            high = info.max_length if info.max_length is not None else max(MAX_ITEMS, low)
            return st.lists(_own(info.item_type, hints), min_size=low, max_size=min(high, low + MAX_ITEMS))
        case mi.TupleType(item_types=items):
            return st.tuples(*(_own(t, hints) for t in items)).map(list)
        case mi.DictType() | mi.FrozenDictType():
            return st.dictionaries(_own(info.key_type, hints), _own(info.value_type, hints), max_size=MAX_ITEMS // 2)
        case mi.AnyType():
            return json_values()
    raise TypeError(f"no strategy for {info!r}")


def _struct(info: mi.StructType, hints: dict[str, st.SearchStrategy[Any]]) -> st.SearchStrategy[Any]:
    fields = [(f.encode_name, _strategy(f.type, hints, f.name)) for f in info.fields]
    tag = {} if info.tag_field is None else {info.tag_field: st.just(info.tag)}
    if info.array_like:
        # [tag?, field...]: trailing optional fields may be left out.
        # Up to the last required field (a kw_only one may follow fields with defaults).
        required = max((i + 1 for i, f in enumerate(info.fields) if f.required), default=0)
        head = [st.just(info.tag)] if info.tag_field is not None else []
        return st.integers(required, len(fields)).flatmap(
            lambda n: st.tuples(*head, *(s for _, s in fields[:n])).map(list))
    required = {name: s for (name, s), f in zip(fields, info.fields, strict=True) if f.required}
    optional = {name: s for (name, s), f in zip(fields, info.fields, strict=True) if not f.required}
    return st.fixed_dictionaries({**tag, **required}, optional=optional)


@st.composite
def near_misses(draw: st.DrawFn, tp: Any, hints: Hints | None = None) -> Any:
    """Values one step away from `tp`: a field dropped, retyped or added, the wrong container, an item replaced."""
    value = draw(wire_values(tp, hints))
    if isinstance(value, dict) and value:
        key = draw(st.sampled_from(sorted(value)))
        action = draw(st.sampled_from(["drop", "retype", "add", "list"]))
        value = dict(value)
        if action == "drop":
            del value[key]
        elif action == "retype":
            value[key] = draw(json_values(4))
        elif action == "add":
            value[draw(st.text(min_size=1, max_size=8))] = draw(json_values(2))
        else:
            return list(value.values())
        return value
    if isinstance(value, list) and value:
        index = draw(st.integers(0, len(value) - 1))
        return [*value[:index], draw(json_values(4)), *value[index + 1:]]
    return draw(json_values(4))


def encodes_as(tp: Any, value: Any) -> bool:
    """Whether msgspec reads `value` (builtins) as a valid `tp`."""
    try:
        msgspec.msgpack.Decoder(tp).decode(msgspec.msgpack.encode(value))
    except (msgspec.DecodeError, TypeError, OverflowError):
        return False
    return True
