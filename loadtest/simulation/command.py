"""`kvlane simulate`: routing policies compared on the same fleet and workload, in virtual time.

The fleet runs as a discrete-event simulation in this one process
(`loadtest/simulation/`): kvlane's own routing, allocation, health and sim
scheduler code, with the messages between them delayed by modelled
latencies, and no NATS, Redis or subprocesses. A run is deterministic for
its seed, and its latencies are simulated seconds, free of this machine's
noise. Options, results.json layout, table and plots are `kvlane bench`'s,
plus fleets of mixed node kinds, nodes that fail or join mid-run, and the
modelled latencies. `kvlane bench`'s `--warmup S` counts simulated seconds
here: S seconds of arrivals before the `--duration` measured, so that
caches and queues are past their start when measuring begins (a fleet
starts with every cache empty; in a short run the first prefill of each
prefix decides much of the result).

With `--adapters N`, every session runs with one of N LoRA adapters (drawn
by `--adapter-popularity`), every node serves adapters with `--max-loras`
batch slots (`worker.lora`), and each run reports its nodes' adapter loads
per 1,000 requests (from the warm-up's end on). Loading costs the sim's
`worker.sim.adapter_activate_s` / `adapter_load_s` (set them with `--config`).

    kvlane simulate --fleet h100-80g-llama3-8b:8,a100-80g-llama3-8b:8 --rates 40,80 --duration 60
    kvlane simulate --workers 4 --rate 20 --adapters 64 --adapter-popularity zipf:1.1 --policies jffc_per_request
"""

from __future__ import annotations

import argparse
import datetime as dt
import sys
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import msgspec
from rich.console import Console

from launch.fleet import with_overrides
from launch.fleet_mix import FleetNode, NodeKind, describe, fleet_nodes, parse_fleet
from loadtest.bench.command import (RESULTS_DIR, build_parser as bench_parser, jsonable, loads, max_requests_for, with_warmup,
                            workload_for)
from loadtest.bench.lora import adapter_summary, lora_info, lora_option_error, lora_sections
from loadtest.bench.report import print_report, rate_label, write_json, write_plots
from loadtest.bench.run import FleetSpec, PlannedRun, after_warmup, policy_sections, run_each
from loadtest.bench.client import RequestRecord
from loadtest.bench.driver import DriveLimits
from loadtest.bench.metrics import Slo, summarize
from loadtest.bench.machine import machine_info
from loadtest.simulation.ceiling import NodeCost, PrefixOracle, Served, throughput_ceiling
from loadtest.simulation.calibration import per_request_ms, read_delays, spreads_ms
from loadtest.simulation.delays import Latencies
from loadtest.simulation.world import NodeChange, Simulation, SimulationSpec, result_summary
from loadtest.bench.workloads import WorkloadSpec
from shared.kv.links import get_link
from shared.kv.step_profile import get_profile
from shared.config import ConfigError, KvlaneConfig, load_config

UNITS = "simulated time: every latency and rate is in simulated seconds (the fleet ran in virtual time)"


@dataclass(frozen=True)
class SimRun:
    policy: str
    workload: WorkloadSpec
    config: KvlaneConfig
    nodes: tuple[FleetNode, ...]
    slo: Slo
    limits: DriveLimits
    request_timeout_s: float
    latencies: Latencies
    changes: tuple[NodeChange, ...]
    warmup_s: float = 0.0  # requests the workload schedules before this are served but not measured
    ceiling: bool = False  # also bound what any routing could serve of this workload on this fleet


def build_parser() -> argparse.ArgumentParser:
    parser = bench_parser("kvlane simulate", __doc__.split("\n\n")[0], live=False)
    sim = parser.add_argument_group("simulation")
    sim.add_argument("--config", type=Path, help="TOML configuration: its balancer, cache_manager, cluster, health "
                                                 "and worker.sim sections apply as they would live")
    sim.add_argument("--ingress-ms", type=float, default=Latencies.ingress_s * 1000,
                     help="ingress's own time per request before routing (HTTP, validation, tokens)")
    sim.add_argument("--hop-ms", type=float, default=Latencies.hop_s * 1000,
                     help="one message between services (route request, reply, stream frame, event)")
    sim.add_argument("--decision-ms", type=float, default=Latencies.decision_s * 1000,
                     help="the balancer's own time per route decision")
    sim.add_argument("--handover-ms", type=float, default=Latencies.handover_s * 1000,
                     help="from the route decision to the worker taking the request (reply, ingress, request)")
    sim.add_argument("--stream-ms", type=float, default=Latencies.stream_s * 1000,
                     help="from the engine step that made a token to the client reading it")
    sim.add_argument("--step-overhead-ms", type=float, default=Latencies.step_overhead_s * 1000,
                     help="what a live sim engine's step takes beyond its profile time (timer, event loop)")
    sim.add_argument("--spreads", type=Path, metavar="FILE",
                     help="JSON of measured delay distributions, {ingress|hop|decision|handover|stream: [quantiles in "
                          "ms at evenly spaced probabilities 0..1], or {\"in_flight_up_to\": [bounds], \"quantiles\": "
                          "[a list per band of requests in flight]}} (or under \"spreads_ms\", as loadtest.simulation.fidelity's "
                          "calibration.json has them): each request draws its own delay from them instead of the "
                          "constant; and/or under \"per_request_ms\" {delay: [each measured request's value]}: each "
                          "request takes one measured request's delays together")
    sim.add_argument("--prefill", help="prefill nodes p0..., PROFILE[@SPEED]:COUNT,... (a disaggregated fleet, with --decode)")
    sim.add_argument("--decode", help="decode nodes d0..., PROFILE[@SPEED]:COUNT,... (with --prefill; --fleet adds aggregated ones)")
    sim.add_argument("--kv-link", help="link the KV travels over between nodes: from prefill to decode nodes, and prefixes "
                                       "pulled between --kv-share nodes (default: worker.sim.kv_link)")
    sim.add_argument("--ceiling", action="store_true",
                     help="also report each run's throughput ceiling: the most requests per second any routing could "
                          "serve of its workload on its fleet (loadtest/simulation/ceiling.py; aggregated fleets "
                          "without --fail or --join)")
    sim.add_argument("--fail", action="append", default=[], metavar="T=WORKER",
                     help="node WORKER fails at simulated second T, counted from the warm-up's start (repeatable)")
    sim.add_argument("--join", action="append", default=[], metavar="T=PROFILE[@SPEED]",
                     help="a new node of PROFILE joins at simulated second T, as --fail (repeatable)")
    return parser


def latency_options_ms(args: argparse.Namespace) -> dict[str, float]:
    """The `Latencies` fields (without `_s`) as the options give them, in milliseconds."""
    return {"ingress": args.ingress_ms, "hop": args.hop_ms, "decision": args.decision_ms, "handover": args.handover_ms,
            "stream": args.stream_ms, "step_overhead": args.step_overhead_ms}


def node_changes(fails: list[str], joins: list[str], first_new_index: int) -> tuple[NodeChange, ...]:
    """`--fail`/`--join` values as changes; joined nodes are numbered on from the fleet's."""
    changes = []
    for value in fails:
        at, worker_id = _timed(value, "--fail", "T=WORKER")
        changes.append(NodeChange(at, worker_id))
    for index, value in enumerate(joins):
        at, kind = _timed(value, "--join", "T=PROFILE[@SPEED]")
        parsed = parse_fleet(f"{kind}:1")[0]
        changes.append(NodeChange(at, f"w{first_new_index + index}", parsed.profile, parsed.speed))
    return tuple(sorted(changes, key=lambda c: c.at_s))


def _timed(value: str, option: str, shape: str) -> tuple[float, str]:
    at, sep, what = value.partition("=")
    try:
        seconds = float(at)
    except ValueError:
        seconds = -1.0
    if not sep or not what or seconds < 0:
        raise ValueError(f"{option} {value!r}: expected {shape} with T >= 0 seconds")
    return seconds, what


def simulation_config(base: KvlaneConfig, fleet: FleetSpec, policy: str, request_timeout_s: float) -> KvlaneConfig:
    """The live bench's settings (`bench_run.fleet_config`) on top of `base`, without servers or ports."""
    return with_overrides(with_overrides(base, **policy_sections(policy)), ingress={"request_timeout_s": request_timeout_s},
                          **{"worker.sim": fleet.sim_settings()})


def plan(args: argparse.Namespace) -> tuple[list[SimRun], dict[str, Any]]:
    if bool(args.prefill) != bool(args.decode):
        raise ValueError("--prefill and --decode go together")
    kinds = parse_fleet(args.fleet) if args.fleet else [] if args.prefill else [NodeKind(args.profile, args.workers)]
    nodes = tuple(fleet_nodes(kinds))
    if args.prefill:
        prefill, decode = parse_fleet(args.prefill), parse_fleet(args.decode)
        nodes += tuple(fleet_nodes(prefill, "prefill")) + tuple(fleet_nodes(decode, "decode"))
        kinds = [*kinds, *prefill, *decode]
    fleet = FleetSpec(workers=len(nodes), profile=kinds[0].profile, seed=args.seed, max_model_len=args.max_model_len,
                      num_blocks=args.num_blocks)
    changes = node_changes(args.fail, args.join, len(nodes))
    if args.ceiling and (args.prefill or changes):
        raise ValueError("--ceiling bounds a fleet of aggregated nodes that stays as it is: not with --prefill, --fail or --join")
    if args.adapters and args.prefill and not args.fleet:
        raise ValueError("LoRA adapters run on aggregated nodes only: --adapters needs --fleet beside --prefill/--decode")
    unknown = [c.worker_id for c in changes if not c.profile and c.worker_id not in {n.worker_id for n in nodes}]
    if unknown:
        raise ValueError(f"--fail names nodes the fleet does not have: {', '.join(unknown)}")
    base = load_config(args.config) if args.config else KvlaneConfig()
    if args.kv_link:
        try:
            get_link(args.kv_link)
        except KeyError as exc:
            raise ValueError(f"--kv-link: {exc.args[0]}") from None
        base = with_overrides(base, **{"worker.sim": {"kv_link": args.kv_link}})
    if args.kv_share:
        base = with_overrides(base, worker={"kv_share": True})
    if lora := lora_sections(args):
        base = with_overrides(base, **lora)
    args = with_warmup(args)
    slo = Slo(ttft_s=args.ttft_slo_ms / 1000.0, tpot_s=args.tpot_slo_ms / 1000.0)
    issue_for = min(args.duration or args.max_run_time, args.max_run_time)
    limits = DriveLimits(issue_for_s=issue_for, hard_stop_s=issue_for + args.request_timeout + 5.0,
                         concurrency=args.concurrency)
    spreads, per_request = read_delays(args.spreads) if args.spreads else ((), ())
    latencies = Latencies(**{f"{name}_s": value / 1000.0 for name, value in latency_options_ms(args).items()},
                          spreads=spreads, per_request=per_request)
    policies = [p.strip() for p in args.policies.split(",") if p.strip()]
    runs = []
    for rate in loads(args):
        workload = workload_for(args, rate, max_requests_for(args, rate))
        workload.check()
        for policy in policies:
            try:
                config = simulation_config(base, fleet, policy, args.request_timeout)
            except (msgspec.ValidationError, KeyError, TypeError) as exc:
                raise ValueError(f"policy {policy!r}: {exc}") from None
            runs.append(SimRun(policy, workload, config, nodes, slo, limits, args.request_timeout, latencies, changes,
                               args.warmup, args.ceiling))
    fleet_info = jsonable(fleet.sim_settings()) | {"workers": len(nodes), "nodes": _describe(args, kinds),
                                                    "mix": [msgspec.to_builtins(n) for n in nodes]}
    if args.adapters:
        fleet_info["lora"] = lora_info(base)
    return runs, fleet_info


def _describe(args: argparse.Namespace, kinds: list[NodeKind]) -> str:
    if not args.prefill:
        return describe(kinds)
    aggregated = f"{args.fleet} + " if args.fleet else ""
    return f"{aggregated}prefill {args.prefill} + decode {args.decode}"


def run_one(run: SimRun, on_record: Callable[[RequestRecord], None]) -> dict[str, Any]:
    spec = SimulationSpec(run.config, run.nodes, run.workload, run.limits, run.request_timeout_s, run.latencies, run.changes,
                          warmup_s=run.warmup_s)
    oracle = PrefixOracle(run.config.worker.sim.block_size) if run.ceiling else None
    result = Simulation(spec, on_record, oracle).run()
    worker_ids = [n.worker_id for n in run.nodes] + [c.worker_id for c in run.changes if c.profile]
    measured = after_warmup(result.records, run.warmup_s)
    outcome = {
        "policy": run.policy,
        "summary": summarize(measured, run.slo, result.runs, worker_ids, run.workload.tenant_weights()),
        "simulation": result_summary(result) | {"warmup_requests": len(result.records) - len(measured)},
        "records": [r.to_json() for r in measured],
    }
    if run.workload.adapters:
        outcome["adapters"] = adapter_summary(result.counters["adapter_loads_measured"], len(measured),
                                              result.counters["adapter_loads"], len(result.records))
    if oracle is not None:
        turns = len(result.records) / max(1, len({r.session_id for r in result.records}))
        # In the workload's order, not the order they ended: the same requests give the same figure.
        served = sorted((s for s in result.served if s.scheduled_s >= run.warmup_s), key=lambda s: (s.scheduled_s, s.request_id))
        outcome["ceiling"] = ceiling_summary(run, served, turns)
    return outcome


def ceiling_summary(run: SimRun, served: list[Served], requests_per_session: float) -> dict[str, Any]:
    """The run's throughput ceiling, in requests and in the workload's own arrivals (sessions) per second."""
    if not served:
        return {"requests": 0}
    sim = run.config.worker.sim
    # A load from storage into a slot, as the sim's scheduler charges it (`SimScheduler._take_adapter`).
    adapter_load_s = sim.adapter_activate_s + sim.adapter_load_s if run.workload.adapters else 0.0
    counts = Counter((node.profile, node.speed) for node in run.nodes)
    kinds = [NodeCost(get_profile(profile), speed, sim.max_num_seqs, count, run.latencies.step_overhead_s, adapter_load_s)
             for (profile, speed), count in counts.items()]
    requests_per_s = throughput_ceiling(kinds, served)
    bound = {"requests": len(served), "requests_per_s": requests_per_s, "requests_per_session": requests_per_session,
             "sessions_per_s": requests_per_s / requests_per_session,
             "uncached_share": sum(s.uncached_tokens for s in served) / sum(s.prompt_tokens for s in served)}
    if run.workload.adapters:
        loads = sum(s.adapter_loads for s in served)
        bound |= {"adapter_loads": loads, "adapter_loads_per_1k": 1000.0 * loads / len(served)}
    return bound


def _rate_of(run: SimRun) -> float | None:
    return run.workload.arrival.rate if run.workload.arrival.mode != "closed" else None


def main(argv: list[str] | None = None) -> int:
    """Exit 0 when every run completed, 1 otherwise, 2 on bad options."""
    parser = build_parser()
    args = parser.parse_args(argv)
    console = Console() if sys.stdout.isatty() else Console(width=160)
    if args.workers < 1:
        parser.error("--workers must be at least 1")
    if error := lora_option_error(args):
        parser.error(error)
    started = dt.datetime.now(dt.timezone.utc)
    try:
        runs, fleet_info = plan(args)
    except (ValueError, OSError, ConfigError) as exc:
        console.print(f"[red]{exc}[/]")
        return 2
    out_dir = args.out or RESULTS_DIR / f"simulate-{started.strftime('%Y%m%d-%H%M%S')}"
    results: dict[str, Any] = {
        "benchmark": "kvlane-simulate",
        "timestamp": started.isoformat(),
        "machine": machine_info(),
        "parameters": {
            "policies": list(dict.fromkeys(r.policy for r in runs)),
            "rejected_policies": {},
            "fleet": fleet_info,
            "workload": jsonable(asdict(runs[0].workload)) if runs else None,
            "loads": [rate_label(r, args.concurrency) for r in dict.fromkeys(_rate_of(s) for s in runs)],
            "slo": {"ttft_ms": args.ttft_slo_ms, "tpot_ms": args.tpot_slo_ms},
            "request_timeout_s": args.request_timeout,
            "latencies_ms": latency_options_ms(args),
            "latency_spreads_ms": spreads_ms(runs[0].latencies) if runs else {},
            "latency_per_request_ms": per_request_ms(runs[0].latencies) if runs else {},
            "node_changes": [asdict(c) for c in runs[0].changes] if runs else [],
            "warmup_s": args.warmup,
            "units": UNITS,
            "argv": list(sys.argv[1:] if argv is None else argv),
        },
        "runs": [],
    }
    out_dir.mkdir(parents=True, exist_ok=True)
    planned = [
        PlannedRun(f"{run.policy:<17} {rate_label(_rate_of(run), run.limits.concurrency)}",
                   {"policy": run.policy, "rate": _rate_of(run), "concurrency": run.limits.concurrency}, run)
        for run in runs
    ]
    results["runs"] = run_each(planned, console, args.quiet, lambda done: write_json(results | {"runs": done}, out_dir),
                               run=run_one)
    json_path = write_json(results, out_dir)
    plots = write_plots(results, out_dir)
    if not args.quiet:
        print_report(results, console)
        for run in results["runs"]:
            bound = run.get("ceiling", {})
            if bound.get("requests"):
                loads = (f"; adapter loads at least {bound['adapter_loads_per_1k']:.1f} per 1,000 requests"
                         if "adapter_loads" in bound else "")
                console.print(f"{run['policy']} at {rate_label(run.get('rate'), run.get('concurrency'))}: throughput "
                              f"ceiling {bound['requests_per_s']:.1f} req/s, {bound['sessions_per_s']:.1f} sessions/s "
                              f"(uncached share of prompt tokens at best {bound['uncached_share']:.2f}{loads})")
        events = sum(r["simulation"]["events"] for r in results["runs"] if "simulation" in r)
        wall = sum(r["simulation"]["wall_s"] for r in results["runs"] if "simulation" in r)
        console.print(f"{events} simulated events in {wall:.1f} s ({events / wall if wall else 0:.0f} events/s); "
                      f"results: [bold]{json_path}[/]; plots: {', '.join(p.name for p in plots) or 'none'}")
    return 1 if any("error" in run for run in results["runs"]) else 0


if __name__ == "__main__":
    sys.exit(main())
