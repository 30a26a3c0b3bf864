"""Where an engine holds its LoRA adapters, as vLLM does (pure).

vLLM keeps at most `max_loras` adapters in the slots a batch runs with (on the
GPU) and at most `max_cpu_loras` loaded in host memory, each tier dropping its
least recently used adapter for a new one. A request can run only once its
adapter has a slot; a slot whose adapter still has running requests cannot
be given up, so a request for yet another adapter waits. What a start costs
depends on where the adapter was: nothing in a slot, a copy from host
memory, or a fetch and a load.
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from typing import Literal

Residence = Literal["slot", "host", "none"]


class AdapterSlots:
    def __init__(self, max_loras: int, max_cpu_loras: int) -> None:
        if max_loras < 1:
            raise ValueError("an engine that serves adapters has at least one slot (max_loras >= 1)")
        self.max_loras = max_loras
        # vLLM's host cache holds at least what the slots do.
        self.max_cpu_loras = max(max_cpu_loras, max_loras)
        self._running: Counter[str] = Counter()
        # Least recently used first.
        self._slots: OrderedDict[str, None] = OrderedDict()
        self._host: OrderedDict[str, None] = OrderedDict()

    def residence(self, adapter: str) -> Residence:
        return "slot" if adapter in self._slots else "host" if adapter in self._host else "none"

    def can_start(self, adapter: str) -> bool:
        """Whether a request for `adapter` can run now: its adapter is in a slot, or a slot is free or idle."""
        return adapter in self._slots or len(self._slots) < self.max_loras or any(
            name not in self._running for name in self._slots)

    def start(self, adapter: str) -> tuple[Residence, list[str]]:
        """A request for `adapter` starts (`can_start` must hold): where the adapter was, and the adapters
        dropped from host memory to make room for it."""
        if not self.can_start(adapter):
            raise RuntimeError(f"no slot for adapter {adapter}: every slot runs requests")
        was = self.residence(adapter)
        self._running[adapter] += 1
        if adapter not in self._slots and len(self._slots) >= self.max_loras:
            idle = next(name for name in self._slots if name not in self._running)
            del self._slots[idle]
        self._slots[adapter] = None
        self._slots.move_to_end(adapter)
        self._host[adapter] = None
        self._host.move_to_end(adapter)
        dropped: list[str] = []
        while len(self._host) > self.max_cpu_loras:
            oldest = next(name for name in self._host if name not in self._slots)
            del self._host[oldest]
            dropped.append(oldest)
        return was, dropped

    def finish(self, adapter: str) -> None:
        """A request for `adapter` ended; its adapter stays in its slot until another needs the slot."""
        self._running[adapter] -= 1
        if self._running[adapter] <= 0:
            del self._running[adapter]

    def in_slots(self) -> list[str]:
        return list(self._slots)

    def in_host_only(self) -> list[str]:
        return [name for name in self._host if name not in self._slots]

    def running(self) -> dict[str, int]:
        return dict(self._running)
