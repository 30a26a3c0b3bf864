"""A JSON instance of a JSON schema, drawn from a seeded random source (pure).

The sim engine answers structured-output requests and writes tool-call
arguments with these. It covers the subset of JSON Schema that structured
outputs use in practice: `type` (one or a list), `properties`, `required`,
`additionalProperties`, `enum`, `const`, `items`, `minItems`/`maxItems`,
`anyOf`, `oneOf`, `$ref` into the schema's own `$defs`/`definitions`, string
lengths and a few `format`s, number bounds; annotations (`title`,
`description`...) are ignored. A keyword outside that subset raises
`SchemaUnsupported` naming it: the sim would otherwise answer with JSON the
schema may not accept.

`random.Random` seeded with an int draws the same sequence on every CPython,
so an instance is a function of the schema and the seed: a request resumed
on another worker writes the same JSON.
"""

from __future__ import annotations

import math
import random
from collections.abc import Mapping
from typing import Any

# Keywords that say nothing about which instances are valid.
_ANNOTATIONS = frozenset({
    "title", "description", "default", "examples", "$schema", "$id", "$comment", "deprecated", "readOnly",
    "writeOnly", "$defs", "definitions", "strict", "discriminator", "nullable",
})
_CONSTRAINTS = frozenset({
    "type", "properties", "required", "additionalProperties", "enum", "const", "items", "minItems", "maxItems",
    "anyOf", "oneOf", "$ref", "minLength", "maxLength", "minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum",
    "format",
})
_FORMATS = {
    "date-time": "2026-01-02T03:04:05Z",
    "date": "2026-01-02",
    "time": "03:04:05",
    "email": "sim@example.com",
    "uuid": "00000000-0000-4000-8000-000000000000",
    "uri": "https://example.com/sim",
}
_TYPES = ("object", "array", "string", "number", "integer", "boolean", "null")
# Past this depth of objects and arrays only what is required is written, so recursive schemas end.
_DEPTH_OPTIONAL = 6
_DEPTH_LIMIT = 24
_LETTERS = "abcdefghijklmnopqrstuvwxyz"


class SchemaUnsupported(ValueError):
    """The schema asks for what the sim cannot write (the message says which keyword)."""


def schema_instance(schema: Any, rng: random.Random) -> Any:
    """An instance valid for `schema`, drawn from `rng`."""
    return _Writer(schema, rng).value(schema, 0)


def conforms(instance: Any, schema: Any, root: Any = None) -> bool:
    """Whether `instance` is valid for `schema`, for the subset `schema_instance` writes (to pick a `oneOf` branch)."""
    root = schema if root is None else root
    if schema is True or schema == {}:
        return True
    if schema is False or not isinstance(schema, Mapping):
        return False
    if "$ref" in schema and not conforms(instance, _resolve(root, schema["$ref"]), root):
        return False
    if "const" in schema and not _same(instance, schema["const"]):
        return False
    if "enum" in schema and not any(_same(instance, option) for option in schema["enum"]):
        return False
    if "anyOf" in schema and not any(conforms(instance, branch, root) for branch in schema["anyOf"]):
        return False
    if "oneOf" in schema and sum(conforms(instance, branch, root) for branch in schema["oneOf"]) != 1:
        return False
    types = schema.get("type")
    if types is not None and not any(_is_type(instance, t) for t in ([types] if isinstance(types, str) else types)):
        return False
    if isinstance(instance, dict):
        properties = schema.get("properties", {})
        if any(name not in instance for name in schema.get("required", ())):
            return False
        extra = schema.get("additionalProperties", True)
        for name, value in instance.items():
            if name in properties:
                if not conforms(value, properties[name], root):
                    return False
            elif not conforms(value, extra, root):
                return False
    elif isinstance(instance, list):
        if len(instance) < schema.get("minItems", 0) or len(instance) > schema.get("maxItems", math.inf):
            return False
        items = schema.get("items", True)
        if not all(conforms(item, items, root) for item in instance):
            return False
    elif isinstance(instance, str):
        if not schema.get("minLength", 0) <= len(instance) <= schema.get("maxLength", math.inf):
            return False
    elif _is_type(instance, "number"):
        low, high, low_open, high_open = _bounds(schema)
        if instance < low or instance > high or (low_open and instance == low) or (high_open and instance == high):
            return False
    return True


def _same(a: Any, b: Any) -> bool:
    # JSON equality: true is not 1, as Python's == would have it.
    return type(a) is type(b) and a == b if isinstance(a, bool) or isinstance(b, bool) else a == b


def _is_type(instance: Any, name: str) -> bool:
    if name == "null":
        return instance is None
    if name == "boolean":
        return isinstance(instance, bool)
    if name == "integer":
        return (isinstance(instance, int) and not isinstance(instance, bool)) or (
            isinstance(instance, float) and instance.is_integer())
    if name == "number":
        return isinstance(instance, int | float) and not isinstance(instance, bool)
    if name == "string":
        return isinstance(instance, str)
    if name == "array":
        return isinstance(instance, list)
    if name == "object":
        return isinstance(instance, dict)
    return False


def _resolve(root: Any, ref: Any) -> Any:
    if not isinstance(ref, str) or not ref.startswith("#"):
        raise SchemaUnsupported(f"$ref {ref!r}: only references into the schema itself (#/...) are supported")
    target = root
    for part in filter(None, ref[1:].split("/")):
        part = part.replace("~1", "/").replace("~0", "~")
        if not isinstance(target, Mapping) or part not in target:
            raise SchemaUnsupported(f"$ref {ref!r} names nothing in the schema")
        target = target[part]
    return target


def _bounds(schema: Mapping) -> tuple[float, float, bool, bool]:
    """(low, high, low excluded, high excluded) of a number schema."""
    low, high, low_open, high_open = -math.inf, math.inf, False, False
    for key in ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum"):
        value = schema.get(key)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise SchemaUnsupported(f"{key} {value!r}: a number is expected")
    if "minimum" in schema:
        low = schema["minimum"]
    if "exclusiveMinimum" in schema and schema["exclusiveMinimum"] >= low:
        low, low_open = schema["exclusiveMinimum"], True
    if "maximum" in schema:
        high = schema["maximum"]
    if "exclusiveMaximum" in schema and schema["exclusiveMaximum"] <= high:
        high, high_open = schema["exclusiveMaximum"], True
    return low, high, low_open, high_open


class _Writer:
    def __init__(self, root: Any, rng: random.Random) -> None:
        self._root = root
        self._rng = rng

    def value(self, schema: Any, depth: int) -> Any:
        if depth > _DEPTH_LIMIT:
            raise SchemaUnsupported("the schema requires nesting deeper than the sim writes (a required recursion?)")
        if schema is True:
            schema = {}
        if not isinstance(schema, Mapping):
            raise SchemaUnsupported(f"a schema must be an object, not {schema!r}")
        unknown = sorted(set(schema) - _ANNOTATIONS - _CONSTRAINTS)
        if unknown:
            raise SchemaUnsupported(f"JSON schema keyword {unknown[0]!r} is not supported by the sim engine")
        if "$ref" in schema:
            if set(schema) & _CONSTRAINTS != {"$ref"}:
                raise SchemaUnsupported("$ref beside other constraints is not supported by the sim engine")
            return self.value(_resolve(self._root, schema["$ref"]), depth + 1)
        if "const" in schema:
            return schema["const"]
        if "enum" in schema:
            options = schema["enum"]
            if not isinstance(options, list) or not options:
                raise SchemaUnsupported("enum must be a non-empty array")
            return self._rng.choice(options)
        if "anyOf" in schema or "oneOf" in schema:
            return self._one_of(schema, depth)
        kind = self._type(schema)
        if kind == "object":
            return self._object(schema, depth)
        if kind == "array":
            return self._array(schema, depth)
        if kind == "string":
            return self._string(schema)
        if kind in ("number", "integer"):
            return self._number(schema, kind == "integer")
        if kind == "boolean":
            return self._rng.random() < 0.5
        return None

    def _one_of(self, schema: Mapping, depth: int) -> Any:
        keyword = "anyOf" if "anyOf" in schema else "oneOf"
        if set(schema) & _CONSTRAINTS != {keyword}:
            raise SchemaUnsupported(f"{keyword} beside other constraints is not supported by the sim engine")
        branches = schema[keyword]
        if not isinstance(branches, list) or not branches:
            raise SchemaUnsupported(f"{keyword} must be a non-empty array")
        start = self._rng.randrange(len(branches))
        for offset in range(len(branches)):
            candidate = self.value(branches[(start + offset) % len(branches)], depth + 1)
            # oneOf: valid for exactly one branch; a value two branches accept is not an answer.
            if keyword == "anyOf" or sum(conforms(candidate, branch, self._root) for branch in branches) == 1:
                return candidate
        raise SchemaUnsupported("no oneOf branch gave a value that the other branches reject")

    def _type(self, schema: Mapping) -> str:
        declared = schema.get("type")
        if declared is None:
            if "properties" in schema or "required" in schema or "additionalProperties" in schema:
                return "object"
            if "items" in schema or "minItems" in schema or "maxItems" in schema:
                return "array"
            if {"minLength", "maxLength", "format"} & set(schema):
                return "string"
            if {"minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum"} & set(schema):
                return "number"
            return self._rng.choice(("string", "integer", "boolean"))
        options = [declared] if isinstance(declared, str) else declared
        if not isinstance(options, list) or not options or any(t not in _TYPES for t in options):
            raise SchemaUnsupported(f"type {declared!r} is not a JSON type")
        return self._rng.choice(options)

    def _object(self, schema: Mapping, depth: int) -> dict[str, Any]:
        properties = schema.get("properties", {})
        required = schema.get("required", [])
        if not isinstance(properties, Mapping) or not isinstance(required, list):
            raise SchemaUnsupported("properties must be an object and required an array")
        extra = schema.get("additionalProperties", True)
        written: dict[str, Any] = {}
        for name, subschema in properties.items():
            if name in required or (depth < _DEPTH_OPTIONAL and self._rng.random() < 0.5):
                written[name] = self.value(subschema, depth + 1)
        for name in required:
            if name not in properties:
                if extra is False:
                    raise SchemaUnsupported(f"required property {name!r} is neither declared nor allowed")
                written[name] = self.value(extra, depth + 1)
        # Declared order, as a model constrained by the schema writes them.
        order = {name: index for index, name in enumerate([*properties, *required])}
        return dict(sorted(written.items(), key=lambda item: order[item[0]]))

    def _array(self, schema: Mapping, depth: int) -> list[Any]:
        items = schema.get("items", True)
        if isinstance(items, list):
            raise SchemaUnsupported("items as an array (tuple validation) is not supported by the sim engine")
        low = schema.get("minItems", 0)
        high = schema.get("maxItems", low + 3)
        if not isinstance(low, int) or not isinstance(high, int) or low > high:
            raise SchemaUnsupported(f"minItems {low!r} and maxItems {high!r} admit no array")
        if depth >= _DEPTH_OPTIONAL:
            high = low
        return [self.value(items, depth + 1) for _ in range(self._rng.randint(low, min(high, low + 3)))]

    def _string(self, schema: Mapping) -> str:
        low = schema.get("minLength", 0)
        high = schema.get("maxLength", max(low, 12))
        if not isinstance(low, int) or not isinstance(high, int) or low > high:
            raise SchemaUnsupported(f"minLength {low!r} and maxLength {high!r} admit no string")
        if "format" in schema:
            fixed = _FORMATS.get(schema["format"])
            if fixed is None:
                raise SchemaUnsupported(f"string format {schema['format']!r} is not supported by the sim engine")
            if not low <= len(fixed) <= schema.get("maxLength", len(fixed)):
                raise SchemaUnsupported("a formatted string with length bounds is not supported by the sim engine")
            return fixed
        length = self._rng.randint(low, min(high, low + 12))
        return "".join(self._rng.choice(_LETTERS) for _ in range(length))

    def _number(self, schema: Mapping, integer: bool) -> int | float:
        low, high, low_open, high_open = _bounds(schema)
        # An unbounded side lies a hundred past the other bound (or zero).
        if low == -math.inf:
            low, low_open = (high - 100 if high != math.inf else -100), False
        if high == math.inf:
            high, high_open = low + 100, False
        if integer:
            first = math.floor(low) + 1 if low_open and float(low).is_integer() else math.ceil(low)
            last = math.ceil(high) - 1 if high_open and float(high).is_integer() else math.floor(high)
            if first > last:
                raise SchemaUnsupported(f"no integer lies between {low} and {high}")
            return self._rng.randint(int(first), int(last))
        if low > high or (low == high and (low_open or high_open)):
            raise SchemaUnsupported(f"no number lies between {low} and {high}")
        drawn = self._rng.uniform(low, high)
        for candidate in (round(drawn, 2), drawn, (low + high) / 2):
            if low <= candidate <= high and not (low_open and candidate == low) and not (high_open and candidate == high):
                return candidate
        raise SchemaUnsupported(f"no number found between {low} and {high}")
