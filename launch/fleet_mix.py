"""A fleet of several node kinds: `--fleet h100-80g-llama3-8b:4,a100-80g-llama3-8b:4`.

Each comma-separated item is `PROFILE[@SPEED]:COUNT`: COUNT nodes running
the named sim step-time profile (or `file:<path>` of a calibrated one) at
SPEED times the profile's speed (default 1; a straggler is below 1). Nodes
are numbered in the order given, w0, w1, ..., as `kvlane up` names workers.
"""

from __future__ import annotations

import math

from msgspec import Struct

from contracts.messages import WorkerRole

from shared.kv.step_profile import get_profile


class NodeKind(Struct, frozen=True):
    profile: str
    count: int
    speed: float = 1.0

    @property
    def label(self) -> str:
        return self.profile if self.speed == 1.0 else f"{self.profile}@{self.speed:g}"


class FleetNode(Struct, frozen=True):
    worker_id: str
    profile: str
    speed: float = 1.0
    role: WorkerRole = "aggregated"


def parse_fleet(text: str) -> list[NodeKind]:
    """The node kinds of a `--fleet` value; ValueError saying what is wrong."""
    kinds = []
    for item in (part.strip() for part in text.split(",")):
        if not item:
            continue
        name, sep, count_text = item.rpartition(":")
        if not sep or not name:
            raise ValueError(f"fleet item {item!r}: expected PROFILE[@SPEED]:COUNT")
        profile, at, speed_text = name.partition("@")
        try:
            count = int(count_text)
            speed = float(speed_text) if at else 1.0
        except ValueError:
            raise ValueError(f"fleet item {item!r}: COUNT must be an integer and SPEED a number") from None
        if count < 1 or not math.isfinite(speed) or speed <= 0:
            raise ValueError(f"fleet item {item!r}: COUNT must be at least 1 and SPEED positive")
        try:
            get_profile(profile)
        except KeyError as exc:
            raise ValueError(f"fleet item {item!r}: {exc.args[0]}") from None
        kinds.append(NodeKind(profile, count, speed))
    if not kinds:
        raise ValueError("the fleet is empty")
    return kinds


_PREFIXES: dict[WorkerRole, str] = {"aggregated": "w", "prefill": "p", "decode": "d"}


def fleet_nodes(kinds: list[NodeKind], role: WorkerRole = "aggregated") -> list[FleetNode]:
    """Nodes of `role`, numbered as `kvlane up` names them: w0... (aggregated), p0... (prefill), d0... (decode)."""
    nodes: list[FleetNode] = []
    for kind in kinds:
        for _ in range(kind.count):
            nodes.append(FleetNode(f"{_PREFIXES[role]}{len(nodes)}", kind.profile, kind.speed, role))
    return nodes


def describe(kinds: list[NodeKind]) -> str:
    return ",".join(f"{kind.label}:{kind.count}" for kind in kinds)
