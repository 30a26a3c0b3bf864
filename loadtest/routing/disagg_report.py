"""`disagg_bench`'s outputs: tables, one JSON file and one PNG (simulated time throughout).

`disagg.png` (matplotlib, Agg backend), one line per layout against the
offered rate: goodput (with the offered load as a dotted diagonal), SLO
attainment (with the attainment target), TTFT p99 and TPOT p99 (with the
SLOs as dashed lines, log scale).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from loadtest.bench.report import error_lines, fmt_number


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.0f}%"


def runs_table(results: dict[str, Any]) -> Table:
    params = results["parameters"]
    slo = params["slo"]
    table = Table(title=f"disaggregation bench: {params['nodes']} nodes, {params['fleet']['profile']}, "
                        f"{params['prompt_tokens']}/{params['output_tokens']} tokens in/out, {params['kv_link']}, "
                        f"SLO TTFT {slo['ttft_ms']:g} ms / TPOT {slo['tpot_ms']:g} ms (simulated; speed {params['speed']:g})")
    for column in ("layout", "rate r/s", "ok/sent", "goodput r/s", "attain", "thru r/s", "out tok/s", "TTFT p50",
                   "TTFT p99", "TPOT p50", "TPOT p99", "remote PF"):
        table.add_column(column, justify="left" if column == "layout" else "right")
    for run in sorted(results["runs"], key=lambda r: (r["rate"], _layout_order(results, r["layout"]))):
        if "error" in run:
            lines = error_lines(run["error"])
            table.add_row(run["layout"], f"{run['rate']:g}", f"[red]{lines[-1][:100]}[/]", *[""] * 9)
            continue
        s, sim = run["summary"], run["sim"]
        table.add_row(
            run["layout"], f"{run['rate']:g}", f"{s['succeeded']}/{s['requests']}", fmt_number(sim["goodput_rps"], 2),
            _pct(sim["slo_attainment"]), fmt_number(sim["request_throughput_rps"], 2),
            fmt_number(sim["output_token_throughput_tps"]), fmt_number(sim["ttft_ms"]["p50"]), fmt_number(sim["ttft_ms"]["p99"]),
            fmt_number(sim["tpot_ms"]["p50"], 1), fmt_number(sim["tpot_ms"]["p99"], 1), _pct(sim["remote_prefill_share"]),
        )
    return table


def comparison_table(results: dict[str, Any]) -> Table:
    comparison = results["comparison"]
    table = Table(title="best disaggregated layout vs aggregated, per rate (goodput = rate x attainment)")
    for column in ("rate r/s", "aggregated", "best P:D", "its goodput", "ratio"):
        table.add_column(column, justify="left" if column == "best P:D" else "right")
    for row in comparison["per_rate"]:
        table.add_row(f"{row['rate_rps']:g}", fmt_number(row["aggregated_goodput_rps"], 2), row["best_disaggregated"],
                      fmt_number(row["best_goodput_rps"], 2), fmt_number(row["goodput_ratio"], 2))
    return table


def capacity_table(results: dict[str, Any]) -> Table:
    comparison = results["comparison"]
    target = comparison["attainment_target"]
    lowest = min(results["parameters"]["rates_rps"])
    table = Table(title=f"capacity: highest rate with >= {100 * target:.0f}% SLO attainment, interpolated "
                        f"('<{lowest:g}', '>={max(results['parameters']['rates_rps']):g}': outside the rates swept); "
                        "SLO xN: both SLOs times N")
    by_scale = comparison.get("capacity_by_slo_scale", {})
    table.add_column("layout")
    table.add_column("capacity r/s", justify="right")
    table.add_column("per node", justify="right")
    others = [scale for scale in by_scale if scale != "1"]
    for scale in others:
        table.add_column(f"SLO x{scale}", justify="right")

    highest = max(results["parameters"]["rates_rps"])

    def cell(value: float | None) -> str:
        if value is None:
            return f"<{lowest:g}"
        return f">={highest:g}" if value >= highest else f"{value:.1f}"

    for layout in results["parameters"]["layouts"]:
        name = layout["name"]
        table.add_row(name, cell(comparison["capacity_rps"].get(name)),
                      fmt_number(comparison["capacity_per_node_rps"].get(name), 2),
                      *[cell(by_scale[scale]["capacity_rps"].get(name)) for scale in others])
    ratios = [by_scale[scale]["ratio_best_disaggregated_vs_aggregated"] for scale in others]
    if comparison["capacity_ratio_best_disaggregated_vs_aggregated"] is not None or any(r is not None for r in ratios):
        table.add_row("[bold]best P:D / agg[/]", fmt_number(comparison["capacity_ratio_best_disaggregated_vs_aggregated"], 2),
                      "", *[fmt_number(r, 2) for r in ratios])
    return table


def noisy_runs(results: dict[str, Any], threshold_ms: float) -> list[str]:
    """Runs whose load generator sent a request more than `threshold_ms` (simulated) late: the machine stalled."""
    noisy = []
    for run in results["runs"]:
        lag = (run.get("sim") or {}).get("client_lag_ms") or {}
        if lag.get("max") is not None and lag["max"] > threshold_ms:
            noisy.append(f"{run['layout']} at {run['rate']:g} (client lag up to {lag['max']:.0f} ms)")
    return noisy


def print_report(results: dict[str, Any], console: Console) -> None:
    console.print(runs_table(results))
    if results["comparison"]["per_rate"]:
        console.print(comparison_table(results))
    console.print(capacity_table(results))
    ratio = results["comparison"]["capacity_ratio_best_disaggregated_vs_aggregated"]
    if ratio is not None:
        console.print(f"capacity, best disaggregated / aggregated: [bold]{ratio:.2f}x[/]")
    # A stall of a tenth of the TTFT SLO is enough to move a run's attainment.
    noisy = noisy_runs(results, results["parameters"]["slo"]["ttft_ms"] / 10.0)
    if noisy:
        console.print(f"[yellow]machine noise: the load generator stalled during {'; '.join(noisy)}[/]")
    console.print(f"[dim]simulated ms and requests per simulated second (sim speed {results['parameters']['speed']:g}: "
                  "wall latency x speed, wall rate / speed); TTFT/TPOT over successful requests; remote PF: share "
                  "prefilled on a prefill node (decode nodes' KV pulls per request)[/]")


def _layout_order(results: dict[str, Any], name: str) -> int:
    names = [layout["name"] for layout in results["parameters"]["layouts"]]
    return names.index(name) if name in names else len(names)


def write_plot(results: dict[str, Any], out_dir: Path) -> Path | None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    runs = [r for r in results["runs"] if "error" not in r]
    if not runs:
        return None
    params = results["parameters"]
    rates = sorted({r["rate"] for r in runs})
    figure, axes = plt.subplots(2, 2, figsize=(12, 8.5))
    panels = (
        (axes[0][0], lambda sim: sim["goodput_rps"], "goodput (req/s meeting both SLOs)", "linear"),
        (axes[0][1], lambda sim: 100 * sim["slo_attainment"], "SLO attainment (%)", "linear"),
        (axes[1][0], lambda sim: sim["ttft_ms"]["p99"], "TTFT p99 (ms)", "log"),
        (axes[1][1], lambda sim: sim["tpot_ms"]["p99"], "TPOT p99 (ms)", "log"),
    )
    for layout in params["layouts"]:
        mine = sorted((r for r in runs if r["layout"] == layout["name"]), key=lambda r: r["rate"])
        if not mine:
            continue
        style = {"marker": "o", "linestyle": "-" if layout["prefill"] else "--", "linewidth": 2,
                 "label": layout["name"]}
        for axis, value, _, _ in panels:
            points = [(r["rate"], v) for r in mine if (v := value(r["sim"])) is not None]
            axis.plot([p[0] for p in points], [p[1] for p in points], **style)
    axes[0][0].plot(rates, rates, color="grey", linestyle=":", label="offered load")
    axes[0][1].axhline(100 * params["attainment_target"], color="grey", linestyle=":",
                       label=f"{100 * params['attainment_target']:.0f}% target")
    axes[1][0].axhline(params["slo"]["ttft_ms"], color="red", linestyle="--", linewidth=1, label="SLO")
    axes[1][1].axhline(params["slo"]["tpot_ms"], color="red", linestyle="--", linewidth=1, label="SLO")
    for axis, _, label, scale in panels:
        axis.set_yscale(scale)
        if scale == "log":
            axis.yaxis.set_major_locator(matplotlib.ticker.LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
            axis.yaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda value, _: f"{value:g}"))
            axis.yaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
        axis.set_xlabel("offered load (requests per simulated second)")
        axis.set_ylabel(label)
        axis.grid(True, which="both", alpha=0.3)
        axis.legend(fontsize=8)
    axes[0][1].set_ylim(-3, 103)
    slo = params["slo"]
    figure.suptitle(f"{params['nodes']} sim nodes ({params['fleet']['profile']}), {params['prompt_tokens']}/"
                    f"{params['output_tokens']} tokens in/out, KV over {params['kv_link']}; SLO TTFT {slo['ttft_ms']:g} ms, "
                    f"TPOT {slo['tpot_ms']:g} ms; simulated time (speed {params['speed']:g})", fontsize=10)
    figure.tight_layout()
    path = out_dir / "disagg.png"
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return path
