"""`kvlane bench`: routing policies compared on the same sim fleet and the same workload.

For each rate (or the closed loop) and each policy, a fresh fleet starts
(own nats-server and redis-server, one balancer with that policy, N sim
workers, one ingress), the same seeded workload is sent with the same
arrival times, and the fleet stops. The results: a comparison table, one
JSON file with every parameter, summary and request record, and PNG plots,
under `--out` (default loadtest/results/bench-<timestamp>/).

Latencies and throughputs are wall-clock. The sim runs `--speed` simulated
seconds per real second, so simulated latency = wall latency x speed
(roughly: control-plane time does not scale); the JSON records the speed.

With `--adapters N`, each fleet's workers get `--max-loras` adapter slots,
N tiny LoRA adapters are published to its bus as `kvlane adapters add`
publishes them, every session names its adapter as its requests' `model`,
and each run reports the workers' adapter loads per 1,000 requests
measured, from their heartbeats.

    python -m loadtest.bench.command --policies round_robin,jffc --rate 20   # later: kvlane bench ...
    kvlane bench --workers 2 --rate 4 --duration 20 --adapters 16 --adapter-popularity zipf:1.1 --max-loras 4
"""

from __future__ import annotations

import argparse
import datetime as dt
import math
import signal
import sys
import tempfile
import threading
from dataclasses import asdict
from pathlib import Path
from collections.abc import Callable
from typing import Any

import msgspec
from rich.console import Console

from launch.fleet_mix import fleet_nodes, parse_fleet
from loadtest.bench.lora import add_lora_arguments, lora_info, lora_option_error, lora_sections
from loadtest.bench.report import print_report, rate_label, write_json, write_plots
from loadtest.bench.run import FleetSpec, PlannedRun, PolicyRejected, RunSpec, fleet_config, run_each
from loadtest.bench.driver import DriveLimits
from loadtest.bench.metrics import Slo
from loadtest.bench.machine import machine_info
from loadtest.bench.workloads import WORKLOAD_KINDS, ArrivalSpec, WorkloadSpec, parse_tenants
from shared.config import LoggingSettings
from shared.logging import configure_logging

ALL_POLICIES = ("round_robin", "random", "least_loaded", "power_of_two", "prefix_affinity", "kv_cost", "score", "jffc",
                "jffc_per_request")
RESULTS_DIR = Path(__file__).resolve().parents[1] / "results"
DEFAULT_REQUESTS = 200
MAX_REQUESTS = 50_000  # per run, whatever the duration and rate say
DEFAULT_MAX_RUN_S = 600.0


def build_parser(prog: str = "kvlane bench", description: str = __doc__.split("\n\n")[0],
                 live: bool = True) -> argparse.ArgumentParser:
    """The options `kvlane bench` and `kvlane simulate` share; `live` adds the ones only a live fleet has."""
    parser = argparse.ArgumentParser(prog=prog, description=description,
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    fleet = parser.add_argument_group("fleet")
    fleet.add_argument("--policies", default=",".join(ALL_POLICIES),
                       help="comma-separated balancer policies; naive:NAME runs NAME as a plain load balancer would, "
                            "without kvlane's slots, central queue, KV leases and cache-aware dequeue")
    fleet.add_argument("--workers", type=int, default=4, help="nodes, all of --profile (unless --fleet)")
    fleet.add_argument("--profile", default="h100-80g-llama3-8b", help="sim step-time profile")
    fleet.add_argument("--fleet", help="node kinds, PROFILE[@SPEED]:COUNT,... (replaces --workers/--profile); "
                                       "SPEED below 1 makes stragglers")
    if live:
        fleet.add_argument("--speed", type=float, default=1.0, help="sim speed: simulated seconds per real second")
    fleet.add_argument("--max-model-len", type=int, default=4096, help="sim context length (prompts are clamped to it)")
    fleet.add_argument("--num-blocks", type=int, help="sim KV blocks per worker (default: sim default, raised for long contexts)")
    fleet.add_argument("--kv-share", action="store_true",
                       help="every node kv_share: a free node may run a request on a prefix pulled from a busy node "
                            "(worker.kv_share; its KV over worker.sim.kv_link)")
    work = parser.add_argument_group("workload")
    work.add_argument("--workload", choices=WORKLOAD_KINDS, default="shared-prefix")
    work.add_argument("--groups", type=int, default=8, help="shared-prefix groups (system prompts)")
    work.add_argument("--system-tokens", type=int, default=1024, help="system prompt tokens (shared-prefix, multi-turn)")
    work.add_argument("--question-tokens", type=int, default=64, help="question tokens per request or turn")
    work.add_argument("--output-tokens", type=int, default=128, help="max_tokens (shared-prefix, multi-turn)")
    work.add_argument("--turns", type=int, default=4, help="turns per conversation (multi-turn)")
    work.add_argument("--think-time", type=float, default=0.0, help="seconds between turns (multi-turn)")
    work.add_argument("--long-share", type=float, default=0.05, help="share of 16k-128k prompts (long-context)")
    work.add_argument("--trace", type=Path, help="Mooncake-format JSONL trace (trace workload)")
    work.add_argument("--tenants", type=parse_tenants, default=(), metavar="NAME:SHARE[:WEIGHT],...",
                      help="tenants the sessions belong to, each with its share of the arrivals and its weight in fair "
                           "sharing (default 1); results then report each tenant's SLO attainment and Jain's index")
    work.add_argument("--trace-time-scale", type=float, default=1.0,
                      help="multiplies trace timestamps (0.5: twice as fast); ignored when --rate/--rates is given")
    load = parser.add_argument_group("load")
    load.add_argument("--rate", type=float, help="open-loop arrival rate (requests or conversations per second)")
    load.add_argument("--rates", help="comma-separated rates: a sweep, one run per rate and policy")
    load.add_argument("--arrival", choices=["poisson", "gamma"], default="poisson")
    load.add_argument("--cv", type=float, default=1.0, help="gamma inter-arrival coefficient of variation (1 = Poisson)")
    load.add_argument("--concurrency", type=int, help="closed loop with this many clients instead of rates")
    load.add_argument("--duration", type=float, help="seconds of arrivals per run")
    load.add_argument("--warmup", type=float, default=0.0, metavar="SECONDS",
                      help="seconds of arrivals before --duration's, at the same load: served, not measured")
    load.add_argument("--requests", type=int, help=f"requests per run (default {DEFAULT_REQUESTS} without --duration)")
    load.add_argument("--request-timeout", type=float, default=120.0, help="seconds per request")
    load.add_argument("--max-run-time", type=float, default=DEFAULT_MAX_RUN_S, help="hard cap on one run's seconds")
    load.add_argument("--ttft-slo-ms", type=float, default=1000.0)
    load.add_argument("--tpot-slo-ms", type=float, default=100.0)
    load.add_argument("--seed", type=int, default=0)
    add_lora_arguments(parser)
    out = parser.add_argument_group("output")
    out.add_argument("--out", type=Path, help=f"results directory (default loadtest/results/{prog.split()[-1]}-<timestamp>/)")
    if live:
        out.add_argument("--log-dir", type=Path, help="fleet logs (default: a temporary directory)")
    out.add_argument("--quiet", action="store_true", help="no table or progress bar")
    return parser


def loads(args: argparse.Namespace) -> list[float | None]:
    if args.concurrency is not None:
        if args.rate is not None or args.rates:
            raise ValueError("--concurrency (closed loop) excludes --rate/--rates")
        if args.concurrency < 1:
            raise ValueError("--concurrency must be at least 1")
        return [None]
    rates = [float(r) for r in args.rates.split(",") if r.strip()] if args.rates else []
    if args.rate is not None:
        rates.insert(0, args.rate)
    if not rates:
        if args.workload == "trace":
            return [None]  # the trace's own timestamps
        raise ValueError("give --rate, --rates or --concurrency")
    if any(not math.isfinite(r) or r <= 0 for r in rates):
        raise ValueError("rates must be positive")
    return rates


def workload_for(args: argparse.Namespace, rate: float | None, max_requests: int) -> WorkloadSpec:
    if args.concurrency is not None:
        arrival = ArrivalSpec(mode="closed")
    elif rate is None:
        arrival = ArrivalSpec(mode="closed")  # a trace on its own timestamps; the arrival spec is unused
    else:
        arrival = ArrivalSpec(mode=args.arrival, rate=rate, cv=args.cv)
    return WorkloadSpec(
        kind=args.workload, seed=args.seed, max_requests=max_requests, duration_s=args.duration, arrival=arrival,
        max_model_len=args.max_model_len, groups=args.groups, system_tokens=args.system_tokens,
        question_tokens=args.question_tokens, output_tokens=args.output_tokens, turns=args.turns,
        think_time_s=args.think_time, long_share=args.long_share, trace_path=args.trace,
        trace_time_scale=args.trace_time_scale, trace_use_timestamps=rate is None and args.concurrency is None,
        tenants=args.tenants, adapters=args.adapters, adapter_zipf=args.adapter_popularity,
    )


def with_warmup(args: argparse.Namespace) -> argparse.Namespace:
    """`args` with the warm-up's seconds added to the arrivals (`--duration`); ValueError when it has none."""
    if not args.warmup:
        return args
    if not math.isfinite(args.warmup) or args.warmup < 0:
        raise ValueError("--warmup must be a number of seconds, 0 or more")
    if args.duration is None or args.requests is not None:
        raise ValueError("--warmup goes with --duration, not --requests")
    return argparse.Namespace(**vars(args) | {"duration": args.warmup + args.duration})


def max_requests_for(args: argparse.Namespace, rate: float | None) -> int:
    if args.requests is not None:
        return min(args.requests, MAX_REQUESTS)
    if args.duration is None:
        return DEFAULT_REQUESTS
    if rate is None:
        return MAX_REQUESTS
    turns = args.turns if args.workload == "multi-turn" else 1
    # Headroom over the expected count: the cap must not cut a bursty run short.
    return min(MAX_REQUESTS, int(rate * args.duration * turns * 1.5) + 100)


def plan_runs(args: argparse.Namespace, log_root: Path) -> tuple[list[RunSpec], dict[str, str]]:
    """Every (rate, policy) run, plus the policies the current config rejects (name -> reason)."""
    mix = tuple(fleet_nodes(parse_fleet(args.fleet))) if args.fleet else ()
    overrides = ({"worker": {"kv_share": True}} if args.kv_share else {}) | lora_sections(args)
    fleet = FleetSpec(workers=len(mix) or args.workers, profile=args.profile, speed=args.speed, seed=args.seed,
                      max_model_len=args.max_model_len, num_blocks=args.num_blocks, mix=mix, overrides=overrides)
    args = with_warmup(args)
    slo = Slo(ttft_s=args.ttft_slo_ms / 1000.0, tpot_s=args.tpot_slo_ms / 1000.0)
    issue_for = min(args.duration or args.max_run_time, args.max_run_time)
    limits = DriveLimits(issue_for_s=issue_for, hard_stop_s=issue_for + args.request_timeout + 5.0,
                         concurrency=args.concurrency)
    policies = [p.strip() for p in args.policies.split(",") if p.strip()]
    rejected: dict[str, str] = {}
    for policy in policies:
        try:
            fleet_config(fleet, policy, args.request_timeout)
        except PolicyRejected as exc:
            rejected[policy] = str(exc)
    runs = []
    for rate in loads(args):
        workload = workload_for(args, rate, max_requests_for(args, rate))
        workload.check()
        for policy in policies:
            if policy not in rejected:
                name = f"{policy}-{'closed' if rate is None else f'r{rate:g}'}"
                runs.append(RunSpec(policy, workload, fleet, slo, limits, args.request_timeout, log_root / name,
                                    args.warmup, adapters_dir=log_root / "adapters" if args.adapters else None))
    return runs, rejected


def _rate_of(spec: RunSpec) -> float | None:
    return spec.workload.arrival.rate if spec.workload.arrival.mode != "closed" else None


def run_all(runs: list[RunSpec], console: Console, quiet: bool,
            after_each: Callable[[list[dict[str, Any]]], None] = lambda done: None) -> list[dict[str, Any]]:
    planned = [
        PlannedRun(f"{spec.policy:<17} {rate_label(_rate_of(spec), spec.limits.concurrency)}",
                   {"policy": spec.policy, "rate": _rate_of(spec), "concurrency": spec.limits.concurrency}, spec)
        for spec in runs
    ]
    return run_each(planned, console, quiet, after_each)


def _terminate(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)  # unwinds through run_once's finally, which stops the fleet


def main(argv: list[str] | None = None) -> int:
    """Exit 0 when every planned run completed (failed requests are results, not errors), 1 otherwise, 2 on bad options."""
    parser = build_parser()
    args = parser.parse_args(argv)
    # Piped output (CI, tee) would otherwise wrap the table at 80 columns.
    console = Console() if sys.stdout.isatty() else Console(width=160)
    if args.workers < 1 or args.speed <= 0:
        parser.error("--workers must be at least 1 and --speed positive")
    if error := lora_option_error(args):
        parser.error(error)
    started = dt.datetime.now(dt.timezone.utc)
    out_dir = args.out or RESULTS_DIR / f"bench-{started.strftime('%Y%m%d-%H%M%S')}"
    log_root = args.log_dir or Path(tempfile.mkdtemp(prefix="kvlane-bench-"))
    try:
        runs, rejected = plan_runs(args, log_root)
    except (ValueError, OSError) as exc:
        if args.log_dir is None:
            log_root.rmdir()  # still empty: nothing ran
        console.print(f"[red]{exc}[/]")
        return 2
    for policy, reason in rejected.items():
        console.print(f"[yellow]skipping {policy}: {reason}[/]")
    if threading.current_thread() is threading.main_thread():  # signal handlers only work there
        signal.signal(signal.SIGTERM, _terminate)
    # The events listener logs through structlog; keep routine lines out of the report.
    configure_logging(LoggingSettings(format="console", level="error"), "bench")
    fleet_info = jsonable(asdict(runs[0].fleet)) if runs else None
    if fleet_info is not None and args.adapters:
        fleet_info["lora"] = lora_info(fleet_config(runs[0].fleet, runs[0].policy, args.request_timeout))
    results: dict[str, Any] = {
        "benchmark": "kvlane-bench",
        "timestamp": started.isoformat(),
        "machine": machine_info(),
        "parameters": {
            "policies": [p.strip() for p in args.policies.split(",") if p.strip()],
            "rejected_policies": rejected,
            "fleet": fleet_info,
            "workload": jsonable(asdict(runs[0].workload)) if runs else None,
            "loads": [rate_label(r, args.concurrency) for r in dict.fromkeys(_rate_of(s) for s in runs)],
            "slo": {"ttft_ms": args.ttft_slo_ms, "tpot_ms": args.tpot_slo_ms},
            "request_timeout_s": args.request_timeout,
            "warmup_s": args.warmup,
            "units": "wall-clock; simulated time = wall time x fleet.speed (engine time only)",
            "argv": list(sys.argv[1:] if argv is None else argv),
        },
        "runs": [],
    }
    out_dir.mkdir(parents=True, exist_ok=True)

    def save_so_far(done: list[dict[str, Any]]) -> None:
        # An interrupted sweep still leaves the runs it finished.
        write_json(results | {"runs": done}, out_dir)

    results["runs"] = results_runs = run_all(runs, console, args.quiet, save_so_far)
    json_path = write_json(results, out_dir)
    plots = write_plots(results, out_dir)
    if not args.quiet:
        print_report(results, console)
        console.print(f"results: [bold]{json_path}[/]; plots: {', '.join(p.name for p in plots) or 'none'}; "
                      f"fleet logs: {log_root}")
    failed = rejected or any("error" in run for run in results_runs)
    return 1 if failed else 0


def jsonable(data: Any) -> Any:
    if isinstance(data, dict):
        return {k: jsonable(v) for k, v in data.items()}
    if isinstance(data, (list, tuple)):
        return [jsonable(v) for v in data]
    if isinstance(data, Path):
        return str(data)
    if isinstance(data, msgspec.Struct):
        return msgspec.to_builtins(data)
    return data


if __name__ == "__main__":
    sys.exit(main())
