"""LoRA adapters in a benchmark's workload (pure): the options `kvlane bench` and `kvlane simulate` share.

`--adapters N` runs every session with one of N adapters (`adapter-0` ...,
drawn by `--adapter-popularity zipf:S`), and gives every node `--max-loras`
batch slots (`worker.lora`). Both commands report the nodes' adapter loads
per 1,000 requests measured (`adapter_summary`), each from its own counts:
the simulator's schedulers, or the live workers' heartbeats.
"""

from __future__ import annotations

import argparse
import math
from typing import Any

import msgspec

from shared.config import KvlaneConfig

# Slots a node gets with --adapters when --max-loras is not given: vLLM's own default for --max-loras.
DEFAULT_MAX_LORAS = 4


def adapter_popularity(value: str) -> float:
    """The Zipf exponent S of `--adapter-popularity zipf:S` (0: every adapter as popular as any other)."""
    kind, _, exponent = value.partition(":")
    try:
        parsed = float(exponent)
    except ValueError:
        parsed = -1.0
    if kind != "zipf" or not math.isfinite(parsed) or parsed < 0:
        raise argparse.ArgumentTypeError(f"{value!r}: expected zipf:S with S a number 0 or more (zipf:1.1, say)")
    return parsed


def count_option(value: str) -> int:
    """A count of 0 or more."""
    try:
        parsed = int(value)
    except ValueError:
        parsed = -1
    if parsed < 0:
        raise argparse.ArgumentTypeError(f"{value!r}: expected a whole number, 0 or more")
    return parsed


def add_lora_arguments(parser: argparse.ArgumentParser) -> None:
    lora = parser.add_argument_group("LoRA adapters")
    lora.add_argument("--adapters", type=count_option, default=0, metavar="N",
                      help="every session runs with one of N LoRA adapters, adapter-0 ..., named as its requests' "
                           "model (0: the base model); kvlane bench publishes N tiny adapters to each fleet first")
    lora.add_argument("--adapter-popularity", type=adapter_popularity, default="zipf:1.0", metavar="zipf:S",
                      help="how sessions pick their adapter: adapter-k with weight 1 / (k + 1)^S")
    lora.add_argument("--max-loras", type=count_option, metavar="K",
                      help="adapters a node's batches run with at once, as vLLM's --max-loras "
                           f"(default {DEFAULT_MAX_LORAS} with --adapters, else worker.lora.max_loras)")
    lora.add_argument("--max-cpu-loras", type=count_option, metavar="C",
                      help="adapters a node keeps in host memory, as vLLM's --max-cpu-loras "
                           "(default: worker.lora.max_cpu_loras; 0 there: as many as --max-loras, as vLLM)")


def lora_option_error(args: argparse.Namespace) -> str | None:
    """What is wrong with the LoRA options together (each alone is checked as it is parsed); None: nothing."""
    if args.adapters and args.max_loras is not None and args.max_loras < 1:
        return "--adapters needs nodes with adapter slots (--max-loras of 1 or more)"
    return None


def lora_sections(args: argparse.Namespace) -> dict[str, dict[str, Any]]:
    """The `worker.lora` fields the LoRA options set (none without them); ValueError for options that do not fit."""
    if error := lora_option_error(args):
        raise ValueError(error)
    lora: dict[str, Any] = {}
    max_loras = args.max_loras if args.max_loras is not None else DEFAULT_MAX_LORAS if args.adapters else None
    if max_loras is not None:
        lora["max_loras"] = max_loras
    if args.max_cpu_loras is not None:
        lora["max_cpu_loras"] = args.max_cpu_loras
    return {"worker.lora": lora} if lora else {}


def lora_info(config: KvlaneConfig) -> dict[str, Any]:
    """What results record of the nodes' adapter settings: their slots and what a load costs the sim."""
    sim = config.worker.sim
    return msgspec.to_builtins(config.worker.lora) | {"adapter_activate_s": sim.adapter_activate_s,
                                                      "adapter_load_s": sim.adapter_load_s}


def per_1k(count: int, requests: int) -> float | None:
    return 1000.0 * count / requests if requests else None


def adapter_summary(measured_loads: int, measured_requests: int, all_loads: int, all_requests: int) -> dict[str, Any]:
    """The nodes' adapter loads into batch slots: from the warm-up's end on per 1,000 requests measured (in a
    steady state the loads of those requests), and over the whole run, warm-up included."""
    return {"loads": measured_loads, "loads_per_1k": per_1k(measured_loads, measured_requests),
            "loads_whole_run": all_loads, "loads_per_1k_whole_run": per_1k(all_loads, all_requests)}
