"""The floor under any ingress: an aiohttp server that answers `POST /v1/completions` from memory.

`python -m loadtest.dataplane.overhead --http-floor` measures it beside the ingress and the direct worker path, with
the same client: the HTTP server and client alone, no NATS, no balancer, no worker. On a machine whose
cores the client and the servers share, no ingress built on aiohttp serves more requests per second than
this, which bounds the ingress path's ratio to the direct one from above.

It runs on uvloop like kvlane's services, parses the body as JSON (as any server of the API must) and
answers a completion of `max_tokens` tokens of the shape the ingress returns (msgspec both ways, as the
ingress decodes and encodes). Bad input gets a 400 in the OpenAI error shape.

    python -m loadtest.dataplane.http_floor --port PORT [--host HOST]
"""

from __future__ import annotations

import argparse
import time

import msgspec
import uvloop
from aiohttp import web

_encoder = msgspec.json.Encoder()


def error_response(message: str, status: int = 400, code: str = "bad_request") -> web.Response:
    """An error in the OpenAI shape, as the floors answer it (loadtest/dataplane/path_floor.py too)."""
    body = {"error": {"message": message, "type": "invalid_request_error" if status < 500 else "server_error",
                      "param": None, "code": code}}
    return web.Response(body=_encoder.encode(body), status=status, content_type="application/json")


async def completions(request: web.Request) -> web.Response:
    try:
        body = msgspec.json.decode(await request.read())
        max_tokens = int(body.get("max_tokens", 16))
        model = str(body["model"])
    except (msgspec.DecodeError, ValueError, TypeError, KeyError, AttributeError) as exc:
        return error_response(f"not a completion request: {exc}")
    if max_tokens < 1:
        return error_response("max_tokens must be at least 1")
    return web.Response(content_type="application/json", body=_encoder.encode({
        "id": "cmpl-floor", "object": "text_completion", "created": int(time.time()), "model": model,
        "choices": [{"index": 0, "text": " floor" * max_tokens, "logprobs": None, "finish_reason": "length"}],
        "usage": {"prompt_tokens": 8, "completion_tokens": max_tokens, "total_tokens": 8 + max_tokens},
    }))


def make_app() -> web.Application:
    app = web.Application()
    app.router.add_post("/v1/completions", completions)
    return app


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m loadtest.dataplane.http_floor", description=__doc__.split("\n\n")[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    args = parser.parse_args(argv)
    web.run_app(make_app(), host=args.host, port=args.port, print=None, access_log=None, loop=uvloop.new_event_loop())


if __name__ == "__main__":
    main()
