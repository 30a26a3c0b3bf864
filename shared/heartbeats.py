"""What a worker puts on the wire for each heartbeat: the full one, or its load only.

A registration (model, inbox, block size, step-time profile...) is most of a
heartbeat's bytes and changes rarely, while every receiver decodes every
heartbeat of every node each second. `HeartbeatSender` sends the full
`Heartbeat` when the registration is new or changed, and every
`full_every`th beat so a receiver that missed one catches up; in between a
`LoadReport` that names the registration by digest. Redis always gets the
full heartbeat, so a receiver that starts late learns every registration
at its first resync. Receivers join the two in `ClusterView.assemble`.
"""

from __future__ import annotations

import hashlib

import msgspec

from contracts.messages import EngineStats, Heartbeat, HeartbeatMessage, LoadReport, PackedStats, WorkerRegistration


def registration_digest(registration: WorkerRegistration) -> int:
    """A 48-bit digest of the registration's content (it stays an exact number in any JSON reader)."""
    encoded = msgspec.msgpack.encode(registration)
    return int.from_bytes(hashlib.blake2b(encoded, digest_size=6).digest(), "big")


class HeartbeatSender:
    """Pure: per beat, the full heartbeat (for Redis) and what goes on the wire."""

    def __init__(self, full_every: int) -> None:
        if full_every < 1:
            raise ValueError(f"full_every must be at least 1, not {full_every}")
        self._full_every = full_every
        self._registration: WorkerRegistration | None = None
        self._digest = 0
        self._beats_since_full = 0

    def beat(self, registration: WorkerRegistration, stats: EngineStats, sent_at: float, seq: int,
             draining: bool) -> tuple[Heartbeat, HeartbeatMessage]:
        changed = registration != self._registration
        if changed:
            self._registration = registration
            self._digest = registration_digest(registration)
        full = Heartbeat(registration, stats, sent_at, seq, draining, self._digest)
        self._beats_since_full += 1
        if changed or self._beats_since_full >= self._full_every:
            self._beats_since_full = 0
            return full, full
        return full, LoadReport(registration.worker_id, PackedStats(*msgspec.structs.astuple(stats)), sent_at, seq, self._digest, draining)
