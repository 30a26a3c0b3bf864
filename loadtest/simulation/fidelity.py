"""How closely `kvlane simulate` predicts `kvlane bench`: the same options through both, compared per policy.

Runs the live bench (sim workers at speed 1, so wall time is simulated
time), then the simulation, with identical workload, fleet, load and SLO
options, and reports per policy the simulation's relative error on goodput
and TTFT p50/p90, and the median of each over the policies. Writes
`fidelity.json` beside the two runs' own results.

With `--calibrate`, a shorter traced live run of the first policy at the
same load comes first: the control plane's latencies and the live engine's
step overhead measured there (`loadtest.simulation.calibration`) are the
simulation's, instead of `Latencies`' defaults: each delay drawn per
request from its measured distribution (`simulated/`), and, beside it,
drawn from the distribution measured at the same number of requests in
flight (`simulated-by-load/`), each at its measured median
(`simulated-constants/`) and at the defaults (`simulated-defaults/`). What is then compared is what the simulation
computes (queues, steps, caches, the policies' choices) on this machine's
own control-plane delays. `--resimulate` runs only the simulations again,
against the live run and calibration already in `--out`.

    python -m loadtest.simulation.fidelity --workers 4 --rate 20 --requests 400 --policies round_robin,jffc_per_request
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

from loadtest.bench.command import RESULTS_DIR, build_parser as bench_parser, main as bench_main, plan_runs
from loadtest.bench.run import run_once
from loadtest.simulation.command import build_parser as simulate_parser, main as simulate_main, plan as simulation_plan, run_one
from loadtest.simulation.calibration import (
    STRETCHES,
    TRACING_OVERRIDES,
    fit_latencies,
    in_flight_at_send,
    latencies_ms,
    measured_requests,
    medians,
    per_request_ms,
    read_spans,
    spreads_ms,
)

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


def calibration_drift(calibration: dict[str, Any], live: dict[str, Any]) -> float | None:
    """How much slower (above 0) or faster the calibration run's TTFT p50 was than the same requests' in the compared
    live run of its policy (the workload's first requests are the same for the same seed): the host's own change
    between the two windows, which no simulation calibrated on the first can follow into the second."""
    run = next((r for r in live["runs"] if r["policy"] == calibration.get("policy") and "records" in r), None)
    if run is None or not calibration.get("ttft_p50_ms"):
        return None
    first = sorted(run["records"], key=lambda r: r["scheduled_s"])[: calibration["requests"]]
    ttfts = [r["first_token_s"] - r["sent_s"] for r in first if r.get("first_token_s") is not None]
    return calibration["ttft_p50_ms"] / (1000 * statistics.median(ttfts)) - 1 if ttfts else None


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m loadtest.simulation.fidelity", description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, help="results directory (default loadtest/results/fidelity-<workers>w)")
    parser.add_argument("--calibrate", action="store_true",
                        help="measure the control plane's latencies on a traced live run first and simulate with them")
    parser.add_argument("--calibration-requests", type=int, default=150, help="requests of the calibration run")
    parser.add_argument("--resimulate", action="store_true",
                        help="run only the simulations again, against the live run (and the calibration, with "
                             "--calibrate) already in --out; the other options must be the live run's")
    return parser


def calibrate(shared: list[str], out: Path, requests: int) -> dict[str, Any]:
    """The control plane's delays measured on a traced live run of the first policy, at the first load of `shared`:
    the report `calibration.json` holds (each measured request's stretches, the TPOTs, the fitted latencies)."""
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
    measured = measured_requests(read_spans(spec.log_dir), live["records"])
    stretches = {name: [parts[name] for _, parts in measured] for name in STRETCHES}
    in_flight = in_flight_at_send(live["records"])
    # The same workload simulated without step overhead: the live TPOT beyond its TPOT is that overhead.
    simulation_args = simulate_parser().parse_args([*shared, "--requests", str(requests), "--policies", spec.policy])
    simulated = run_one(simulation_plan(simulation_args)[0][0], lambda record: None)
    live_tpot, simulated_tpot = (run["summary"]["tpot_ms"]["p50"] for run in (live, simulated))
    if live_tpot is None or simulated_tpot is None:
        raise ValueError("the calibration run served no request with more than one token")
    report = {"policy": spec.policy, "requests": requests, "served": live["summary"]["succeeded"],
              "measured_requests": len(stretches["client"]),
              "stretches_p50_ms": {name: round(1000 * value, 3) for name, value in medians(stretches).items()},
              "tpot_p50_ms": {"live": live_tpot, "simulated_without_overhead": simulated_tpot},
              "ttft_p50_ms": live["summary"]["ttft_ms"]["p50"],
              "stretches_ms": {name: [round(1000 * v, 4) for v in values] for name, values in stretches.items()},
              # Each measured request's load when it was sent, in the same order.
              "in_flight": [in_flight[request_id] for request_id, _ in measured]}
    report |= fitted(report)
    (out / "calibration.json").write_text(json.dumps(report, indent=1) + "\n")
    return report


def fitted(report: dict[str, Any]) -> dict[str, Any]:
    """The latencies (constants, ms) and delay distributions (quantiles, ms; by load too where the report has
    each request's load) fitted to a calibration report's measurements. ValueError when a stretch has no
    measurement."""
    stretches = {name: [v / 1000.0 for v in report["stretches_ms"].get(name, [])] for name in STRETCHES}
    tpot = report["tpot_p50_ms"]
    live_tpot, simulated_tpot = tpot["live"] / 1000.0, tpot["simulated_without_overhead"] / 1000.0
    latencies = fit_latencies(stretches, live_tpot, simulated_tpot, spreads=True, per_request=True)
    fit = {"latencies_ms": latencies_ms(latencies), "spreads_ms": spreads_ms(latencies),
           "per_request_ms": per_request_ms(latencies)}
    if report.get("in_flight"):
        by_load = fit_latencies(stretches, live_tpot, simulated_tpot, spreads=True, in_flight=report["in_flight"])
        fit["spreads_by_load_ms"] = spreads_ms(by_load)
    return fit


# The simulations beside the headline one with --calibrate: (directory, fidelity.json key, what it is).
ALTERNATIVES = (("simulated-per-request", "median_error_with_delays_per_request",
                 "each request drawing one measured request's delays"),
                ("simulated-by-load", "median_error_with_delays_by_load", "delays drawn by load"),
                ("simulated-constants", "median_error_with_constant_latencies", "the measured medians as constants"),
                ("simulated-defaults", "median_error_with_default_latencies", "the default latencies"))


def main(argv: list[str] | None = None) -> int:
    """Options not its own go to both `kvlane bench` and `kvlane simulate` (which must accept them)."""
    args, shared = build_parser().parse_known_args(argv)
    out = args.out or RESULTS_DIR / "fidelity"
    console = Console() if sys.stdout.isatty() else Console(width=160)
    calibration = None
    steps: list[tuple[str, Any, list[str]]] = [] if args.resimulate else [("live", bench_main, [])]
    if args.calibrate:
        (out / "calibration").mkdir(parents=True, exist_ok=True)
        calibration_file = out / "calibration" / "calibration.json"
        try:
            if args.resimulate:
                calibration = json.loads(calibration_file.read_text())
                calibration |= fitted(calibration)
                calibration_file.write_text(json.dumps(calibration, indent=1) + "\n")
            else:
                calibration = calibrate(shared, out / "calibration", args.calibration_requests)
        except (ValueError, OSError, KeyError, RuntimeError) as exc:  # RuntimeError: the fleet did not serve
            console.print(f"[red]calibration failed: {exc}[/]")
            return 1
        constants = [f"--{name.replace('_', '-')}-ms={value}" for name, value in calibration["latencies_ms"].items()]
        console.print(f"calibrated latencies (ms): {calibration['latencies_ms']}; live stretches p50 (ms): "
                      f"{calibration['stretches_p50_ms']}")
        # Each delay drawn from its measured distribution; beside it, against the same live run, each request
        # taking one measured request's delays together, the delays drawn by load, the measured medians and the
        # defaults: what each choice of the calibration changes. Each one's delays in a file of its own.
        variants = {"simulated": {"spreads_ms": calibration["spreads_ms"]},
                    "simulated-per-request": {"spreads_ms": calibration["spreads_ms"],
                                              "per_request_ms": calibration["per_request_ms"]}}
        if "spreads_by_load_ms" in calibration:
            variants["simulated-by-load"] = {"spreads_ms": calibration["spreads_by_load_ms"]}
        for name, delays in variants.items():
            delays_file = out / "calibration" / f"{name}.json"
            delays_file.write_text(json.dumps(delays) + "\n")
            steps.append((name, simulate_main, [*constants, f"--spreads={delays_file}"]))
        steps += [("simulated-constants", simulate_main, constants), ("simulated-defaults", simulate_main, [])]
    else:
        steps.append(("simulated", simulate_main, []))
    for name, run, extra in steps:
        code = run([*shared, *extra, "--out", str(out / name), "--quiet"])
        if code != 0:
            console.print(f"[red]the {name} run failed (exit {code}); see {out / name}[/]")
            return code
    live, simulated = (json.loads((out / name / "results.json").read_text()) for name in ("live", "simulated"))
    kept = ({key: value for key, value in calibration.items() if key not in ("stretches_ms", "in_flight", "per_request_ms")}
            if calibration else None)
    result = compare(live, simulated) | {"argv": shared, "calibration": kept}
    if calibration is not None:
        result["calibration_drift"] = calibration_drift(calibration, live)
    ran = {name for name, _, _ in steps}
    for directory, key, _ in ALTERNATIVES:
        if directory in ran:
            other = json.loads((out / directory / "results.json").read_text())
            result[key] = compare(live, other)["median_error"]
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
    if result.get("calibration_drift") is not None:
        console.print(f"calibration run's TTFT p50 against the same requests in the compared {calibration['policy']} run: "
                      f"{100 * result['calibration_drift']:+.1f}%")
    for _, key, label in ALTERNATIVES:
        if key in result:
            errors = ", ".join(f"{n} {100 * e:.1f}%" for n, e in result[key].items() if e is not None)
            console.print(f"with {label} instead: {errors}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
