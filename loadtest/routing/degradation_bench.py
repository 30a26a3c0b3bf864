"""Graceful degradation at 2x overload, in virtual time: what high-priority requests get with and without it.

The fleet's capacity is measured first (a closed loop that keeps it busy);
then an open-loop load at `--overload` times that runs, a share of its
sessions at priority 1, once with the balancer's degradation off (a plain
priority queue) and once with it on (low priorities get shorter answers
under overload, are shed at once when they would wait past their
deadline, and give their queue places to higher ones).

    python -m loadtest.routing.degradation_bench [--nodes 4] [--overload 2.0] [--duration 120]

Writes benchmarks/results/degradation/results.json.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import Counter
from pathlib import Path
from typing import Any

from loadtest.bench.command import jsonable
from loadtest.bench.client import RequestRecord
from loadtest.bench.metrics import Slo, meets_slo
from loadtest.simulation.sim_bench import capacity_rps, sim_spec
from loadtest.simulation.world import Simulation
from loadtest.bench.workloads import ArrivalSpec, WorkloadSpec

OUT = Path("benchmarks/results/degradation")
MODES = {
    "off": {"reduce_max_tokens": False, "shed": False, "evict_lower_when_full": False},
    "on": {"reduce_max_tokens": True, "shed": True, "evict_lower_when_full": True},
}


def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m loadtest.routing.degradation_bench", description=__doc__.split("\n\n")[0])
    parser.add_argument("--profile", default="h100-80g-llama3-8b")
    parser.add_argument("--workload", default="sharegpt", choices=["sharegpt", "shared-prefix", "multi-turn"])
    parser.add_argument("--nodes", type=int, default=4)
    parser.add_argument("--overload", type=float, default=2.0, help="offered load over the fleet's capacity")
    parser.add_argument("--high-share", type=float, default=0.3, help="share of sessions at priority 1")
    parser.add_argument("--duration", type=float, default=120.0)
    parser.add_argument("--ttft-slo-ms", type=float, default=1000.0)
    parser.add_argument("--tpot-slo-ms", type=float, default=100.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=OUT)
    return parser.parse_args(argv)


def by_class(records: list[RequestRecord], slo: Slo, span_s: float) -> dict[str, Any]:
    classes: dict[str, Any] = {}
    for priority in sorted({r.priority for r in records}):
        mine = [r for r in records if r.priority == priority]
        good = sum(1 for r in mine if r.ok and meets_slo(r, slo))
        classes[f"priority {priority}"] = {
            "requests": len(mine),
            "slo_attainment": good / len(mine) if mine else None,
            "goodput_rps": good / span_s if span_s else 0.0,
            "refused": dict(Counter(r.status for r in mine if not r.ok)),
            "shortened": sum(1 for r in mine if r.ok and (r.completion_tokens or 0) < r.max_tokens and r.finish_reason == "length"),
        }
    return classes


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    slo = Slo(args.ttft_slo_ms / 1000.0, args.tpot_slo_ms / 1000.0)
    workload = WorkloadSpec(kind=args.workload, seed=args.seed, groups=8, output_tokens=128, high_priority_share=args.high_share)
    capacity = capacity_rps(args.profile, args.nodes, workload)
    rate = args.overload * capacity
    offered = WorkloadSpec(**{**workload.__dict__, "arrival": ArrivalSpec(rate=rate), "duration_s": args.duration,
                              "max_requests": int(rate * args.duration * 1.5) + 100})
    runs = []
    for mode, switches in MODES.items():
        # The TTFT target that counts as overload is the SLO's.
        degradation = switches | {"ttft_target_s": slo.ttft_s}
        spec = sim_spec(args.profile, args.nodes, offered, args.duration, overrides={"balancer.degradation": degradation})
        result = Simulation(spec).run()
        classes = by_class(result.records, slo, args.duration)
        runs.append({"degradation": mode, "settings": degradation, "classes": classes, "counters": result.counters})
        print(f"degradation {mode:<3}  " + "  ".join(
            f"{name}: SLO {c['slo_attainment']:.1%} of {c['requests']}, goodput {c['goodput_rps']:.1f}/s, "
            f"refused {sum(c['refused'].values())}, shortened {c['shortened']}" for name, c in classes.items()))
    high_on, high_off = (next(r for r in runs if r["degradation"] == m)["classes"].get("priority 1", {}) for m in ("on", "off"))
    if high_on and high_off and high_off["slo_attainment"]:
        print(f"high priority: SLO attainment {high_on['slo_attainment'] / high_off['slo_attainment']:.2f}x with degradation")
    args.out.mkdir(parents=True, exist_ok=True)
    document = {"benchmark": "kvlane-degradation", "units": "simulated seconds (virtual time)",
                "parameters": jsonable(vars(args)) | {"capacity_rps": capacity, "offered_rps": rate}, "runs": runs}
    (args.out / "results.json").write_text(json.dumps(document, indent=2, default=str))
    print(f"the fleet serves {capacity:.1f} req/s; offered {rate:.1f} req/s; results in {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
