"""`disagg_bench`: prefill/decode disaggregation against aggregated serving, DistServe style, on the sim engine.

The same N simulated GPUs (sim nodes) run either as N aggregated workers or
split into a prefill pool and a decode pool at a few ratios (N=4: 1P:3D,
2P:2D, 3P:1D). Every (layout, rate) run gets a fresh fleet
(`loadtest.bench.run.run_once`) and the same seeded workload with the same
arrival times; the rate rises over a sweep. Per run: goodput under a TTFT and
a TPOT SLO, SLO attainment, TTFT and TPOT p50/p99, throughput.

**Units: simulated time.** The sim runs `--speed` simulated seconds per real
second. With the whole control plane on 2 shared cores, running slower than
real time (default 0.25) makes control-plane delays small next to simulated
GPU time. Rates, SLOs, latencies and throughputs on the command line, in the
table, in the plot and in each run's `sim` block of the JSON are simulated:
arrivals are sent at rate x speed per wall second, latency_sim = latency_wall
x speed, rate_sim = rate_wall / speed. Each run's `summary` block keeps the
wall-clock figures of `loadtest.bench.metrics.summarize` (its SLO: the simulated
one / speed, so its goodput counts the same requests).

**Workload** (default): fixed-length, unique prompts of 2000 tokens with 256
output tokens (the `shared-prefix` kind with no system prompt: every prompt is
its own question, so the prefix cache plays no part), as Dynamo- and
vLLM-style P/D benchmarks use a fixed ISL/OSL. Long prompts with a few hundred
output tokens are where DistServe finds prefill-decode interference: on an
aggregated node each 2000-token prefill adds ~59 ms to a decode step of ~8 ms
(h100-80g-llama3-8b profile: a 6.0 ms, b 29 us per prefill token), so TPOT
grows with the prefill load on the node; a decode node never runs a prefill.
The chat template adds 6 tokens: 2006 fit one 2048-token prefill chunk
(`--max-batched-tokens`). With `--prompt-tokens 2048` every prompt spills 6
tokens into a second step, which on a busy node is shared with the next
prompt's chunk, so each TTFT gains a whole step (~65 ms): a chunking artifact
that measured +70 ms on TTFT p50 for 2P:2D at 20 req/s.

**SLOs** (defaults, simulated): TTFT 400 ms, TPOT 15 ms. DistServe's chatbot
SLOs (TTFT 0.25 s, TPOT 0.1 s for OPT-13B on A100) sit several times above
its unloaded latencies; here an unloaded 2000-token prefill takes ~65 ms and
a decode step 7-9 ms at the batch sizes reached, so TTFT 400 ms is ~6x the
unloaded TTFT (DistServe's example figure; it leaves room for queueing) and
TPOT 15 ms ~2x the unloaded step: a tight TPOT SLO of the kind
disaggregation is for. Goodput at other SLOs comes from the same records:
`--slo-scales` (DistServe's "SLO scale") reports attainment with both SLOs
multiplied by each factor; the TPOT SLO decides which layout wins, so read
the scales before generalising.

**Goodput.** Per run, `goodput` = offered rate x SLO attainment (attainment:
requests meeting both SLOs / requests sent; failed ones count as missing it):
the part of the offered load served within the SLO. The JSON also keeps
`summarize`'s span goodput (SLO-meeting requests / first send to last end),
which short runs understate by the drain at the end. Per layout,
`capacity_rps` is DistServe's goodput: the highest rate with at least
`--attainment-target` (90%) attainment, interpolated linearly between the
swept rates (None when even the lowest rate misses it).

**Run length.** A request lives ~3.5 simulated seconds (256 tokens at
10-14 ms), so the decode batches, and with them TPOT, take a few seconds to
reach their steady state. `--duration` 10 s of arrivals per run spans about
three lifetimes; an offline replay of the same arrivals through the pure
`SimScheduler` put the aggregated layout at 100% attainment over 125
requests at 25 req/s but 52% over 250 (docs/benchmarks.md). Four rates x
four layouts at speed 0.25 take ~17 minutes here.

**Other settings.** KV cache: `--num-blocks` 24576 blocks of 16 tokens per
node (48 GiB of Llama-3-8B KV, roughly what an 80 GB H100 keeps after 16 GB
of weights at 90% memory use) and `--max-num-seqs` 256 (a common vLLM
default), so that capacity is compute-bound, not bound by the sim's small
default cache. KV link `--kv-link` rdma-400g (2006 tokens x 128 KiB =
263 MB: ~5.3 ms). `--min-remote-prefill-tokens` 256 (the balancer default):
every prompt of this workload is meant to be prefilled on a prefill node.
Policy `jffc_per_request` (the default) picks the decode node, the balancer
the prefill node (earliest finish). `remote_prefill_share` in each run
shows where prompts were actually prefilled: the decode nodes' KV pulls
(their heartbeat counters, read before and after the workload) per
completed request.

    python -m loadtest.routing.disagg_bench                       # the full sweep (~17 min on 2 shared cores)
    python -m loadtest.routing.disagg_bench --quick               # smoke test: 2 nodes, aggregated vs 1P:1D, one rate
    python -m loadtest.routing.disagg_bench --nodes 8 --ratios 2:6,4:4,6:2 --rates 20,40,60
"""

from __future__ import annotations

import argparse
import datetime as dt
import math
import signal
import sys
import tempfile
import threading
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from rich.console import Console

from loadtest.bench.command import jsonable
from loadtest.bench.run import FleetSpec, PlannedRun, RunSpec, fleet_config, run_each
from loadtest.bench.client import RequestRecord
from loadtest.bench.report import write_json
from loadtest.routing.disagg_report import print_report, write_plot
from loadtest.bench.driver import DriveLimits
from loadtest.bench.machine import machine_info
from loadtest.bench.metrics import Slo, distribution_ms, summarize
from loadtest.bench.workloads import ArrivalSpec, WorkloadSpec
from shared.kv.links import NAMED_LINKS
from shared.config import LoggingSettings
from shared.logging import configure_logging

RESULTS_DIR = Path(__file__).resolve().parents[1] / "results"
MAX_REQUESTS = 5_000  # per run, whatever the rate and duration say
# What --quick replaces (a smoke test: a few requests, two nodes, one rate, at full speed).
QUICK = {"nodes": 2, "ratios": "1:1", "rates": "4", "duration": 2.0, "speed": 1.0, "prompt_tokens": 512,
         "output_tokens": 16, "request_timeout": 30.0, "num_blocks": 4096}


@dataclass(frozen=True)
class Layout:
    """The same number of nodes, aggregated or split into prefill and decode pools."""

    aggregated: int = 0
    prefill: int = 0
    decode: int = 0

    @property
    def name(self) -> str:
        return f"{self.aggregated} agg" if self.aggregated else f"{self.prefill}P:{self.decode}D"

    @property
    def disaggregated(self) -> bool:
        return self.prefill > 0


def parse_layouts(nodes: int, ratios: str, aggregated: bool = True) -> list[Layout]:
    """`aggregated` first, then each P:D ratio (P + D must equal `nodes`, both at least 1)."""
    layouts = [Layout(aggregated=nodes)] if aggregated else []
    for item in (r.strip() for r in ratios.split(",") if r.strip()):
        try:
            prefill, decode = (int(part) for part in item.split(":"))
        except ValueError:
            raise ValueError(f"ratio {item!r} is not P:D (two integers)") from None
        if prefill < 1 or decode < 1 or prefill + decode != nodes:
            raise ValueError(f"ratio {item}: P and D must be at least 1 and add up to --nodes {nodes}")
        layouts.append(Layout(prefill=prefill, decode=decode))
    if len({layout.name for layout in layouts}) != len(layouts):
        raise ValueError("a layout is listed twice")
    if not layouts:
        raise ValueError("nothing to run: no ratios and no aggregated layout")
    return layouts


def parse_rates(text: str) -> list[float]:
    rates = [float(r) for r in text.split(",") if r.strip()]
    if not rates or any(not math.isfinite(r) or r <= 0 for r in rates):
        raise ValueError("--rates must be positive numbers")
    return sorted(dict.fromkeys(rates))


def parse_scales(text: str) -> list[float]:
    scales = [float(s) for s in text.split(",") if s.strip()]
    if any(not math.isfinite(s) or s <= 0 for s in scales):
        raise ValueError("--slo-scales must be positive numbers")
    return sorted(dict.fromkeys([*scales, 1.0]))


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m loadtest.routing.disagg_bench", description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter,
                                     epilog="Rates, SLOs and latencies are simulated (see the module docstring).")
    fleet = parser.add_argument_group("fleet (the same nodes in every layout)")
    fleet.add_argument("--nodes", type=int, default=4, help="sim nodes (GPUs) per layout")
    fleet.add_argument("--ratios", default="1:3,2:2,3:1", help="comma-separated prefill:decode splits of --nodes")
    fleet.add_argument("--aggregated", action=argparse.BooleanOptionalAction, default=True,
                       help="run the aggregated layout (the baseline of the ratios)")
    fleet.add_argument("--policy", default="jffc_per_request", help="balancer policy (picks the decode node)")
    fleet.add_argument("--profile", default="h100-80g-llama3-8b", help="sim step-time profile")
    fleet.add_argument("--speed", type=float, default=0.25, help="sim speed: simulated seconds per real second")
    fleet.add_argument("--kv-link", choices=sorted(NAMED_LINKS), default="rdma-400g", help="prefill -> decode KV link")
    fleet.add_argument("--min-remote-prefill-tokens", type=int, default=256,
                       help="balancer.disaggregation: shorter uncached prompts are prefilled on the decode node")
    fleet.add_argument("--num-blocks", type=int, default=24576, help="sim KV blocks (16 tokens) per node")
    fleet.add_argument("--max-num-seqs", type=int, default=256, help="sim batch cap per node")
    fleet.add_argument("--max-batched-tokens", type=int, default=2048, help="sim token budget per step (prefill chunk)")
    fleet.add_argument("--max-model-len", type=int, default=4096, help="sim context length")
    work = parser.add_argument_group("workload (unique prompts, fixed lengths)")
    work.add_argument("--prompt-tokens", type=int, default=2000,
                      help="prompt tokens per request (ISL; the chat template adds 6)")
    work.add_argument("--output-tokens", type=int, default=256, help="output tokens per request (OSL)")
    work.add_argument("--seed", type=int, default=0, help="workload, arrivals and sim seed")
    load = parser.add_argument_group("load (simulated time)")
    load.add_argument("--rates", default="12,18,24,30",
                      help="comma-separated arrival rates, requests per simulated second (Poisson)")
    load.add_argument("--duration", type=float, default=10.0, help="simulated seconds of arrivals per run")
    load.add_argument("--ttft-slo-ms", type=float, default=400.0, help="TTFT SLO, simulated ms")
    load.add_argument("--tpot-slo-ms", type=float, default=15.0, help="TPOT SLO, simulated ms")
    load.add_argument("--slo-scales", default="0.5,1,2,4", help="also report attainment with both SLOs times each factor")
    load.add_argument("--attainment-target", type=float, default=0.9, help="capacity = highest rate with this attainment")
    load.add_argument("--request-timeout", type=float, default=60.0, help="wall seconds per request (also bounds a run's drain)")
    out = parser.add_argument_group("output")
    out.add_argument("--quick", action="store_true",
                     help="smoke test: " + ", ".join(f"--{k.replace('_', '-')} {v}" for k, v in QUICK.items()))
    out.add_argument("--out", type=Path, help="results directory (default loadtest/results/disagg-<timestamp>/)")
    out.add_argument("--log-dir", type=Path, help="fleet logs (default: a temporary directory)")
    out.add_argument("--quiet", action="store_true", help="no table or progress bar")
    out.add_argument("--report", type=Path, metavar="RESULTS_JSON",
                     help="start no fleet: re-derive an earlier run's simulated figures and comparison from its "
                          "records and parameters, rewrite that results.json and its plot, print the tables")
    return parser


@dataclass(frozen=True)
class Plan:
    layouts: list[Layout]
    rates: list[float]  # simulated requests/s
    slo_sim: Slo
    slo_scales: list[float]
    runs: list[tuple[Layout, float, RunSpec]]


def plan(args: argparse.Namespace, log_root: Path) -> Plan:
    if args.nodes < 1 or args.speed <= 0 or args.duration <= 0:
        raise ValueError("--nodes must be at least 1, --speed and --duration positive")
    if args.prompt_tokens < 1 or args.output_tokens < 2:
        raise ValueError("--prompt-tokens must be at least 1 and --output-tokens at least 2 (TPOT needs two tokens)")
    layouts = parse_layouts(args.nodes, args.ratios, args.aggregated)
    rates = parse_rates(args.rates)
    slo_sim = Slo(ttft_s=args.ttft_slo_ms / 1000.0, tpot_s=args.tpot_slo_ms / 1000.0)
    # Wall clock for summarize: what takes x simulated seconds takes x / speed real ones.
    slo_wall = Slo(ttft_s=slo_sim.ttft_s / args.speed, tpot_s=slo_sim.tpot_s / args.speed)
    base = FleetSpec(
        workers=0, profile=args.profile, speed=args.speed, seed=args.seed, max_model_len=args.max_model_len,
        num_blocks=args.num_blocks,
        overrides={
            "worker.sim": {"kv_link": args.kv_link, "max_num_seqs": args.max_num_seqs,
                           "max_batched_tokens": args.max_batched_tokens},
            "balancer.disaggregation": {"min_remote_prefill_tokens": args.min_remote_prefill_tokens},
        },
    )
    fleet_config(base, args.policy, args.request_timeout)  # a bad policy or override fails here, before any fleet
    issue_for = args.duration / args.speed
    limits = DriveLimits(issue_for_s=issue_for, hard_stop_s=issue_for + args.request_timeout + 5.0)
    runs = []
    for rate in rates:
        workload = WorkloadSpec(
            # One group, no system prompt: each prompt is its own `prompt_tokens`-token question.
            kind="shared-prefix", seed=args.seed, groups=1, system_tokens=0, question_tokens=args.prompt_tokens,
            output_tokens=args.output_tokens, max_model_len=args.max_model_len, duration_s=issue_for,
            max_requests=min(MAX_REQUESTS, int(rate * args.duration * 1.5) + 20),
            arrival=ArrivalSpec(mode="poisson", rate=rate * args.speed),
        )
        workload.check()
        for layout in layouts:
            fleet = replace(base, workers=layout.aggregated, prefill_workers=layout.prefill,
                            decode_workers=layout.decode)
            name = f"{layout.name.replace(' ', '').replace(':', '-')}-r{rate:g}"
            runs.append((layout, rate, RunSpec(args.policy, workload, fleet, slo_wall, limits, args.request_timeout,
                                               log_root / name)))
    return Plan(layouts, rates, slo_sim, parse_scales(args.slo_scales), runs)


def _records(data: Sequence[dict[str, Any]]) -> list[RequestRecord]:
    return [RequestRecord(**{k: v for k, v in d.items() if k in RequestRecord.__dataclass_fields__}) for d in data]


def _scaled(dist: dict[str, Any], speed: float) -> dict[str, Any]:
    return {k: (v * speed if k != "count" and v is not None else v) for k, v in dist.items()}


def sim_view(summary: dict[str, Any], records: Sequence[RequestRecord], rate: float, speed: float, slo_sim: Slo,
             scales: Sequence[float], kv_pulls: int | None) -> dict[str, Any]:
    """The run's figures in simulated time, plus attainment at each SLO scale."""
    ok = [r for r in records if r.ok]
    attainment = summary["slo_attainment"] or 0.0
    by_scale = {}
    for scale in scales:
        slo = Slo(ttft_s=slo_sim.ttft_s * scale / speed, tpot_s=slo_sim.tpot_s * scale / speed)
        by_scale[f"{scale:g}"] = summarize(records, slo)["slo_attainment"]
    lag = distribution_ms(r.sent_s - r.scheduled_s for r in records if r.sent_s)
    return {
        "rate_rps": rate,
        "goodput_rps": rate * attainment,
        "slo_attainment": attainment,
        "span_goodput_rps": summary["goodput_rps"] / speed,
        "request_throughput_rps": summary["request_throughput_rps"] / speed,
        "output_token_throughput_tps": summary["output_token_throughput_tps"] / speed,
        "ttft_ms": _scaled(summary["ttft_ms"], speed),
        "tpot_ms": _scaled(summary["tpot_ms"], speed),
        "e2e_ms": _scaled(summary["e2e_ms"], speed),
        "wait_before_worker_ms": _scaled(summary["wait_before_worker_ms"], speed),
        # Sent later than the workload said: the load generator itself was starved (machine noise).
        "client_lag_ms": _scaled(lag, speed),
        "remote_prefill_share": min(1.0, kv_pulls / len(ok)) if ok and kv_pulls is not None else None,
        "attainment_by_slo_scale": by_scale,
    }


def capacity(points: Sequence[tuple[float, float]], target: float) -> float | None:
    """Highest rate whose attainment reaches `target`, interpolated to where the sweep crosses it.

    `points`: (rate, attainment), any order. None when the lowest rate already misses the target.
    """
    points = sorted(points)
    if not points or points[0][1] < target:
        return None
    best = points[0][0]
    for (low_rate, low_att), (high_rate, high_att) in zip(points, points[1:]):
        if high_att >= target:
            best = high_rate
            continue
        if low_att >= target:
            best = low_rate + (high_rate - low_rate) * (low_att - target) / (low_att - high_att)
        break
    return best


def comparisons(runs: Sequence[dict[str, Any]], layouts: Sequence[Layout], target: float) -> dict[str, Any]:
    """Per layout its capacity (at each SLO scale); per rate the best disaggregated layout against the aggregated one."""
    done = [r for r in runs if "error" not in r]
    aggregated = next((layout.name for layout in layouts if not layout.disaggregated), None)
    scales = sorted({scale for r in done for scale in r["sim"]["attainment_by_slo_scale"]}, key=float)
    by_scale = {}
    for scale in scales:
        caps = {}
        for layout in layouts:
            points = [(r["rate"], r["sim"]["attainment_by_slo_scale"][scale]) for r in done
                      if r["layout"] == layout.name and r["sim"]["attainment_by_slo_scale"].get(scale) is not None]
            caps[layout.name] = capacity(points, target) if points else None
        best = max((caps[layout.name] or 0.0 for layout in layouts if layout.disaggregated), default=None)
        by_scale[scale] = {"capacity_rps": caps, "ratio_best_disaggregated_vs_aggregated":
                           _ratio(best, caps.get(aggregated)) if aggregated and best is not None else None}
    capacities = by_scale.get("1", {}).get("capacity_rps", {layout.name: None for layout in layouts})
    per_rate = []
    for rate in sorted({r["rate"] for r in done}):
        at_rate = {r["layout"]: r["sim"] for r in done if r["rate"] == rate}
        split = {name: sim for name, sim in at_rate.items() if name != aggregated}
        if not split:
            continue
        best = max(split, key=lambda name: (split[name]["goodput_rps"], name))
        base = at_rate.get(aggregated) if aggregated else None
        per_rate.append({
            "rate_rps": rate,
            "best_disaggregated": best,
            "best_goodput_rps": split[best]["goodput_rps"],
            "aggregated_goodput_rps": base["goodput_rps"] if base else None,
            "goodput_ratio": _ratio(split[best]["goodput_rps"], base["goodput_rps"]) if base else None,
        })
    best_capacity = max((capacities.get(layout.name) or 0.0 for layout in layouts if layout.disaggregated), default=None)
    return {
        "attainment_target": target,
        "capacity_rps": capacities,
        "capacity_per_node_rps": {name: None if c is None else c / _nodes(layouts, name)
                                  for name, c in capacities.items()},
        "capacity_ratio_best_disaggregated_vs_aggregated": (
            _ratio(best_capacity, capacities.get(aggregated)) if aggregated and best_capacity is not None else None),
        # DistServe's "SLO scale": both SLOs times the factor, capacity from the same records.
        "capacity_by_slo_scale": by_scale,
        "per_rate": per_rate,
    }


def _nodes(layouts: Sequence[Layout], name: str) -> int:
    layout = next(layout for layout in layouts if layout.name == name)
    return layout.aggregated + layout.prefill + layout.decode


def _ratio(numerator: float | None, denominator: float | None) -> float | None:
    if numerator is None or denominator is None:
        return None
    if denominator <= 0:
        return None  # the aggregated layout met no SLO at all: no finite ratio (the goodputs are in the JSON)
    return numerator / denominator


def run_all(the_plan: Plan, speed: float, console: Console, quiet: bool,
            after_each: Callable[[list[dict[str, Any]]], None] = lambda done: None) -> list[dict[str, Any]]:
    planned = [
        PlannedRun(f"{layout.name:<7} {rate:g} req/s (sim)",
                   {"layout": layout.name, "aggregated_workers": layout.aggregated,
                    "prefill_workers": layout.prefill, "decode_workers": layout.decode,
                    "rate": rate, "rate_wall": rate * speed, "max_requests": spec.workload.max_requests},
                   spec)
        for layout, rate, spec in the_plan.runs
    ]

    def with_sim_view(item: PlannedRun, run: dict[str, Any]) -> dict[str, Any]:
        run["sim"] = sim_view(run["summary"], _records(run["records"]), item.header["rate"], speed, the_plan.slo_sim,
                              the_plan.slo_scales, run["kv_pulls"])
        return run

    return run_each(planned, console, quiet, after_each, with_sim_view)


def rederive(results: dict[str, Any]) -> dict[str, Any]:
    """`results` with every run's `sim` block and the comparison computed afresh from records and parameters."""
    params = results["parameters"]
    speed = params["speed"]
    slo_sim = Slo(ttft_s=params["slo"]["ttft_ms"] / 1000.0, tpot_s=params["slo"]["tpot_ms"] / 1000.0)
    layouts = [Layout(layout["aggregated"], layout["prefill"], layout["decode"]) for layout in params["layouts"]]
    for run in results["runs"]:
        if "error" not in run:
            run["sim"] = sim_view(run["summary"], _records(run["records"]), run["rate"], speed, slo_sim,
                                  params["slo_scales"], run.get("kv_pulls"))
    results["comparison"] = comparisons(results["runs"], layouts, params["attainment_target"])
    return results


def report_only(path: Path, console: Console, quiet: bool) -> int:
    import json

    try:
        results = rederive(json.loads(path.read_text()))
    except (OSError, ValueError, KeyError, TypeError) as exc:
        console.print(f"[red]{path}: not a disagg_bench results.json ({type(exc).__name__}: {exc})[/]")
        return 2
    write_json(results, path.parent)
    plot = write_plot(results, path.parent)
    if not quiet:
        print_report(results, console)
        console.print(f"rewrote {path}; plot: {plot.name if plot else 'none'}")
    return 0


def _terminate(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)  # unwinds through run_once's finally, which stops the fleet


def main(argv: list[str] | None = None) -> int:
    """0 when every run completed (failed requests are results), 1 when a run could not, 2 on bad options."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.quick:
        for key, value in QUICK.items():
            setattr(args, key, value)
    console = Console() if sys.stdout.isatty() else Console(width=170)
    if args.report is not None:
        return report_only(args.report, console, args.quiet)
    started = dt.datetime.now(dt.timezone.utc)
    out_dir = args.out or RESULTS_DIR / f"disagg-{started.strftime('%Y%m%d-%H%M%S')}"
    log_root = args.log_dir or Path(tempfile.mkdtemp(prefix="kvlane-disagg-"))
    try:
        the_plan = plan(args, log_root)
    except (ValueError, KeyError, OSError) as exc:
        if args.log_dir is None:
            log_root.rmdir()  # still empty: nothing ran
        console.print(f"[red]{exc}[/]")
        return 2
    if threading.current_thread() is threading.main_thread():  # signal handlers only work there
        signal.signal(signal.SIGTERM, _terminate)
    configure_logging(LoggingSettings(format="console", level="error"), "disagg-bench")
    first = the_plan.runs[0][2]
    results: dict[str, Any] = {
        "benchmark": "kvlane-disagg-bench",
        "timestamp": started.isoformat(),
        "machine": machine_info(),
        "parameters": {
            "nodes": args.nodes,
            "layouts": [asdict(layout) | {"name": layout.name} for layout in the_plan.layouts],
            "rates_rps": the_plan.rates,
            "policy": args.policy,
            "kv_link": args.kv_link,
            "min_remote_prefill_tokens": args.min_remote_prefill_tokens,
            "fleet": jsonable(asdict(replace(first.fleet, workers=0, prefill_workers=0, decode_workers=0))),
            # Arrivals (Poisson at rate x speed per wall second) and the request cap differ per run.
            "workload": {k: v for k, v in jsonable(asdict(first.workload)).items()
                         if k not in ("arrival", "max_requests")},
            "prompt_tokens": args.prompt_tokens,
            "output_tokens": args.output_tokens,
            "duration_s": args.duration,
            "slo": {"ttft_ms": args.ttft_slo_ms, "tpot_ms": args.tpot_slo_ms},
            "slo_scales": the_plan.slo_scales,
            "attainment_target": args.attainment_target,
            "request_timeout_s": args.request_timeout,
            "speed": args.speed,
            "seed": args.seed,
            "quick": args.quick,
            "units": ("rates, SLOs, durations and each run's `sim` block: simulated time (sim speed "
                      f"{args.speed} simulated s per real s: latency_sim = latency_wall x speed, rate_sim = "
                      "rate_wall / speed); each run's `summary` and `records`: wall clock, as loadtest.bench.metrics "
                      "computes them (its SLO = the simulated one / speed); workload.duration_s and "
                      "max_requests, arrival rates per run: wall"),
            "argv": list(sys.argv[1:] if argv is None else argv),
        },
        "runs": [],
    }
    out_dir.mkdir(parents=True, exist_ok=True)

    def save_so_far(done: list[dict[str, Any]]) -> None:
        # An interrupted sweep still leaves the runs it finished.
        write_json(results | {"runs": done,
                              "comparison": comparisons(done, the_plan.layouts, args.attainment_target)}, out_dir)

    runs = run_all(the_plan, args.speed, console, args.quiet, save_so_far)
    results["runs"] = runs
    results["comparison"] = comparisons(runs, the_plan.layouts, args.attainment_target)
    json_path = write_json(results, out_dir)
    plot = write_plot(results, out_dir)
    if not args.quiet:
        print_report(results, console)
        console.print(f"results: [bold]{json_path}[/]; plot: {plot.name if plot else 'none'}; fleet logs: {log_root}")
    return 1 if any("error" in run for run in runs) else 0


if __name__ == "__main__":
    sys.exit(main())
