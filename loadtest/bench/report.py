"""The bench's outputs: a comparison table, one JSON file and PNG plots.

Plots (matplotlib, Agg backend, so no display is needed):
* `ttft_cdf.png`: the fraction of requests whose TTFT is at most x, one line
  per policy, one panel per rate; a line further left and steeper is better.
* `goodput_vs_rate.png` (rate sweeps only): requests/s meeting both SLOs
  against offered load; the rate where a policy's line bends over is its
  capacity under the SLO.
* `goodput.png`: goodput and throughput per policy at each rate, as bars.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from loadtest.bench.client import RequestRecord
from loadtest.bench.metrics import ttft_s


def fmt_number(value: float | None, digits: int = 0) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def error_lines(error: str) -> list[str]:
    """A failed run's traceback without blank lines: its last line names the failure."""
    return [line for line in error.splitlines() if line.strip()] or ["failed"]


def rate_label(rate: float | None, concurrency: int | None) -> str:
    if rate is not None:
        return f"{rate:g} req/s"
    return f"closed x{concurrency}" if concurrency is not None else "trace timestamps"


def comparison_table(results: dict[str, Any]) -> Table:
    params = results["parameters"]
    slo = params["slo"]
    fleet = params["fleet"] or {}
    table = Table(title=f"{results['benchmark'].replace('-', ' ')}: {(params['workload'] or {}).get('kind')}, "
                        f"{fleet.get('nodes') or fleet.get('workers')} workers, "
                        f"SLO TTFT {slo['ttft_ms']:g} ms / TPOT {slo['tpot_ms']:g} ms ({clock(results)})")
    with_adapters = any("adapters" in run for run in results["runs"])
    for column in ("policy", "load", "ok/sent", "goodput r/s", "thru r/s", "out tok/s", "TTFT p50", "TTFT p99",
                   "TPOT p50", "TPOT p99", "hit rate", "load CV", *(["LoRA loads/1k"] if with_adapters else [])):
        table.add_column(column, justify="left" if column in ("policy", "load") else "right")
    for run in results["runs"]:
        load = rate_label(run.get("rate"), run.get("concurrency"))
        if "error" in run:
            # The JSON keeps the whole traceback.
            lines = error_lines(run["error"])
            table.add_row(run["policy"], load, f"[red]{lines[0][:40]} … {lines[-1][:80]}[/]", *[""] * (len(table.columns) - 3))
            continue
        s = run["summary"]
        table.add_row(
            run["policy"], load, f"{s['succeeded']}/{s['requests']}",
            fmt_number(s["goodput_rps"], 2), fmt_number(s["request_throughput_rps"], 2), fmt_number(s["output_token_throughput_tps"]),
            fmt_number(s["ttft_ms"]["p50"]), fmt_number(s["ttft_ms"]["p99"]), fmt_number(s["tpot_ms"]["p50"], 1),
            fmt_number(s["tpot_ms"]["p99"], 1),
            "-" if s["prefix_cache_hit_rate"] is None else f"{100 * s['prefix_cache_hit_rate']:.0f}%",
            fmt_number(s["load_cv"], 2),
            *([fmt_number(run.get("adapters", {}).get("loads_per_1k"), 1)] if with_adapters else []),
        )
    return table


def clock(results: dict[str, Any]) -> str:
    """Which clock the run's times are on."""
    return "simulated time" if results["benchmark"] == "kvlane-simulate" else "wall clock"


def print_report(results: dict[str, Any], console: Console) -> None:
    console.print(comparison_table(results))
    console.print(f"[dim]latencies in ms; {results['parameters']['units']}[/]")


def write_json(results: dict[str, Any], out_dir: Path) -> Path:
    path = out_dir / "results.json"
    path.write_text(json.dumps(results, indent=1) + "\n")
    return path


def _ttft_ms(records: Sequence[dict[str, Any]]) -> list[float]:
    values = []
    for data in records:
        record = RequestRecord(**{k: v for k, v in data.items() if k in RequestRecord.__dataclass_fields__})
        if record.ok and (t := ttft_s(record)) is not None:
            values.append(t * 1000.0)
    return sorted(values)


def write_plots(results: dict[str, Any], out_dir: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = [r for r in results["runs"] if "error" not in r]
    if not runs:
        return []
    loads = list(dict.fromkeys((r.get("rate"), r.get("concurrency")) for r in runs))
    written = []

    columns = min(len(loads), 3)
    rows = -(-len(loads) // columns)
    figure, axes = plt.subplots(rows, columns, figsize=(6 * columns, 4.2 * rows), squeeze=False)
    for panel, load in zip(axes.flat, loads):
        for run in (r for r in runs if (r.get("rate"), r.get("concurrency")) == load):
            values = _ttft_ms(run["records"])
            if values:
                fractions = [(i + 1) / len(values) for i in range(len(values))]
                panel.step(values, fractions, where="post", label=run["policy"])
        panel.set_xscale("log")
        panel.set_xlabel(f"TTFT (ms, {clock(results)}, log scale)")
        panel.set_ylabel("fraction of requests")
        panel.set_title(f"TTFT CDF, {rate_label(*load)}")
        panel.grid(True, which="both", alpha=0.3)
        panel.legend(fontsize=7)
    for panel in list(axes.flat)[len(loads):]:
        panel.set_visible(False)
    figure.tight_layout()
    written.append(_save(figure, out_dir / "ttft_cdf.png", plt))

    policies = list(dict.fromkeys(r["policy"] for r in runs))
    figure, axis = plt.subplots(figsize=(max(6, 1.1 * len(policies) * len(loads)), 4.2))
    width = 0.8 / max(1, len(loads))
    for index, load in enumerate(loads):
        by_policy = {r["policy"]: r["summary"] for r in runs if (r.get("rate"), r.get("concurrency")) == load}
        xs = [p + index * width for p in range(len(policies))]
        axis.bar(xs, [by_policy.get(p, {}).get("goodput_rps", 0) for p in policies], width * 0.9,
                 label=f"goodput, {rate_label(*load)}")
        axis.scatter(xs, [by_policy.get(p, {}).get("request_throughput_rps", 0) for p in policies], color="black",
                     marker="_", s=200, zorder=3)
    axis.set_xticks([p + width * (len(loads) - 1) / 2 for p in range(len(policies))], policies, rotation=30, ha="right")
    axis.set_ylabel("requests/s (bars: goodput, dashes: throughput)")
    axis.set_title("Goodput under the SLO per policy")
    axis.legend(fontsize=7)
    figure.tight_layout()
    written.append(_save(figure, out_dir / "goodput.png", plt))

    rates = sorted({r["rate"] for r in runs if r.get("rate") is not None})
    if len(rates) > 1:
        figure, axis = plt.subplots(figsize=(7, 4.5))
        for policy in policies:
            points = sorted((r["rate"], r["summary"]["goodput_rps"]) for r in runs
                            if r["policy"] == policy and r.get("rate") is not None)
            axis.plot([p[0] for p in points], [p[1] for p in points], marker="o", label=policy)
        axis.plot(rates, rates, color="grey", linestyle=":", label="offered load")
        axis.set_xlabel("offered load (requests/s)")
        axis.set_ylabel("goodput (requests/s meeting both SLOs)")
        axis.set_title("Goodput versus rate")
        axis.grid(True, alpha=0.3)
        axis.legend(fontsize=7)
        figure.tight_layout()
        written.append(_save(figure, out_dir / "goodput_vs_rate.png", plt))
    return written


def _save(figure: Any, path: Path, plt: Any) -> Path:
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return path
