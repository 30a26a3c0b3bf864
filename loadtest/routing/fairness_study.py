"""Fair share between tenants under overload: the central queue's tenant order against arrival order, in virtual time.

The fleet is 8 H100 + 8 A100 sim nodes (`routing_study`'s mixed fleet)
serving `routing_study`'s shared-prefix workload with jffc_per_request.
First, the fleet's capacity (the highest rate with >= 90% of requests, and
of the last quarter of arrivals, within the SLO) with one tenant. Then, at
twice that rate:

* **Two tenants.** A sends 10x B's rate; both have weight 1 and priority 0.
  Compared: fair share (`balancer.queue.fair_share`, the default) and
  arrival order (`fair_share = false`: today's FIFO within a class).
  Reported: each tenant's SLO attainment and TTFT p99, the goodput (requests
  within the SLO per second), and the throughput (requests and tokens
  completed per second).
* **Sixteen tenants** of mixed rates (shares 1, 2, 4 and 8, four tenants
  each), weight 1, and the same sixteen with weights 1 and 2 alternating:
  Jain's index of served tokens per weight over the backlogged tenants
  (those that asked for more than a max-min fair split of what was served
  would give them; `loadtest.bench.metrics.tenant_summary`).

Targets: with fair share, B's attainment >= 0.95; goodput and throughput
>= 0.97x arrival order's; Jain's index >= 0.95 over the backlogged
tenants. Everything is in simulated time. Writes `study.json` and
`study.md` under `--out`.

    python -m loadtest.routing.fairness_study --quick      # shorter runs, a coarser capacity
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from loadtest.bench.command import RESULTS_DIR
from loadtest.routing.routing_study import (A100, ATTAINMENT, H100, NUM_BLOCKS, SLO, WORKLOADS, run_simulate, search_capacity,
                                            sustained_attainment)

FLEET = f"{H100}:8,{A100}:8"
POLICY = "jffc_per_request"
OVERLOAD = 2.0
TWO_TENANTS = "a:10,b:1"
MIXED = ",".join(f"t{k:02d}:{share}" for k, share in enumerate(s for s in (1, 2, 4, 8) for _ in range(4)))
MIXED_WEIGHTED = ",".join(f"t{k:02d}:{share}:{1 + k % 2}" for k, share in enumerate(s for s in (1, 2, 4, 8) for _ in range(4)))
TARGETS = {"b_attainment": 0.95, "goodput_vs_fifo": 0.97, "throughput_vs_fifo": 0.97, "jain_index": 0.95}
# Where the capacity search starts (requests per second the fleet serves within the SLO, roughly).
GUESS = 180.0


def simulate(base: list[str], rate: float, out: Path, fair: bool, tenants: str | None = None) -> dict[str, Any]:
    """One run at `rate`, with the queue's tenant order or arrival order; its results.json's one run."""
    out.mkdir(parents=True, exist_ok=True)
    config = out / "queue.toml"
    config.write_text(f"[balancer.queue]\nfair_share = {'true' if fair else 'false'}\n")
    argv = [*base, "--policies", POLICY, "--rate", f"{rate:.6g}", "--config", str(config), "--out", str(out),
            *(["--tenants", tenants] if tenants else [])]
    return next(r for r in run_simulate(argv)["runs"] if "summary" in r)


def outcome(run: dict[str, Any]) -> dict[str, Any]:
    summary = run["summary"]
    tenants = summary["tenants"]
    return {
        "attainment": summary["slo_attainment"], "goodput_rps": summary["goodput_rps"],
        "throughput_rps": summary["request_throughput_rps"], "tokens_per_s": summary["total_token_throughput_tps"],
        "failed": summary["failed"], "errors": summary["errors"],
        "tenants": {name: {"attainment": t["slo_attainment"], "ttft_p99_ms": t["ttft_p99_ms"], "requests": t["requests"],
                           "served_tokens_per_weight": t["served_tokens_per_weight"], "backlogged": t["backlogged"]}
                    for name, t in tenants["per_tenant"].items()},
        "jain_index_backlogged": tenants["jain_index_backlogged"],
    }


def ratio(value: float | None, reference: float | None) -> float | None:
    return value / reference if value is not None and reference else None


def study(base: list[str], resolution: float, where: Path) -> dict[str, Any]:
    search = search_capacity(lambda rate: sustained_attainment(simulate(base, rate, where / "capacity" / f"{rate:.6g}", True)["summary"]),
                             GUESS, resolution)
    print(f"capacity {search.capacity:.4g} req/s {search.probes}", flush=True)
    rate = OVERLOAD * search.capacity
    two = {label: outcome(simulate(base, rate, where / "two" / label, fair, TWO_TENANTS))
           for label, fair in (("fair", True), ("fifo", False))}
    mixed = {label: outcome(simulate(base, rate, where / label, True, tenants))
             for label, tenants in (("sixteen", MIXED), ("sixteen_weighted", MIXED_WEIGHTED))}
    fair, fifo = two["fair"], two["fifo"]
    checks = {
        "b_attainment": fair["tenants"]["b"]["attainment"],
        "goodput_vs_fifo": ratio(fair["goodput_rps"], fifo["goodput_rps"]),
        "throughput_vs_fifo": ratio(fair["tokens_per_s"], fifo["tokens_per_s"]),
        "jain_index": min((m["jain_index_backlogged"] or 0.0) for m in mixed.values()),
    }
    met = {name: value is not None and value >= TARGETS[name] for name, value in checks.items()}
    if fifo["goodput_rps"] == 0.0:
        # Arrival order serves nobody within the SLO: any goodput at all is more.
        met["goodput_vs_fifo"] = fair["goodput_rps"] > 0.0
    return {"capacity_rps": search.capacity, "capacity_probes": search.probes, "rate_rps": rate, "two_tenants": two,
            "sixteen_tenants": mixed, "checks": checks, "met": met}


def markdown(result: dict[str, Any]) -> str:
    def number(value: float | None, digits: int = 3) -> str:
        return "-" if value is None else f"{value:.{digits}g}"

    lines = [f"Fleet {FLEET}, {POLICY}, shared-prefix; capacity {number(result['capacity_rps'])} req/s, "
             f"run at {OVERLOAD:g}x: {number(result['rate_rps'])} req/s.", "",
             "| queue order | A attainment | B attainment | B TTFT p99 ms | goodput req/s | completed req/s | tokens/s |",
             "|---|---|---|---|---|---|---|"]
    for label, run in result["two_tenants"].items():
        a, b = run["tenants"]["a"], run["tenants"]["b"]
        lines.append(f"| {label} | {number(a['attainment'])} | {number(b['attainment'])} | {number(b['ttft_p99_ms'], 4)} | "
                     f"{number(run['goodput_rps'])} | {number(run['throughput_rps'])} | {number(run['tokens_per_s'], 4)} |")
    lines += ["", "| sixteen tenants | backlogged | Jain's index (served tokens per weight) |", "|---|---|---|"]
    for label, run in result["sixteen_tenants"].items():
        backlogged = sum(1 for t in run["tenants"].values() if t["backlogged"])
        lines.append(f"| {label} | {backlogged} | {number(run['jain_index_backlogged'], 4)} |")
    lines += ["", "| target | measured | wanted | met |", "|---|---|---|---|"]
    for name, value in result["checks"].items():
        lines.append(f"| {name} | {number(value)} | >= {TARGETS[name]} | {'yes' if result['met'][name] else 'no'} |")
    return "\n".join(lines) + "\n"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=RESULTS_DIR / "fairness-study")
    parser.add_argument("--duration", type=float, default=40.0, help="simulated seconds of measured arrivals per run")
    parser.add_argument("--warmup", type=float, default=10.0, help="simulated seconds of arrivals before them")
    parser.add_argument("--resolution", type=float, default=0.05, help="the capacity search's relative step")
    parser.add_argument("--quick", action="store_true", help="20 s runs and a 15%% capacity step")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    duration, resolution = (20.0, 0.15) if args.quick else (args.duration, args.resolution)
    shared_prefix = next(w for w in WORKLOADS if w.name == "shared-prefix")
    base = ["--fleet", FLEET, "--num-blocks", str(NUM_BLOCKS), "--duration", f"{duration:g}", "--warmup",
            f"{args.warmup:g}", *shared_prefix.args, *SLO]
    args.out.mkdir(parents=True, exist_ok=True)
    result = study(base, resolution, args.out) | {"fleet": FLEET, "duration_s": duration, "warmup_s": args.warmup,
                                                  "attainment": ATTAINMENT, "targets": TARGETS,
                                                  "argv": list(sys.argv[1:] if argv is None else argv)}
    (args.out / "study.json").write_text(json.dumps(result, indent=1) + "\n")
    (args.out / "study.md").write_text(markdown(result))
    print(markdown(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
