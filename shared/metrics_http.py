"""A tiny `/metrics` HTTP endpoint for services that have no HTTP API of their own."""

from __future__ import annotations

from aiohttp import web
from prometheus_client import CollectorRegistry, generate_latest


async def serve_metrics(registry: CollectorRegistry, host: str, port: int) -> web.AppRunner:
    """Start serving `registry` on http://host:port/metrics; the caller cleans the runner up."""

    async def metrics(request: web.Request) -> web.Response:
        return web.Response(body=generate_latest(registry), headers={"Content-Type": "text/plain; version=0.0.4; charset=utf-8"})

    app = web.Application()
    app.router.add_get("/metrics", metrics)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, host, port).start()
    return runner
