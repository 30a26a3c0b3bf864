"""The tables `python -m loadtest.dataplane.overhead` prints from its results (loadtest/dataplane/overhead.py)."""

from __future__ import annotations

from typing import Any

from rich.console import Console
from rich.table import Table


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"


def _ingress_paths(results: dict[str, Any]) -> list[dict[str, Any]]:
    return results["parameters"]["ingress_paths"]


def http_paths(results: dict[str, Any]) -> list[str]:
    """The ingress paths measured: `ingress`, then `ingress-<n>p` for each further count, `ingress-sends`, `http-floor`, `path-floor`."""
    return [path["path"] for path in _ingress_paths(results)]


def _label(results: dict[str, Any], path: str) -> str:
    paths = _ingress_paths(results)
    if len(paths) == 1:
        return "HTTP ingress"
    this = next(p for p in paths if p["path"] == path)
    if this.get("floor"):
        # Results written before there were two floors say `true` for the HTTP floor.
        return f"{path} ({'aiohttp alone, answered from memory' if this['floor'] is True else this['floor']})"
    processes = this["processes"]
    sends = "" if this["balancer_hands_over"] else ", sends to the worker itself"
    return f"{path} ({processes} process{'es' if processes > 1 else ''}{sends})"


def print_report(results: dict[str, Any], console: Console) -> None:
    params, lat, thr = results["parameters"], results["latency"], results["throughput"]
    https = http_paths(results)
    ratio = lambda v: "-" if v is None else f"{v:.2f}x"  # noqa: E731
    table = Table(title=f"Sequential {params['max_tokens']}-token requests, {params['requests']} per path (ms)")
    for column in ("path", "p50", "p90", "p99", "mean", "errors"):
        table.add_column(column, justify="left" if column == "path" else "right")
    for path in https:
        table.add_row(f"A: {_label(results, path)}", *(_ms(lat[path][k]) for k in ("p50_ms", "p90_ms", "p99_ms", "mean_ms")),
                      str(lat[path]["errors"]))
    table.add_row("B: worker direct (NATS)", *(_ms(lat["direct"][k]) for k in ("p50_ms", "p90_ms", "p99_ms", "mean_ms")),
                  str(lat["direct"]["errors"]))
    for path in https:
        ovh = lat["overhead" if path == "ingress" else f"{path}_overhead"]
        which = "" if len(https) == 1 else f" ({path})"
        table.add_row(f"[bold]overhead A - B{which}[/]", *(_ms(ovh[k]) for k in ("p50_ms", "p90_ms", "p99_ms", "mean_ms")), "")
        table.add_row(f"[bold]ratio A / B{which}[/]", ratio(ovh["ratio_p50"]), "", ratio(ovh["ratio_p99"]), ratio(ovh["ratio_mean"]), "")
    console.print(table)
    for path in https:
        ovh = lat["overhead" if path == "ingress" else f"{path}_overhead"]
        console.print(f"paired median of (A - B){'' if len(https) == 1 else f' for {path}'}: {_ms(ovh['paired_median_ms'])} ms")

    table = Table(title=f"Closed loop: {params['concurrency']} clients, {params['duration_s']:g} s per path")
    for column in ("path", "req/s", "requests", "errors", "p50 ms", "p99 ms", "vs direct"):
        table.add_column(column, justify="left" if column == "path" else "right")
    for key in (*https, "direct"):
        run = thr[key]
        label = "NATS direct" if key == "direct" else _label(results, key)
        versus = "" if key == "direct" else ratio(thr[f"{key}_vs_direct"])
        table.add_row(label, f"{run['requests_per_s']:.0f}", str(run["succeeded"]), str(run["errors"]), _ms(run["p50_ms"]),
                      _ms(run["p99_ms"]), versus)
    console.print(table)

    loops = (*https, "direct")
    names = sorted({name for key in loops for name in thr[key]["cpu_percent"]},
                   key=lambda n: (n.startswith(("machine-", "other-")), n))
    capacity = 100 * (results["machine"]["cpus_usable"] or 1)
    table = Table(title=f"CPU during the closed loops: % of one core (the machine has {capacity}%), CPU ms per request")
    table.add_column("process")
    for key in loops:
        table.add_column(f"{'NATS' if key == 'direct' else key} loop %", justify="right")
        table.add_column("ms/req", justify="right")
    for name in names:
        cells = []
        for key in loops:
            pct, per_request = thr[key]["cpu_percent"].get(name), thr[key]["cpu_ms_per_request"].get(name)
            cells += ["-" if pct is None else f"{pct:.0f}", "" if per_request is None else f"{per_request:.3f}"]
        table.add_row(name, *cells)
    console.print(table)
    machine = results["machine"]
    console.print(f"machine: {machine['cpus_usable']} usable CPUs of {machine['cpu_count']}, Python {machine['python_version']}, "
                  f"load average at start {machine['load_average_at_start']}")
