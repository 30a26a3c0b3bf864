"""How every service process starts and stops.

`run_service` parses `--config`, loads the configuration, sets up logging,
and runs the service's `main(config, stop)` on uvloop. SIGTERM and SIGINT
set `stop`; the service then drains (finishes what it holds, takes nothing
new) and returns, and the process exits 0. A service stopped before it
announced that it serves holds nothing: its start is cancelled at once (it
may be waiting for a NATS or Redis that went down with the fleet). A
configuration error exits 2 with the message on stderr.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
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
# Whether this process has said it serves (`announce_ready`): until then a stop cancels its start.
_announced = False


def announce_ready(**fields: object) -> None:
    """Say on stderr that the service serves, whatever the log level (launchers wait for this line).

    What the process built to start is frozen out of the garbage collector first (`freeze_startup_heap`):
    that changes the whole process, so only a service's process entry calls this, never code run in-process.
    """
    mark_serving()
    freeze_startup_heap()
    print(json.dumps({"event": READY_EVENT, **fields}, default=str), file=sys.stderr, flush=True)


def mark_serving() -> None:
    """From here on a stop lets the service's main stop itself (a drain), rather than cancelling its start.
    `announce_ready` says so; a process that serves through others (a supervisor) says it with this."""
    global _announced
    _announced = True


def freeze_startup_heap() -> None:
    """Keep what exists now out of every later garbage collection.

    A worker that imported vLLM tracks about 600,000 objects, a balancer
    150,000: each full collection then stops the event loop for about 300
    and 45 ms here, and every stream on the node stalls that long. What a
    service built to start (modules, engine, configuration) lives as long as
    the process, so scanning it again finds nothing. vLLM's own server
    freezes its heap the same way once it serves.
    """
    gc.collect()
    gc.freeze()


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
        watchdog = asyncio.create_task(report_slow_shutdown(stop, log))
        serving = asyncio.current_task()
        assert serving is not None
        start_cancelled = False

        async def cancel_start_on_stop() -> None:
            nonlocal start_cancelled
            await stop.wait()
            if not _announced:
                log.info("stopped_while_starting")
                start_cancelled = True
                serving.cancel()

        canceller = asyncio.create_task(cancel_start_on_stop())
        try:
            await main(config, stop)
        except asyncio.CancelledError:
            if not start_cancelled:
                raise
            serving.uncancel()
        finally:
            canceller.cancel()
            watchdog.cancel()
        log.info("service_stopped")

    uvloop.run(supervise())


async def report_slow_shutdown(stop: asyncio.Event, log: structlog.typing.FilteringBoundLogger, every_s: float = 10.0) -> None:
    """Once stopping, say every `every_s` what the process still waits on, so a stuck drain names its culprit."""
    await stop.wait()
    loop, reporter = asyncio.get_running_loop(), asyncio.current_task()
    started = loop.time()
    while True:
        await asyncio.sleep(every_s)
        waiting = [f"{task.get_name()}: {await_chain(task.get_coro())}" for task in asyncio.all_tasks() if task is not reporter]
        log.warning("shutdown_slow", seconds=round(loop.time() - started, 1), waiting_on=waiting)


def await_chain(coro: object) -> str:
    """Where a coroutine is suspended, outermost first: `main (balancer/main.py:87) <- close (shared/bus.py:211) <- ...`."""
    where = []
    while coro is not None:
        frame = getattr(coro, "cr_frame", None) or getattr(coro, "gi_frame", None)
        if frame is not None:
            code = frame.f_code
            where.append(f"{code.co_name} ({'/'.join(code.co_filename.split('/')[-2:])}:{frame.f_lineno})")
        coro = getattr(coro, "cr_await", None) or getattr(coro, "gi_yieldfrom", None)
    return " <- ".join(where) or "?"
