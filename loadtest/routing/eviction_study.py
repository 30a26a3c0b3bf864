"""Which running request gives its KV up for a higher-priority one: retention value or LRU, in virtual time.

When the chosen node has no KV room for a request, the cache-manager's
core (`shared.kv.allocation.plan_preemption`) may preempt running requests
of a strictly lower priority. `cache_manager.eviction` picks them: by
retention value (priority x the share of output still to come, less the
blocks freed per block needed; the lowest goes first) or LRU (the oldest
lease first). Everything else is the same run: kvlane's routing policy,
slots and central queue, leases with short and general pools, and
`SimScheduler`'s own prefix-cache eviction (least recently freed blocks
first, in both arms).

Each (rate, eviction) pair is one `kvlane simulate` run of a shared-prefix
workload with a share of high-priority sessions on a fleet whose KV is
scarce. Reported per priority class: SLO attainment and goodput; per run:
prefix hit rate, preemptions and KV refusals.

    python -m loadtest.routing.eviction_study [--fleet h100-80g-llama3-8b:4] [--rates 30,40] [--num-blocks 2500] [--slot-tokens 1024]

Writes `results.json` and `study.md` under `--out`.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from launch.fleet import with_overrides
from launch.fleet_mix import fleet_nodes, parse_fleet
from loadtest.bench.command import RESULTS_DIR, jsonable
from loadtest.bench.run import FleetSpec
from loadtest.routing.degradation_bench import by_class
from loadtest.bench.driver import DriveLimits
from loadtest.bench.metrics import Slo, span_s, summarize
from loadtest.simulation.command import simulation_config
from loadtest.simulation.world import Simulation, SimulationSpec
from loadtest.bench.workloads import ArrivalSpec, WorkloadSpec
from shared.config import KvlaneConfig

EVICTIONS = ("retention", "lru")
REQUEST_TIMEOUT_S = 60.0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m loadtest.routing.eviction_study", description=__doc__.split("\n\n")[0])
    parser.add_argument("--fleet", default="h100-80g-llama3-8b:4", help="PROFILE[@SPEED]:COUNT,... (aggregated nodes)")
    parser.add_argument("--policy", default="jffc_per_request")
    parser.add_argument("--rates", default="30,40", help="comma-separated open-loop rates (req/s)")
    parser.add_argument("--duration", type=float, default=20.0, help="simulated seconds of arrivals per run")
    parser.add_argument("--num-blocks", type=int, default=2500, help="KV blocks per node (16 tokens each): the pressure")
    parser.add_argument("--groups", type=int, default=64)
    parser.add_argument("--system-tokens", type=int, default=2048)
    parser.add_argument("--question-tokens", type=int, default=128)
    parser.add_argument("--output-tokens", type=int, default=256)
    parser.add_argument("--high-share", type=float, default=0.2, help="share of sessions at priority 1")
    parser.add_argument("--slot-tokens", type=int, default=0,
                        help="size each node's slots for requests of this many tokens instead of learning the size "
                             "(below the workload's own, the balancer admits more than the KV holds and leases decide); "
                             "0: learned")
    parser.add_argument("--ttft-slo-ms", type=float, default=2000.0)
    parser.add_argument("--tpot-slo-ms", type=float, default=100.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=RESULTS_DIR / "eviction-study")
    return parser


def spec_for(args: argparse.Namespace, rate: float, eviction: str) -> SimulationSpec:
    nodes = tuple(fleet_nodes(parse_fleet(args.fleet)))
    fleet = FleetSpec(workers=len(nodes), profile=nodes[0].profile, seed=args.seed, num_blocks=args.num_blocks)
    overrides: dict[str, dict[str, Any]] = {"cache_manager": {"eviction": eviction}}
    if args.slot_tokens:
        output = min(args.output_tokens, args.slot_tokens - 1)
        overrides["balancer.slots"] = {"learn_request_size": False, "typical_prompt_tokens": args.slot_tokens - output,
                                       "typical_output_tokens": output}
    config = with_overrides(simulation_config(KvlaneConfig(), fleet, args.policy, REQUEST_TIMEOUT_S), **overrides)
    workload = WorkloadSpec(
        kind="shared-prefix", seed=args.seed, max_requests=int(rate * args.duration * 1.5) + 100, duration_s=args.duration,
        arrival=ArrivalSpec(rate=rate), groups=args.groups, system_tokens=args.system_tokens,
        question_tokens=args.question_tokens, output_tokens=args.output_tokens, high_priority_share=args.high_share,
    )
    limits = DriveLimits(issue_for_s=args.duration, hard_stop_s=args.duration + REQUEST_TIMEOUT_S + 5.0)
    return SimulationSpec(config, nodes, workload, limits, REQUEST_TIMEOUT_S)


def run_one(args: argparse.Namespace, rate: float, eviction: str, slo: Slo) -> dict[str, Any]:
    result = Simulation(spec_for(args, rate, eviction)).run()
    summary = summarize(result.records, slo, result.runs)
    return {
        "rate": rate, "eviction": eviction, "classes": by_class(result.records, slo, span_s(result.records)),
        "slo_attainment": summary["slo_attainment"], "goodput_rps": summary["goodput_rps"],
        "prefix_cache_hit_rate": summary["prefix_cache_hit_rate"], "ttft_p99_ms": summary["ttft_ms"]["p99"],
        "lease_preemptions": result.counters["lease_preemptions"], "kv_refusals": result.counters["kv_refusals"],
        "wall_s": result.wall_s,
    }


def markdown(runs: list[dict[str, Any]]) -> str:
    lines = ["| rate (req/s) | eviction | attainment p1 / p0 | goodput p1 / p0 (req/s) | attainment all | hit rate | "
             "preemptions | KV refusals |", "|---|---|---|---|---|---|---|---|"]
    for run in runs:
        high, low = run["classes"].get("priority 1", {}), run["classes"].get("priority 0", {})
        fmt = lambda v, spec: "-" if v is None else format(v, spec)  # noqa: E731
        lines.append(
            f"| {run['rate']:g} | {run['eviction']} | {fmt(high.get('slo_attainment'), '.3f')} / {fmt(low.get('slo_attainment'), '.3f')} | "
            f"{fmt(high.get('goodput_rps'), '.1f')} / {fmt(low.get('goodput_rps'), '.1f')} | {fmt(run['slo_attainment'], '.3f')} | "
            f"{fmt(run['prefix_cache_hit_rate'], '.3f')} | {run['lease_preemptions']} | {run['kv_refusals']} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        rates = [float(r) for r in args.rates.split(",") if r.strip()]
        parse_fleet(args.fleet)
    except ValueError as exc:
        print(f"eviction_study: {exc}", file=sys.stderr)
        return 2
    if not rates or min(rates) <= 0 or not 0.0 <= args.high_share <= 1.0 or args.num_blocks < 1 or args.slot_tokens == 1 or args.slot_tokens < 0:
        print("eviction_study: rates must be positive, --high-share in [0, 1], --num-blocks at least 1, "
              "--slot-tokens 0 or at least 2", file=sys.stderr)
        return 2
    slo = Slo(args.ttft_slo_ms / 1000.0, args.tpot_slo_ms / 1000.0)
    runs = []
    for rate in rates:
        for eviction in EVICTIONS:
            run = run_one(args, rate, eviction, slo)
            runs.append(run)
            print(markdown([run]).splitlines()[-1], flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    document = {"benchmark": "kvlane-eviction-study", "units": "simulated seconds (virtual time)",
                "parameters": jsonable(vars(args)), "runs": runs}
    (args.out / "results.json").write_text(json.dumps(document, indent=1, default=str) + "\n")
    (args.out / "study.md").write_text(markdown(runs))
    print(markdown(runs))
    return 0


if __name__ == "__main__":
    sys.exit(main())
