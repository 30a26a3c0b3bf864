"""The `kvlane` command."""

from __future__ import annotations

import argparse
import signal
import sys
import tempfile
import time
from pathlib import Path

from rich.console import Console

from kvlane.fleet import start_fleet, with_overrides
from kvlane.launcher import LaunchError, Launcher
from shared.config import ConfigError, load_config


def _up(args: argparse.Namespace, console: Console) -> int:
    config = load_config(args.config)
    config = with_overrides(
        config,
        ingress={"port": args.port, "host": args.host},
        worker={"engine": args.engine},
        logging={"format": "console"} if args.console_logs else {},
    )
    log_dir = Path(args.log_dir or tempfile.mkdtemp(prefix="kvlane-"))
    launcher = Launcher(log_dir)
    console.print(f"[bold]kvlane up[/]: {args.workers} {args.engine} worker(s), logs in {log_dir}")
    try:
        fleet = start_fleet(launcher, config, args.workers, ready_timeout=args.ready_timeout)
    except (LaunchError, ValueError) as exc:
        console.print(f"[red]failed to start:[/] {exc}")
        return 1
    stopping = False

    def request_stop(signum: int, frame: object) -> None:
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGINT, request_stop)
    signal.signal(signal.SIGTERM, request_stop)
    console.print(f"[green]ready[/]  base URL: [bold]{fleet.base_url}/v1[/]  model: [bold]{config.worker.model}[/]")
    console.print("Ctrl-C stops everything kvlane started.")
    try:
        while not stopping:
            dead = [p for p in fleet.services() if not p.alive()]
            if dead:
                console.print(f"[red]{dead[0].name} exited ({dead[0].popen.returncode})[/]; see {dead[0].log_path}")
                return 1
            time.sleep(0.5)
    finally:
        console.print("stopping...")
        fleet.stop()
        console.print("stopped.")
    return 0


def _schema(args: argparse.Namespace, console: Console) -> int:
    import json

    from contracts.openapi import build_openapi, wire_schema

    document = wire_schema() if args.kind == "wire" else build_openapi()
    print(json.dumps(document, indent=2))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvlane", description="LLM-serving control plane")
    commands = parser.add_subparsers(dest="command", required=True)
    up = commands.add_parser("up", help="start NATS, Redis (unless reachable), balancer, workers and ingress")
    up.add_argument("--engine", choices=["sim"], default="sim")
    up.add_argument("--workers", type=int, default=2)
    up.add_argument("--port", type=int, default=8000)
    up.add_argument("--host", default="127.0.0.1")
    up.add_argument("--config", help="TOML configuration file")
    up.add_argument("--log-dir", help="where child logs go (default: a new temporary directory)")
    up.add_argument("--ready-timeout", type=float, default=60.0)
    up.add_argument("--console-logs", action="store_true", help="human-readable logs instead of JSON")
    up.set_defaults(handler=_up)
    schema = commands.add_parser("schema", help="print the OpenAPI document or the JSON Schema of the NATS messages")
    schema.add_argument("kind", choices=["openapi", "wire"])
    schema.set_defaults(handler=_schema)
    return parser


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    console = Console(stderr=False)
    if getattr(args, "workers", 1) < 1:
        console.print("[red]--workers must be at least 1[/]")
        sys.exit(2)
    try:
        sys.exit(args.handler(args, console))
    except ConfigError as exc:
        console.print(f"[red]configuration error:[/] {exc}")
        sys.exit(2)
