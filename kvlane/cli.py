"""The `kvlane` command."""

from __future__ import annotations

import argparse
import contextlib
import signal
import sys
import tempfile
import time
from pathlib import Path

from rich.console import Console

from launch.fleet import start_fleet, with_overrides
from launch.fleet_mix import fleet_nodes, parse_fleet
from launch.launcher import LaunchError, Launcher
from launch.supervisor import Supervisor, restart_policy_from
from shared.config import ConfigError, KvlaneConfig, WorkerSettings, load_config


# Flags of one mode only, with their defaults there: given in the other mode, they are refused.
_MODE_FLAGS = {"aggregated": {"workers": 2, "fleet": None, "kv_share": None}, "disaggregated": {"prefill_workers": 1, "decode_workers": 1}}


def _up_flags_refused(args: argparse.Namespace) -> str | None:
    """Why the flags given do not fit together, or None; fills in the chosen mode's defaults."""
    for mode, flags in _MODE_FLAGS.items():
        for flag, default in flags.items():
            if mode != args.mode and getattr(args, flag) is not None:
                return f"--{flag.replace('_', '-')} applies to --mode {mode} only"
            if getattr(args, flag) is None:
                setattr(args, flag, default)
    return None


def up_config(args: argparse.Namespace) -> KvlaneConfig:
    """The configuration file, with what the flags given override (a flag not given leaves the file's value)."""
    ingress = {name: value for name, value in (("port", args.port), ("host", args.host),
                                               ("processes", getattr(args, "ingress_processes", None))) if value is not None}
    return with_overrides(
        load_config(args.config),
        ingress=ingress,
        worker={**({"engine": args.engine} if args.engine else {}),
                **({"nodes": args.nodes_per_worker} if getattr(args, "nodes_per_worker", None) else {}),
                **({"kv_share": True} if getattr(args, "kv_share", False) else {})},
        **({"worker.lora": {"max_loras": args.max_loras}} if getattr(args, "max_loras", None) is not None else {}),
        logging={"format": "console"} if args.console_logs else {},
        # Every service gets it (the config reaches each as KVLANE__* variables): spans and GenAI metrics over OTLP/HTTP.
        tracing={"exporter": "otlp", "otlp_endpoint": args.otlp_endpoint} if getattr(args, "otlp_endpoint", None) else {},
    )


def _up(args: argparse.Namespace, console: Console) -> int:
    if (refused := _up_flags_refused(args)) is not None:
        console.print(f"[red]{refused}[/]")
        return 2
    if args.tls and not args.secure:
        console.print("[red]--tls applies to --secure only[/]")
        return 2
    if args.nats_cluster < 1 or (args.nats_cluster > 1 and args.secure):
        console.print("[red]--nats-cluster takes a count of 1 or more, and does not combine with --secure[/]")
        return 2
    config = up_config(args)
    try:
        restart_policy = restart_policy_from(config.supervision)
    except ValueError as exc:
        console.print(f"[red]supervision: {exc}[/]")
        return 2
    if config.ingress.processes > 1 and args.secure:
        console.print("[red]ingress.processes > 1 does not combine with --secure (each ingress id needs a NATS user of its own)[/]")
        return 2
    args.engine = config.worker.engine
    if args.engine == "vllm":
        config = _with_vllm_model(config, console)
    log_dir = Path(args.log_dir or tempfile.mkdtemp(prefix="kvlane-"))
    launcher = Launcher(log_dir)
    security = None
    if args.secure:
        from launch.secure import Security

        security = Security(log_dir / "secure", tls=args.tls)
    if args.mode == "disaggregated":
        workers, prefill, decode = 0, args.prefill_workers, args.decode_workers
        shape = f"{prefill} prefill + {decode} decode {args.engine} worker(s)"
    else:
        workers, prefill, decode = args.workers, 0, 0
        shape = f"{workers} {args.engine} worker(s)"
    mix = []
    if args.fleet:
        if args.engine != "sim":
            console.print("[red]--fleet mixes sim profiles: it needs --engine sim[/]")
            return 2
        try:
            mix = fleet_nodes(parse_fleet(args.fleet))
        except ValueError as exc:
            console.print(f"[red]--fleet: {exc}[/]")
            return 2
        workers, shape = len(mix), f"{len(mix)} sim workers ({args.fleet})"
    console.print(f"[bold]kvlane up[/]: {shape}, logs in {log_dir}")
    if config.ingress.auth.required:
        console.print("API keys required (ingress.auth.required): create one with `kvlane keys create --tenant NAME`")
    else:
        console.print("API keys off (local use): anyone who reaches the ingress may use it; "
                      "set ingress.auth.required = true to require keys (`kvlane keys create`)")
    try:
        ready_timeout = args.ready_timeout or (VLLM_READY_TIMEOUT_S if args.engine == "vllm" else 60.0)
        fleet = start_fleet(launcher, config, workers, ready_timeout=ready_timeout, prefill_workers=prefill,
                            decode_workers=decode, mix=mix, security=security, nats_cluster=args.nats_cluster,
                            cache_managers=args.cache_managers)
    except (LaunchError, ValueError) as exc:
        console.print(f"[red]failed to start:[/] {exc}")
        return 1
    stopping = False

    def request_stop(signum: int, frame: object) -> None:
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGINT, request_stop)
    signal.signal(signal.SIGTERM, request_stop)
    actuator = None
    if args.autoscale:
        actuator = _start_autoscaling(fleet, console)
        if actuator is None:
            fleet.stop()
            return 1
    if security is not None:
        console.print(f"secured: one NATS user and Redis ACL user per process; credentials in {security.directory} "
                      f"(mode 0600){', TLS with the CA ' + str(security.certs.ca) if security.certs else ''}; "
                      f"`kvlane status --config {security.operator_config}`")
    console.print(f"[green]ready[/]  base URL: [bold]{fleet.base_url}/v1[/]  model: [bold]{config.worker.model}[/]")
    if args.nats_cluster > 1:
        console.print(f"NATS cluster of {args.nats_cluster}: {fleet.config.nats.url}")
    console.print("Ctrl-C stops everything kvlane started.")
    # The servers it started too: a restarted nats-server or redis-server is one the services reconnect to.
    supervisor = Supervisor(launcher, lambda: [*fleet.servers, *fleet.services()], restart_policy, console.print)
    try:
        while not stopping:
            if actuator is not None:
                actuator.step()
            if (given_up := supervisor.step()) is not None:
                console.print(f"[red]{given_up}[/]; stopping the fleet")
                return 1
            time.sleep(0.2)
    finally:
        console.print("stopping...")
        fleet.stop()
        if restarted := {name: count for name, count in supervisor.restart_counts().items() if count}:
            console.print("restarts: " + ", ".join(f"{name} {count}" for name, count in restarted.items()))
        console.print("stopped.")
    return 0


def _start_autoscaling(fleet, console: Console):
    """Start the autoscaler service and the actuator that applies its decisions to this fleet (None: it failed to start)."""
    import redis

    from contracts import subjects
    from kvlane.autoscale import FleetActuator
    from launch.launcher import wait_services_ready

    try:
        wait_services_ready([fleet.add_autoscaler()])
    except LaunchError as exc:
        console.print(f"[red]the autoscaler failed to start:[/] {exc}")
        return None
    from shared.credentials import redis_url_and_options

    config = fleet.security.settings_for(fleet.config, "operator") if fleet.security else fleet.config
    url, options = redis_url_and_options(config.redis)
    client = redis.Redis.from_url(url, **options)
    actuator = FleetActuator(fleet, lambda: client.get(subjects.AUTOSCALER_DECISION_KEY), lambda change: console.print(f"autoscale: {change}"))
    bounds = {pool: fleet.config.autoscaler.bounds(actuator.model, pool) for pool in ("aggregated", "prefill", "decode")}
    console.print(f"autoscaling {actuator.model}: " + ", ".join(f"{pool} {b.min}..{b.max}" for pool, b in bounds.items()))
    return actuator


# A vLLM engine takes ~30 s to start alone, longer when several share few cores.
VLLM_READY_TIMEOUT_S = 600.0
TINY_MODEL_NAME = "tiny-llama"


def _with_vllm_model(config: KvlaneConfig, console: Console) -> KvlaneConfig:
    """Without a configured model directory, serve the tiny test model (built once into a cache directory)."""
    if config.worker.vllm.model:
        return config
    from launch.tiny_model import default_cache_dir, ensure_tiny_model

    console.print(f"no worker.vllm.model configured: serving the tiny random-weight test model from {default_cache_dir()}")
    directory = ensure_tiny_model(default_cache_dir())
    worker = {"model": TINY_MODEL_NAME} if config.worker.model == WorkerSettings().model else {}
    # The tiny model starts in seconds without torch.compile, and float32 keeps its greedy output stable.
    engine_args = {"enforce_eager": True, **config.worker.vllm.extra_engine_args}
    vllm = {"model": str(directory), "dtype": "float32", "extra_engine_args": engine_args}
    if not config.worker.vllm.tool_call_parser:
        # Its template writes tool calls as Hermes/Qwen models do: vLLM's `hermes` parser reads them.
        vllm |= {"tool_call_parser": "hermes", "enable_auto_tool_choice": True}
    return with_overrides(config, worker=worker, **{"worker.vllm": vllm})


def _make_tiny_model(args: argparse.Namespace, console: Console) -> int:
    from launch.tiny_model import make_tiny_model

    directory = make_tiny_model(args.directory, seed=args.seed)
    console.print(f"tiny model written to {directory}")
    return 0


def _schema(args: argparse.Namespace, console: Console) -> int:
    import json

    from contracts.openapi import build_openapi, wire_schema

    document = wire_schema() if args.kind == "wire" else build_openapi()
    print(json.dumps(document, indent=2))
    return 0


def _status(args: argparse.Namespace, console: Console) -> int:
    import asyncio

    import msgspec

    from kvlane.status import StatusError, fetch_statuses, render_status, watch_status

    nats = load_config(args.config).nats
    # The configuration's credentials and TLS settings apply to --nats-url too.
    nats_url = msgspec.structs.replace(nats, url=args.nats_url) if args.nats_url else nats
    if args.watch:
        with contextlib.suppress(KeyboardInterrupt):
            asyncio.run(watch_status(nats_url, args.model, args.timeout, args.interval, console))
        return 0
    try:
        statuses = asyncio.run(fetch_statuses(nats_url, args.model, args.timeout))
    except StatusError as exc:
        console.print(f"[red]{exc}[/]")
        return 1
    render_status(statuses, console)
    return 0


def _dashboard(args: argparse.Namespace, console: Console) -> int:
    try:
        from kvlane.dashboard import render
    except ImportError as exc:
        console.print(f"[red]{exc}[/]: `pip install 'kvlane[dashboard]'` installs grafana-foundation-sdk")
        return 1
    if args.output == "-":
        sys.stdout.write(render())
    else:
        Path(args.output).parent.mkdir(parents=True, exist_ok=True)
        Path(args.output).write_text(render())
        console.print(f"dashboard written to {args.output}")
    return 0


def _keys(args: argparse.Namespace, console: Console) -> int:
    from kvlane.keys import run

    return run(args, console)


def _adapters(args: argparse.Namespace, console: Console) -> int:
    from kvlane.adapters import run

    return run(args, console)


def _at_least_one(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, not {value}")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvlane", description="LLM-serving control plane")
    commands = parser.add_subparsers(dest="command", required=True)
    up = commands.add_parser("up", help="start NATS, Redis (unless reachable), balancer, workers and ingress")
    # Defaults of None: a flag not given leaves the configuration file's value.
    up.add_argument("--engine", choices=["sim", "vllm"], help="worker engine (default: worker.engine, sim)")
    up.add_argument("--mode", choices=["aggregated", "disaggregated"], default="aggregated",
                    help="aggregated: each worker runs whole requests; disaggregated: prefill and decode pools")
    up.add_argument("--workers", type=int, help="aggregated workers (aggregated mode; default 2)")
    up.add_argument("--nodes-per-worker", type=_at_least_one, metavar="N",
                    help="simulated nodes each sim worker process hosts (default: worker.nodes, 1)")
    up.add_argument("--prefill-workers", type=int, help="prefill workers (disaggregated mode; default 1)")
    up.add_argument("--decode-workers", type=int, help="decode workers (disaggregated mode; default 1)")
    up.add_argument("--max-loras", type=int, metavar="N",
                    help="LoRA adapters each worker runs at once; 0 serves none (default: worker.lora.max_loras, 0)")
    up.add_argument("--kv-share", action="store_true", default=None,
                    help="aggregated workers lend each other cached prefixes: a free worker may pull a busy one's "
                         "(default: worker.kv_share, off)")
    up.add_argument("--fleet", help="sim workers of several kinds, PROFILE[@SPEED]:COUNT,... (aggregated mode; replaces --workers)")
    up.add_argument("--cache-managers", type=_at_least_one, default=1,
                    help="cache-manager replicas; they share the work, and the fleet keeps its leases while one is left (default 1)")
    up.add_argument("--port", type=int, help="ingress port (default: ingress.port, 8000)")
    up.add_argument("--host", help="ingress address (default: ingress.host, 127.0.0.1)")
    up.add_argument("--ingress-processes", type=_at_least_one, metavar="N",
                    help="ingress processes sharing the port, Linux only (default: ingress.processes, 1)")
    up.add_argument("--config", help="TOML configuration file")
    up.add_argument("--log-dir", help="where child logs go (default: a new temporary directory)")
    up.add_argument("--ready-timeout", type=float, help="seconds to wait for the fleet (default: 60 sim, 600 vllm)")
    up.add_argument("--console-logs", action="store_true", help="human-readable logs instead of JSON")
    up.add_argument("--autoscale", action="store_true",
                    help="run the autoscaler and start or drain workers as it decides (targets and bounds: [autoscaler])")
    up.add_argument("--secure", action="store_true",
                    help="require credentials: every process its own NATS user and Redis ACL user, "
                         "with least-privilege permissions (docs/security.md)")
    up.add_argument("--tls", action="store_true", help="with --secure: NATS and Redis over TLS, from a locally generated CA")
    up.add_argument("--nats-cluster", type=int, default=1, metavar="N",
                    help="start N clustered nats-servers (JetStream replicated) on nats.url's ports or free ones; "
                         "every service gets all their URLs")
    up.add_argument("--otlp-endpoint", metavar="URL",
                    help="send traces and GenAI metrics over OTLP/HTTP to this collector (e.g. http://localhost:4318)")
    up.set_defaults(handler=_up)
    tiny = commands.add_parser("make-tiny-model", help="write a tiny random-weight Llama with its own tokenizer (for tests)")
    tiny.add_argument("directory")
    tiny.add_argument("--seed", type=int, default=0)
    tiny.set_defaults(handler=_make_tiny_model)
    schema = commands.add_parser("schema", help="print the OpenAPI document or the JSON Schema of the NATS messages")
    schema.add_argument("kind", choices=["openapi", "wire"])
    schema.set_defaults(handler=_schema)
    status = commands.add_parser("status", help="nodes, load, slots, queue, policy and JFFC bounds, from every balancer")
    status.add_argument("--config", help="TOML configuration file (for the NATS URL)")
    status.add_argument("--nats-url", help="NATS URL (default: from the configuration)")
    status.add_argument("--model", default="", help="only this model's chains")
    status.add_argument("--timeout", type=float, default=5.0)
    status.add_argument("--watch", action="store_true", help="refresh the tables in place until Ctrl-C")
    status.add_argument("--interval", type=float, default=1.0, help="seconds between refreshes with --watch")
    status.set_defaults(handler=_status)
    dashboard = commands.add_parser("dashboard", help="write the Grafana dashboard (JSON) for a Prometheus that scrapes kvlane")
    dashboard.add_argument("--output", default="-", help="file to write (default: standard output); "
                           "deploy/grafana/kvlane.json is the checked-in copy")
    dashboard.set_defaults(handler=_dashboard)
    from kvlane.keys import add_arguments as add_keys_arguments

    keys = commands.add_parser("keys", help="create, list and revoke API keys (ingress.auth.required turns them on)")
    add_keys_arguments(keys)
    keys.set_defaults(handler=_keys)
    from kvlane.adapters import add_arguments as add_adapters_arguments

    adapters = commands.add_parser("adapters", help="publish, list and remove LoRA adapters (served by their base model's workers)")
    add_adapters_arguments(adapters)
    adapters.set_defaults(handler=_adapters)
    # `kvlane bench` has its own parser (loadtest/bench/command.py); everything after the word goes to it.
    commands.add_parser("bench", help="run a workload against fresh sim fleets, one per routing policy", add_help=False)
    commands.add_parser("simulate", help="the same comparison in virtual time, in one process (no servers)", add_help=False)
    commands.add_parser("calibrate", help="measure a vLLM node's step times and fit its step-time profile", add_help=False)
    return parser


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["bench"]:
        from loadtest.bench.command import main as bench_main

        sys.exit(bench_main(argv[1:]))
    if argv[:1] == ["simulate"]:
        from loadtest.simulation.command import main as simulate_main

        sys.exit(simulate_main(argv[1:]))
    if argv[:1] == ["calibrate"]:
        # Like bench: its own parser in loadtest/simulation/calibrate.py takes everything after the word.
        from loadtest.simulation.calibrate import main as calibrate_main

        sys.exit(calibrate_main(argv[1:]))
    args = build_parser().parse_args(argv)
    console = Console(stderr=False)
    for flag in ("workers", "prefill_workers", "decode_workers"):
        if getattr(args, flag, None) is not None and getattr(args, flag) < 1:
            console.print(f"[red]--{flag.replace('_', '-')} must be at least 1[/]")
            sys.exit(2)
    try:
        sys.exit(args.handler(args, console))
    except ConfigError as exc:
        console.print(f"[red]configuration error:[/] {exc}")
        sys.exit(2)
