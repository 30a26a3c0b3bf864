"""How closely `kvlane simulate` predicts `kvlane bench`: the same options through both, compared per policy.

Runs the live bench (sim workers at speed 1, so wall time is simulated
time), then the simulation, with identical workload, fleet, load and SLO
options, and reports per policy the simulation's relative error on goodput
and TTFT p50/p90, and the median of each over the policies. Writes
`fidelity.json` beside the two runs' own results.

    python -m loadtest.fidelity --workers 4 --rate 20 --requests 400 --policies round_robin,jffc_per_request
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from loadtest.bench import RESULTS_DIR, main as bench_main
from loadtest.simulate import main as simulate_main

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
    return parser


def main(argv: list[str] | None = None) -> int:
    """Options not its own go to both `kvlane bench` and `kvlane simulate` (which must accept them)."""
    args, shared = build_parser().parse_known_args(argv)
    out = args.out or RESULTS_DIR / "fidelity"
    console = Console() if sys.stdout.isatty() else Console(width=160)
    for name, run in (("live", bench_main), ("simulated", simulate_main)):
        code = run([*shared, "--out", str(out / name), "--quiet"])
        if code != 0:
            console.print(f"[red]the {name} run failed (exit {code}); see {out / name}[/]")
            return code
    live, simulated = (json.loads((out / name / "results.json").read_text()) for name in ("live", "simulated"))
    result = compare(live, simulated) | {"argv": shared}
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
    return 0


if __name__ == "__main__":
    sys.exit(main())
