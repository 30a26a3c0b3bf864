"""The floor under kvlane's ingress path: its hops and messages, with no routing or request handling in them.

`python -m loadtest.dataplane.overhead --path-floor` measures it beside the ingress and the direct worker path. Two
processes stand in for the ingress and the balancer and do only what their transport must:

* `front` (in the ingress's place): an aiohttp server on uvloop. For each `POST /v1/completions` it decodes
  the body, tokenizes the prompt, asks `relay` over NATS with a `RouteRequest` that carries the worker's
  `GenerateRequest`, waits for the worker's `GenerateAccepted` and frames on kvlane's own bus (`shared.bus`:
  one reply inbox, one stream subscription, frames handled as they are parsed), and answers the completion.
* `relay` (in the balancer's place): decodes each `RouteRequest`, runs one Lua script on Redis through the
  balancer's `ScriptBatch` (the scripts of one loop iteration in one exchange), sends the `GenerateRequest`
  on to the one worker, and replies with a `RouteDecision`.

The worker is the fleet's own, which answers the front straight away, as it answers an ingress after the
balancer's hand-over. Given `--redis` and `--worker`, the front routes by itself instead, with no relay: it
runs the script and sends the worker its request (a path with no balancer process, measured as `path-floor-1`).
Left out: every decision, the slot's and the lease's bookkeeping (the script only counts), releases, queues,
retries, authentication, limits, metrics and spans. What the ingress path costs above this
floor is kvlane's own work; what the floor costs above the direct path is the architecture's: HTTP, one
more process on each side and its NATS messages, and a Redis round trip per request.

    python -m loadtest.dataplane.path_floor front --port PORT --nats URL [--host HOST] [--redis URL --worker WORKER_ID]
    python -m loadtest.dataplane.path_floor relay --nats URL --redis URL --worker WORKER_ID
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import time
import uuid

import msgspec
import redis.asyncio as redis
import uvloop
from aiohttp import web
from redis.commands.core import AsyncScript

from contracts import subjects
from contracts.messages import (
    ErrorReply,
    GenerateRequest,
    RouteDecision,
    RouteReply,
    RouteRequest,
    SamplingParams,
    StreamEnd,
    TokenChunk,
    WorkerReply,
)
from loadtest.dataplane.http_floor import error_response
from services.balancer.slot_store import ScriptBatch
from shared.bus import Bus, BusError, StreamReceiver
from shared.config import NatsSettings, RedisSettings, TracingSettings
from shared.state import connect_redis
from shared.telemetry import Telemetry
from shared.tokenizer import SimTokenizer

ROUTE_SUBJECT = "kvlane.loadtest.floor.route"
TIMEOUT_S = 10.0
# Counts the requests a node was asked to take: one key read and written per route, as the slot script does.
_COUNT = "return redis.call('INCR', KEYS[1])"
_encoder = msgspec.json.Encoder()


class CompletionBody(msgspec.Struct):
    model: str
    prompt: str
    max_tokens: int = 16


class Front:
    """The ingress's place: HTTP in, one route request out, the worker's frames back."""

    def __init__(self, bus: Bus, streams: StreamReceiver, relay: Relay | None = None) -> None:
        self._bus = bus
        self._streams = streams
        self._relay = relay  # routes here, in this process, when given
        self._tokenizer = SimTokenizer()
        self._prefix = f"floor{uuid.uuid4().hex[:8]}-"
        self._ids = itertools.count()

    async def completions(self, request: web.Request) -> web.Response:
        try:
            body = msgspec.json.decode(await request.read(), type=CompletionBody)
        except msgspec.DecodeError as exc:
            return error_response(f"not a completion request: {exc}")
        if body.max_tokens < 1 or not body.prompt:
            return error_response("a prompt and max_tokens of at least 1 are needed")
        prompt_token_ids = self._tokenizer.encode(body.prompt)
        request_id = f"{self._prefix}{next(self._ids)}"
        try:
            async with asyncio.timeout(TIMEOUT_S):
                token_ids, finish_reason = await self._run(request_id, body, prompt_token_ids)
        except (BusError, TimeoutError) as exc:
            return error_response(f"{type(exc).__name__}: {exc}", 502, "bad_gateway")
        except _Refused as exc:
            return error_response(str(exc), 502, "bad_gateway")
        return web.Response(content_type="application/json", body=_encoder.encode({
            "id": f"cmpl-{request_id}", "object": "text_completion", "created": int(time.time()), "model": body.model,
            "choices": [{"index": 0, "text": self._tokenizer.decode(token_ids), "logprobs": None, "finish_reason": finish_reason}],
            "usage": {"prompt_tokens": len(prompt_token_ids), "completion_tokens": len(token_ids),
                      "total_tokens": len(prompt_token_ids) + len(token_ids)},
        }))

    async def _run(self, request_id: str, body: CompletionBody, prompt_token_ids: list[int]) -> tuple[list[int], str]:
        with await self._bus.reply_slot() as accept, self._streams.open(request_id) as stream:
            generate = GenerateRequest(request_id=request_id, model=body.model, prompt_token_ids=prompt_token_ids,
                                       sampling=SamplingParams(max_tokens=body.max_tokens), stream_to=stream.subject,
                                       timeout_s=TIMEOUT_S, accept_to=accept.subject)
            route = RouteRequest(request_id=request_id, model=body.model, prompt_tokens=len(prompt_token_ids),
                                 max_tokens=body.max_tokens, timeout_s=TIMEOUT_S, hand_over=generate)
            if self._relay is None:
                decision = await self._bus.request(ROUTE_SUBJECT, route, RouteReply, TIMEOUT_S)
            else:
                decision = await self._relay.route(route, None)
            if isinstance(decision, ErrorReply):
                raise _Refused(f"relay refused: {decision.code}: {decision.message}")
            accepted = await accept.wait(WorkerReply, TIMEOUT_S, decision.inbox)
            if isinstance(accepted, ErrorReply):
                raise _Refused(f"worker refused: {accepted.code}: {accepted.message}")
            token_ids: list[int] = []
            while True:
                frame = await stream.next(TIMEOUT_S)
                if isinstance(frame, TokenChunk):
                    token_ids.extend(frame.token_ids)
                elif isinstance(frame, StreamEnd):
                    return token_ids, frame.finish_reason
                elif isinstance(frame, ErrorReply):
                    raise _Refused(f"stream failed: {frame.code}: {frame.message}")


class _Refused(Exception):
    pass


class Relay:
    """The balancer's place: one Redis script per route, the worker's request sent on, a decision back."""

    def __init__(self, bus: Bus, batch: ScriptBatch, count: AsyncScript, worker_id: str) -> None:
        self._bus = bus
        self._batch = batch
        self._count = count
        self._worker_id = worker_id
        self._inbox = subjects.worker_inbox(worker_id)
        self._key = f"kvlane:loadtest:floor:{worker_id}"

    async def route(self, request: RouteRequest, msg: object) -> RouteDecision | ErrorReply:
        if request.hand_over is None:
            return ErrorReply(code="bad_request", message="the floor's relay only hands requests over", status=400)
        await self._batch.call(self._count, [self._key], [])
        await self._bus.publish(self._inbox, request.hand_over)
        return RouteDecision(request_id=request.request_id, worker_id=self._worker_id, inbox=self._inbox,
                             policy="floor", max_tokens=request.max_tokens, handed_over=True)


def make_app(front: Front) -> web.Application:
    app = web.Application()
    app.router.add_post("/v1/completions", front.completions)
    return app


async def _connect(nats_url: str, name: str) -> Bus:
    return await Bus.connect(NatsSettings(url=nats_url), name, Telemetry(TracingSettings(), name))


async def run_front(args: argparse.Namespace) -> None:
    bus = await _connect(args.nats, "kvlane-floor-front")
    streams = StreamReceiver(bus, f"floor-{uuid.uuid4().hex[:8]}")
    await streams.start()
    client = connect_redis(RedisSettings(url=args.redis)) if args.redis else None
    front = Front(bus, streams, None if client is None else _relay(bus, client, args.worker))
    runner = web.AppRunner(make_app(front), access_log=None)
    await runner.setup()
    await web.TCPSite(runner, args.host, args.port).start()
    try:
        await asyncio.Event().wait()
    finally:
        await runner.cleanup()
        await bus.close()
        if client is not None:
            await client.aclose()


def _relay(bus: Bus, client: redis.Redis, worker_id: str) -> Relay:
    return Relay(bus, ScriptBatch(client), client.register_script(_COUNT), worker_id)


async def run_relay(args: argparse.Namespace) -> None:
    bus = await _connect(args.nats, "kvlane-floor-relay")
    client = connect_redis(RedisSettings(url=args.redis))
    await bus.subscribe(ROUTE_SUBJECT, RouteRequest, _relay(bus, client, args.worker).route, concurrent=True, traced=False)
    try:
        await asyncio.Event().wait()
    finally:
        await bus.close()
        await client.aclose()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m loadtest.dataplane.path_floor", description=__doc__.split("\n\n")[0])
    roles = parser.add_subparsers(dest="role", required=True)
    front = roles.add_parser("front", help="the ingress's place: HTTP in, the worker's frames back")
    front.add_argument("--host", default="127.0.0.1")
    front.add_argument("--port", type=int, required=True)
    front.add_argument("--nats", required=True, help="NATS URL")
    front.add_argument("--redis", help="Redis URL: route here, with no relay (needs --worker)")
    front.add_argument("--worker", help="with --redis: the worker every request is sent to")
    relay = roles.add_parser("relay", help="the balancer's place: a Redis script and the hand-over per route")
    relay.add_argument("--nats", required=True, help="NATS URL")
    relay.add_argument("--redis", required=True, help="Redis URL")
    relay.add_argument("--worker", required=True, help="the worker every request is sent to")
    args = parser.parse_args(argv)
    if args.role == "front" and bool(args.redis) != bool(args.worker):
        parser.error("front: --redis and --worker go together")
    uvloop.run(run_front(args) if args.role == "front" else run_relay(args))


if __name__ == "__main__":
    main()
