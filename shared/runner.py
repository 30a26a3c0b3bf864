"""How every service process starts and stops.

`run_service` parses `--config`, loads the configuration, sets up logging,
and runs the service's `main(config, stop)` on uvloop. SIGTERM and SIGINT
set `stop`; the service then drains (finishes what it holds, takes nothing
new) and returns, and the process exits 0. A configuration error exits 2
with the message on stderr.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import signal
import sys
from collections.abc import Awaitable, Callable

import structlog
import uvloop

from shared.config import ConfigError, KvlaneConfig, load_config
from shared.logging import configure_logging

ServiceMain = Callable[[KvlaneConfig, asyncio.Event], Awaitable[None]]

# Logged by each service once its subscriptions are in place: launchers and
# tests wait for this line before they rely on the service.
READY_EVENT = "service_ready"


def announce_ready(**fields: object) -> None:
    """Say on stderr that the service serves, whatever the log level (launchers wait for this line)."""
    print(json.dumps({"event": READY_EVENT, **fields}, default=str), file=sys.stderr, flush=True)


def run_service(name: str, main: ServiceMain, argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog=f"python -m services.{name}")
    parser.add_argument("--config", help="TOML configuration file (default: $KVLANE_CONFIG, else built-in defaults)")
    args = parser.parse_args(argv)
    try:
        config = load_config(args.config)
    except ConfigError as exc:
        print(f"kvlane {name}: {exc}", file=sys.stderr)
        raise SystemExit(2) from exc
    configure_logging(config.logging, name)
    log = structlog.get_logger(f"kvlane.{name}")

    async def supervise() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        log.info("service_starting")
        await main(config, stop)
        log.info("service_stopped")

    uvloop.run(supervise())
