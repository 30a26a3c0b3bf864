"""The autoscaler against fixed fleets, in virtual time: a load that steps from 20% to 150% of one node's capacity and back.

One node's capacity is measured first (a closed loop that keeps it busy).
Then the same stepped open-loop load runs on an autoscaled fleet (the
autoscaler's real core deciding, nodes taking `--node-start` seconds to
come up, the newest draining first) and on fixed fleets of 1 and of
enough nodes for the peak. For each: SLO attainment per phase and in
all, and node-seconds (what the fleet cost). A plot shows replicas over
time beside the offered load.

    python -m loadtest.routing.autoscale_bench [--phase 180] [--low 0.2] [--high 1.5]

Writes benchmarks/results/autoscale/results.json and autoscale.png.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path
from typing import Any

from loadtest.bench.command import jsonable
from loadtest.bench.client import RequestRecord
from loadtest.bench.metrics import Slo, meets_slo, summarize
from loadtest.simulation.sim_bench import capacity_rps, sim_spec
from loadtest.simulation.world import Simulation, SimulationResult
from loadtest.bench.workloads import ArrivalSpec, WorkloadSpec
from shared.config import AutoscalerSettings, PoolBounds

OUT = Path("benchmarks/results/autoscale")


def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m loadtest.routing.autoscale_bench", description=__doc__.split("\n\n")[0])
    parser.add_argument("--profile", default="h100-80g-llama3-8b")
    parser.add_argument("--workload", default="sharegpt", choices=["sharegpt", "shared-prefix", "multi-turn"])
    parser.add_argument("--phase", type=float, default=180.0, help="seconds of each load phase (low, high, low)")
    parser.add_argument("--low", type=float, default=0.2, help="load of the quiet phases, as a share of one node's capacity")
    parser.add_argument("--high", type=float, default=1.5, help="load of the busy phase")
    parser.add_argument("--max-replicas", type=int, default=4)
    parser.add_argument("--node-start", type=float, default=10.0, help="seconds a new node takes to serve")
    parser.add_argument("--ttft-slo-ms", type=float, default=500.0)
    parser.add_argument("--tpot-slo-ms", type=float, default=50.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=OUT)
    return parser.parse_args(argv)


def _workload(args: argparse.Namespace, arrival: ArrivalSpec, duration_s: float, max_requests: int) -> WorkloadSpec:
    return WorkloadSpec(kind=args.workload, seed=args.seed, max_requests=max(1, max_requests), arrival=arrival,
                        duration_s=duration_s, groups=8, output_tokens=128)


def phase_of(record: RequestRecord, phase_s: float) -> str:
    return ("low", "high", "low again")[min(2, int(record.scheduled_s // phase_s))]


def report(name: str, result: SimulationResult, slo: Slo, phase_s: float) -> dict[str, Any]:
    records = result.records
    phases: dict[str, dict[str, Any]] = {}
    for phase in ("low", "high", "low again"):
        mine = [r for r in records if phase_of(r, phase_s) == phase]
        good = sum(1 for r in mine if r.ok and meets_slo(r, slo))
        phases[phase] = {"requests": len(mine), "slo_attainment": good / len(mine) if mine else None}
    nodes = len({r.worker_id for r in result.runs.values()}) if result.runs else 0
    node_seconds = result.scaling.node_seconds if result.scaling else None
    summary = summarize(records, slo, result.runs)
    return {
        "fleet": name,
        "slo_attainment": summary["slo_attainment"],
        "goodput_rps": summary["goodput_rps"],
        "ttft_p99_ms": summary["ttft_ms"].get("p99") if summary["ttft_ms"] else None,
        "phases": phases,
        "node_seconds": node_seconds,
        "nodes_used": nodes,
        "timeline": [list(p) for p in result.scaling.points] if result.scaling else [],
    }


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    slo = Slo(args.ttft_slo_ms / 1000.0, args.tpot_slo_ms / 1000.0)
    per_node = capacity_rps(args.profile, 1, _workload(args, ArrivalSpec(mode="closed"), 60.0, 0))
    low, high = args.low * per_node, args.high * per_node
    arrival = ArrivalSpec(rate=low, steps=((args.phase, high), (2 * args.phase, low)))
    total_s = 3 * args.phase
    budget = int(total_s * high * 2) + 100
    autoscaling = AutoscalerSettings(ttft_p99_s=slo.ttft_s, tpot_p99_s=slo.tpot_s, aggregated=PoolBounds(min=1, max=args.max_replicas),
                                     up_cooldown_s=max(15.0, args.node_start + 5.0))
    peak_nodes = max(1, math.ceil(args.high))
    runs = [("autoscaled (1..%d)" % args.max_replicas, 1, autoscaling), ("fixed 1 node", 1, None),
            (f"fixed {peak_nodes} nodes", peak_nodes, None)]
    results = []
    for name, nodes, scaling in runs:
        spec = sim_spec(args.profile, nodes, _workload(args, arrival, total_s, budget), total_s, autoscaling=scaling,
                        node_start_s=args.node_start)
        result = Simulation(spec).run()
        entry = report(name, result, slo, args.phase)
        if entry["node_seconds"] is None:
            entry["node_seconds"] = nodes * result.simulated_s
        results.append(entry)
        phases = ", ".join(f"{p} {v['slo_attainment']:.0%}" for p, v in entry["phases"].items() if v["slo_attainment"] is not None)
        print(f"{name:<22} SLO attainment {entry['slo_attainment']:.1%} ({phases}); node-seconds {entry['node_seconds']:.0f}")
    document = {
        "benchmark": "kvlane-autoscale",
        "units": "simulated seconds (virtual time)",
        "parameters": jsonable(vars(args)) | {"capacity_rps_per_node": per_node, "low_rps": low, "high_rps": high,
                                               "autoscaler": jsonable(autoscaling)},
        "runs": results,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "results.json").write_text(json.dumps(document, indent=2))
    plot(document, args.out / "autoscale.png")
    print(f"one node serves {per_node:.2f} req/s; results in {args.out}")
    return 0


def plot(document: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    params = document["parameters"]
    phase = params["phase"]
    fig, (load_ax, bars) = plt.subplots(1, 2, figsize=(12, 4), gridspec_kw={"width_ratios": [2, 1]})
    scaled = next(r for r in document["runs"] if r["timeline"])
    times = [p[0] for p in scaled["timeline"]]
    load_ax.step(times, [p[2] for p in scaled["timeline"]], where="post", label="serving replicas")
    load_ax.step(times, [p[3] for p in scaled["timeline"]], where="post", linestyle="--", label="desired replicas")
    offered = load_ax.twinx()
    capacity_rps = params["capacity_rps_per_node"]
    edges = [0, phase, phase, 2 * phase, 2 * phase, 3 * phase]
    shares = [params["low"], params["low"], params["high"], params["high"], params["low"], params["low"]]
    offered.plot(edges, shares, color="grey", alpha=0.6, label="offered load (x one node)")
    offered.set_ylabel("offered load, x one node's capacity")
    load_ax.set_xlabel("simulated seconds")
    load_ax.set_ylabel("replicas")
    load_ax.set_title(f"autoscaled fleet (one node: {capacity_rps:.2f} req/s)")
    load_ax.legend(loc="upper left")
    names = [r["fleet"] for r in document["runs"]]
    bars.bar(names, [100 * (r["slo_attainment"] or 0) for r in document["runs"]])
    for index, run in enumerate(document["runs"]):
        bars.text(index, 2, f"{run['node_seconds']:.0f} node-s", ha="center", color="white")
    bars.set_ylabel("SLO attainment, %")
    bars.set_ylim(0, 100)
    bars.tick_params(axis="x", labelrotation=15)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(main())
