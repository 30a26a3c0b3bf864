"""How closely `kvlane simulate` predicts `kvlane bench`: the same options through both, compared per policy.

Runs the live bench (sim workers at speed 1, so wall time is simulated
time), then the simulation, with identical workload, fleet, load and SLO
options, and reports per policy the simulation's relative error on goodput
and TTFT p50/p90, and the median of each over the policies. Writes
`fidelity.json` beside the two runs' own results.

With `--calibrate`, a shorter traced live run of the first policy at the
same load comes first: the control plane's latencies and the live engine's
step overhead measured there (`loadtest.simulation.calibration`) are the
simulation's, instead of `Latencies`' defaults. What is then compared is
what the simulation computes (queues, steps, caches, the policies'
choices) on this machine's own control-plane delays.

    python -m loadtest.fidelity --workers 4 --rate 20 --requests 400 --policies round_robin,jffc_per_request
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from loadtest.bench import RESULTS_DIR, build_parser as bench_parser, main as bench_main, plan_runs
from loadtest.bench_run import run_once
from loadtest.simulate import build_parser as simulate_parser, main as simulate_main, plan as simulation_plan, run_one
from loadtest.simulation.calibration import (
    TRACING_OVERRIDES,
    fit_latencies,
    latencies_ms,
    medians,
    read_spans,
    request_stretches,
)
from loadtest.simulation.world import Latencies

METRICS = {"goodput": ("goodput_rps",), "ttft_p50": ("ttft_ms", "p50"), "ttft_p90": ("ttft_ms", "p90")}


def _metric(summary: dict[str, Any], path: tuple[str, ...]) -> float | None:
    value: Any = summary
    for key in path:
        value = value.get(key) if isinstance(value, dict) else None
    return value


def compare(live: dict[str, Any], simulated: dict[str, Any]) -> dict[str, Any]:
    """Per (policy, load): each metric live and simulated and the relative error; the median error per metric."""
    simulated_runs = {(r["policy"], r.get("rate"), r.get("concurrency")): r for r in simulated["runs"] if "summary" in r}
    rows = []
    for run in live["runs"]:
        twin = simulated_runs.get((run["policy"], run.get("rate"), run.get("concurrency")))
        if "summary" not in run or twin is None:
            continue
        row: dict[str, Any] = {"policy": run["policy"], "rate": run.get("rate"), "concurrency": run.get("concurrency")}
        for name, path in METRICS.items():
            real, sim = _metric(run["summary"], path), _metric(twin["summary"], path)
            error = abs(sim - real) / real if real and sim is not None else None
            row[name] = {"live": real, "simulated": sim, "error": error}
        rows.append(row)
    medians = {}
    for name in METRICS:
        errors = [row[name]["error"] for row in rows if row[name]["error"] is not None]
        medians[name] = statistics.median(errors) if errors else None
    return {"runs": rows, "median_error": medians}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m loadtest.fidelity", description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, help="results directory (default loadtest/results/fidelity-<workers>w)")
    parser.add_argument("--calibrate", action="store_true",
                        help="measure the control plane's latencies on a traced live run first and simulate with them")
    parser.add_argument("--calibration-requests", type=int, default=150, help="requests of the calibration run")
    return parser


def calibrate(shared: list[str], out: Path, requests: int) -> tuple[Latencies, dict[str, Any]]:
    """The simulation's latencies measured on a traced live run of the first policy, at the first load of `shared`."""
    if requests < 20:
        raise ValueError("--calibration-requests must be at least 20")
    args = bench_parser().parse_args([*shared, "--requests", str(requests)])
    runs, rejected = plan_runs(args, out / "logs")
    if not runs:
        raise ValueError(f"no policy to calibrate with: {rejected}")
    spec = runs[0]
    spec = dataclasses.replace(spec, fleet=dataclasses.replace(spec.fleet, overrides={**spec.fleet.overrides,
                                                                                        **TRACING_OVERRIDES}))
    live = run_once(spec, lambda record: None)
    stretches = request_stretches(read_spans(spec.log_dir), live["records"])
    # The same workload simulated without step overhead: the live TPOT beyond its TPOT is that overhead.
    simulation_args = simulate_parser().parse_args([*shared, "--requests", str(requests), "--policies", spec.policy])
    simulated = run_one(simulation_plan(simulation_args)[0][0], lambda record: None)
    live_tpot, simulated_tpot = (run["summary"]["tpot_ms"]["p50"] for run in (live, simulated))
    if live_tpot is None or simulated_tpot is None:
        raise ValueError("the calibration run served no request with more than one token")
    latencies = fit_latencies(stretches, live_tpot / 1000.0, simulated_tpot / 1000.0)
    report = {"policy": spec.policy, "requests": requests, "served": live["summary"]["succeeded"],
              "measured_requests": len(stretches["client"]),
              "stretches_p50_ms": {name: round(1000 * value, 3) for name, value in medians(stretches).items()},
              "tpot_p50_ms": {"live": live_tpot, "simulated_without_overhead": simulated_tpot},
              "ttft_p50_ms": live["summary"]["ttft_ms"]["p50"], "latencies_ms": latencies_ms(latencies)}
    (out / "calibration.json").write_text(json.dumps(report, indent=1) + "\n")
    return latencies, report


def main(argv: list[str] | None = None) -> int:
    """Options not its own go to both `kvlane bench` and `kvlane simulate` (which must accept them)."""
    args, shared = build_parser().parse_known_args(argv)
    out = args.out or RESULTS_DIR / "fidelity"
    console = Console() if sys.stdout.isatty() else Console(width=160)
    simulation_options: list[str] = []
    calibration = None
    if args.calibrate:
        (out / "calibration").mkdir(parents=True, exist_ok=True)
        try:
            latencies, calibration = calibrate(shared, out / "calibration", args.calibration_requests)
        except (ValueError, OSError, KeyError, RuntimeError) as exc:  # RuntimeError: the fleet did not serve
            console.print(f"[red]calibration failed: {exc}[/]")
            return 1
        simulation_options = [f"--{name.replace('_', '-')}-ms={value}" for name, value in latencies_ms(latencies).items()]
        console.print(f"calibrated latencies (ms): {calibration['latencies_ms']}; live stretches p50 (ms): "
                      f"{calibration['stretches_p50_ms']}")
    steps = [("live", bench_main, []), ("simulated", simulate_main, simulation_options)]
    if args.calibrate:
        # The same live run against the default latencies too: what the calibration changed.
        steps.append(("simulated-defaults", simulate_main, []))
    for name, run, extra in steps:
        code = run([*shared, *extra, "--out", str(out / name), "--quiet"])
        if code != 0:
            console.print(f"[red]the {name} run failed (exit {code}); see {out / name}[/]")
            return code
    live, simulated = (json.loads((out / name / "results.json").read_text()) for name in ("live", "simulated"))
    result = compare(live, simulated) | {"argv": shared, "calibration": calibration}
    if args.calibrate:
        defaults = json.loads((out / "simulated-defaults" / "results.json").read_text())
        result["median_error_with_default_latencies"] = compare(live, defaults)["median_error"]
    (out / "fidelity.json").write_text(json.dumps(result, indent=1) + "\n")
    table = Table(title="kvlane simulate against kvlane bench (simulated / live)")
    for column in ("policy", "load", *(f"{name} live / sim / error" for name in METRICS)):
        table.add_column(column)
    for row in result["runs"]:
        cells = [f"{row[n]['live']:.1f} / {row[n]['simulated']:.1f} / {100 * row[n]['error']:.0f}%"
                 if row[n]["error"] is not None else "-" for n in METRICS]
        table.add_row(row["policy"], str(row["rate"] or f"closed x{row['concurrency']}"), *cells)
    console.print(table)
    medians = ", ".join(f"{n} {100 * e:.1f}%" for n, e in result["median_error"].items() if e is not None)
    console.print(f"median error over policies: {medians}; {out / 'fidelity.json'}")
    if args.calibrate:
        defaults = ", ".join(f"{n} {100 * e:.1f}%" for n, e in result["median_error_with_default_latencies"].items()
                             if e is not None)
        console.print(f"with the default latencies instead: {defaults}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
