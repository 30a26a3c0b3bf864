"""kvlane against `vllm serve`: the same requests, the same answers.

One `vllm serve` (tests/vllm/vllm_server.py) and one kvlane fleet (one vllm
worker) serve the same tiny model with the same engine settings and the same
tool-call (hermes) and reasoning (qwen3) parsers. Every shape of
tests/vllm/api_shapes.py goes to both, as raw HTTP (aiohttp; streams parsed
from SSE and reassembled), one shape at a time to each server, and their
answers are reduced to what a client sees and compared:

- errors: the status code only;
- chat: per choice content, reasoning, tool-call names and arguments (ids
  ignored), finish_reason, token logprobs (within 1e-3) and top-logprob
  tokens; usage prompt/completion/total tokens;
- completions: per choice text, finish_reason, logprobs (tokens, token
  logprobs within 1e-3, top logprobs, text offsets); usage;
- /tokenize and /detokenize: the whole JSON body; /v1/models: the ids.

Ids, `created`, `system_fingerprint` and other metadata are ignored. It
prints "N of M identical" and a compact diff per mismatch, writes every
shape's answers as JSON (the path is printed), and fails unless all match.
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from launch.launcher import free_port
from tests.vllm.api_shapes import CHAT, COMPLETIONS, DETOKENIZE, MESSAGES, MODELS, RESPONSES, TOKENIZE, Shape, build_shapes
from tests.vllm.conftest import (
    BLOCK_SIZE,
    ENGINE_ENV,
    MAX_MODEL_LEN,
    MODEL,
    api_fleet_config,
    running_fleet,
)
from tests.vllm.vllm_server import VllmServe, serve_args

pytestmark = [pytest.mark.vllm, pytest.mark.integration]

LOGPROB_TOLERANCE = 1e-3
REQUEST_TIMEOUT_S = 180
MAX_DIFFS_PER_SHAPE = 6


# --- servers ------------------------------------------------------------------------


class Servers:
    def __init__(self, vllm_url: str, kvlane_url: str) -> None:
        self.vllm_url, self.kvlane_url = vllm_url, kvlane_url


@pytest.fixture(scope="module")
def servers(tmp_path_factory: pytest.TempPathFactory, tiny_model: Path) -> Iterator[Servers]:
    """`vllm serve` started first, then the kvlane fleet, so that both engines load at once (~1.7 GB each)."""
    log_dir = tmp_path_factory.mktemp("api-differential-servers")
    port = free_port()
    env = {**os.environ, **ENGINE_ENV, "VLLM_CPU_KVCACHE_SPACE": "1"}
    serve = VllmServe(serve_args(tiny_model, port, MODEL, max_model_len=MAX_MODEL_LEN, block_size=BLOCK_SIZE), port,
                      log_dir / "vllm-serve.log", env)
    started = time.monotonic()
    try:
        config_for = lambda nats_port, redis_port: api_fleet_config(nats_port, redis_port, tiny_model)  # noqa: E731
        with running_fleet(log_dir / "fleet", config_for, workers=1) as fleet:
            try:
                serve.wait_healthy(timeout_s=300)
            except BaseException:
                fleet.stop()  # running_fleet stops it only after a clean exit
                raise
            print(f"\nboth servers ready in {time.monotonic() - started:.0f}s (vllm serve log: {serve.log_path})")
            yield Servers(serve.base_url, fleet.base_url)
            assert serve.process.poll() is None, f"vllm serve died:\n{serve.log_tail()}"
    finally:
        serve.stop()


# --- asking -------------------------------------------------------------------------


async def ask(session: aiohttp.ClientSession, base_url: str, shape: Shape) -> dict:
    """What one server answered to `shape`: status, the comparable view, and a raw excerpt."""
    url = base_url + shape.path
    if shape.method == "GET":
        request = session.get(url)
    elif isinstance(shape.body, str):
        request = session.post(url, data=shape.body, headers={"Content-Type": "application/json"})
    else:
        request = session.post(url, json=shape.body)
    started = time.monotonic()
    async with request as response:
        if response.status == 200 and shape.stream:
            chunks, raw = [], []
            async for line in response.content:
                text = line.decode(errors="replace").strip()
                raw.append(text)
                if not text.startswith("data:"):
                    continue
                data = text.removeprefix("data:").strip()
                if data == "[DONE]":
                    break
                chunks.append(json.loads(data))
            excerpt = "\n".join(item for item in raw if item)[-600:]
            view = reassemble(shape, chunks)
        else:
            text = await response.text()
            excerpt = text[:600]
            try:
                body = json.loads(text)
            except ValueError:
                body = None
            view = plain_view(shape, body) if response.status == 200 else None
        return {"status": response.status, "view": view, "excerpt": excerpt, "seconds": round(time.monotonic() - started, 3)}


def kind(shape: Shape) -> str:
    return {CHAT: "chat", COMPLETIONS: "completion", TOKENIZE: "json", DETOKENIZE: "json", MODELS: "models",
            MESSAGES: "messages", RESPONSES: "responses"}[shape.path]


def usage_of(usage: dict | None) -> dict | None:
    if not usage:
        return None
    return {key: usage.get(key) for key in ("prompt_tokens", "completion_tokens", "total_tokens")}


def chat_logprobs(logprobs: dict | None) -> list | None:
    if logprobs is None or logprobs.get("content") is None:
        return None
    return [{"token": item.get("token"), "logprob": item.get("logprob"),
             "top": [[top.get("token"), top.get("logprob")] for top in item.get("top_logprobs") or []]}
            for item in logprobs["content"]]


def completion_logprobs(logprobs: dict | None) -> dict | None:
    if logprobs is None:
        return None
    return {key: logprobs.get(key) for key in ("tokens", "token_logprobs", "top_logprobs", "text_offset")}


def message_view(message: dict) -> dict:
    """An Anthropic message as a client reads it; the input tokens with those read from the cache (they split
    differently where the prefix caches of the two servers hold different prompts)."""
    blocks = []
    for block in message.get("content") or []:
        kind_ = block.get("type")
        if kind_ == "text":
            blocks.append({"type": kind_, "text": block.get("text")})
        elif kind_ == "thinking":
            blocks.append({"type": kind_, "thinking": block.get("thinking")})
        elif kind_ == "tool_use":
            blocks.append({"type": kind_, "name": block.get("name"), "input": block.get("input")})
        else:
            blocks.append({"type": kind_})
    usage = message.get("usage") or {}
    return {"role": message.get("role"), "content": blocks, "stop_reason": message.get("stop_reason"),
            "stop_sequence": message.get("stop_sequence"), "model": message.get("model"),
            "input_tokens": (usage.get("input_tokens") or 0) + (usage.get("cache_read_input_tokens") or 0),
            "output_tokens": usage.get("output_tokens")}


def response_view(response: dict) -> dict:
    """A Responses API response as a client reads it: its items' texts and calls, its status, its token counts."""
    items = []
    for item in response.get("output") or []:
        kind_ = item.get("type")
        if kind_ == "message":
            items.append({"type": kind_, "text": "".join(part.get("text") or "" for part in item.get("content") or [])})
        elif kind_ == "reasoning":
            parts = [*(item.get("content") or []), *(item.get("summary") or [])]
            items.append({"type": kind_, "text": "".join(part.get("text") or "" for part in parts)})
        elif kind_ == "function_call":
            items.append({"type": kind_, "name": item.get("name"), "arguments": item.get("arguments")})
        else:
            items.append({"type": kind_})
    usage = response.get("usage") or {}
    return {"status": response.get("status"), "incomplete": (response.get("incomplete_details") or {}).get("reason"),
            "model": response.get("model"), "output": items,
            "input_tokens": usage.get("input_tokens"), "output_tokens": usage.get("output_tokens")}


def message_from_events(events: list[dict]) -> dict:
    """An Anthropic stream as one message: blocks from their start and deltas, the stop and usage from message_delta."""
    message: dict = {"content": []}
    partial_json: dict[int, str] = {}
    for event in events:
        match event.get("type"):
            case "message_start":
                message |= {k: v for k, v in (event.get("message") or {}).items() if k != "content"}
            case "content_block_start":
                message["content"].append(dict(event.get("content_block") or {}))
            case "content_block_delta":
                block, delta = message["content"][event["index"]], event.get("delta") or {}
                if delta.get("type") == "text_delta":
                    block["text"] = (block.get("text") or "") + delta.get("text", "")
                elif delta.get("type") == "thinking_delta":
                    block["thinking"] = (block.get("thinking") or "") + delta.get("thinking", "")
                elif delta.get("type") == "input_json_delta":
                    partial_json[event["index"]] = partial_json.get(event["index"], "") + delta.get("partial_json", "")
            case "message_delta":
                message |= event.get("delta") or {}
                message["usage"] = (message.get("usage") or {}) | (event.get("usage") or {})
            case "error":
                message.setdefault("stream_errors", []).append(event.get("error"))
    for index, text in partial_json.items():
        message["content"][index]["input"] = json.loads(text) if text else {}
    return message_view(message) | ({"stream_errors": message["stream_errors"]} if "stream_errors" in message else {})


def plain_view(shape: Shape, body: Any) -> Any:
    if not isinstance(body, dict):
        return {"unparsed": body}
    what = kind(shape)
    if what == "json":
        return body
    if what == "messages":
        return message_view(body)
    if what == "responses":
        return response_view(body)
    if what == "models":
        return {"object": body.get("object"), "ids": sorted(model.get("id") for model in body.get("data") or [])}
    choices = []
    for choice in sorted(body.get("choices") or [], key=lambda c: c.get("index", 0)):
        if what == "chat":
            message = choice.get("message") or {}
            choices.append({
                "index": choice.get("index"),
                "role": message.get("role"),
                "content": message.get("content"),
                "reasoning": message.get("reasoning", message.get("reasoning_content")),
                "tool_calls": [{"type": call.get("type"), "name": (call.get("function") or {}).get("name"),
                                "arguments": (call.get("function") or {}).get("arguments")}
                               for call in message.get("tool_calls") or []],
                "finish_reason": choice.get("finish_reason"),
                "logprobs": chat_logprobs(choice.get("logprobs")),
            })
        else:
            choices.append({"index": choice.get("index"), "text": choice.get("text"),
                            "finish_reason": choice.get("finish_reason"),
                            "logprobs": completion_logprobs(choice.get("logprobs"))})
    return {"object": body.get("object"), "model": body.get("model"), "choices": choices, "usage": usage_of(body.get("usage"))}


def reassemble(shape: Shape, chunks: list[dict]) -> dict:
    """A stream as one answer: deltas concatenated per choice (and per tool call), finish_reason from the last."""
    what = kind(shape)
    if what == "messages":
        return message_from_events(chunks)
    if what == "responses":  # the last event carries the whole response
        completed = [c.get("response") for c in chunks if c.get("type") in ("response.completed", "response.incomplete")]
        errors = [c for c in chunks if c.get("type") == "error"]
        return response_view(completed[-1] if completed else {}) | ({"stream_errors": errors} if errors else {})
    choices: dict[int, dict] = {}
    usage, errors, objects, models = None, [], set(), set()
    for chunk in chunks:
        if "error" in chunk:
            errors.append((chunk["error"] or {}).get("code") if isinstance(chunk["error"], dict) else chunk["error"])
            continue
        objects.add(chunk.get("object"))
        models.add(chunk.get("model"))
        if chunk.get("usage"):
            usage = usage_of(chunk["usage"])
        for choice in chunk.get("choices") or []:
            index = choice.get("index", 0)
            if what == "chat":
                state = choices.setdefault(index, {"index": index, "role": None, "content": None, "reasoning": None,
                                                   "tool_calls": {}, "finish_reason": None, "logprobs": None})
                delta = choice.get("delta") or {}
                if delta.get("role"):
                    state["role"] = delta["role"]
                for field, key in (("content", "content"), ("reasoning", "reasoning"), ("reasoning", "reasoning_content")):
                    if delta.get(key) is not None:
                        state[field] = (state[field] or "") + delta[key]
                for call in delta.get("tool_calls") or []:
                    slot = state["tool_calls"].setdefault(call.get("index", 0), {"type": None, "name": None, "arguments": ""})
                    slot["type"] = call.get("type") or slot["type"]
                    function = call.get("function") or {}
                    if function.get("name"):
                        slot["name"] = (slot["name"] or "") + function["name"]
                    slot["arguments"] += function.get("arguments") or ""
                piece = chat_logprobs(choice.get("logprobs"))
                if piece is not None:
                    state["logprobs"] = (state["logprobs"] or []) + piece
            else:
                state = choices.setdefault(index, {"index": index, "text": "", "finish_reason": None, "logprobs": None})
                state["text"] += choice.get("text") or ""
                piece = completion_logprobs(choice.get("logprobs"))
                if piece is not None:
                    merged = state["logprobs"] or {key: [] for key in piece}
                    for key, values in piece.items():
                        merged[key] = (merged.get(key) or []) + (values or [])
                    state["logprobs"] = merged
            if choice.get("finish_reason") is not None:
                state["finish_reason"] = choice["finish_reason"]
    ordered = []
    for index in sorted(choices):
        state = choices[index]
        if what == "chat":
            state["tool_calls"] = [state["tool_calls"][i] for i in sorted(state["tool_calls"])]
        ordered.append(state)
    view = {"object": sorted(o for o in objects if o), "model": sorted(m for m in models if m), "choices": ordered,
            "usage": usage}
    if errors:
        view["stream_errors"] = errors
    return view


# --- comparing ----------------------------------------------------------------------


def differences(a: Any, b: Any, path: str = "") -> list[str]:
    """Where `a` (vllm serve) and `b` (kvlane) differ; floats within LOGPROB_TOLERANCE are equal."""
    if isinstance(a, float) or isinstance(b, float):
        if isinstance(a, (int, float)) and isinstance(b, (int, float)) and not isinstance(a, bool) and not isinstance(b, bool):
            if (math.isinf(a) and a == b) or abs(a - b) <= LOGPROB_TOLERANCE:
                return []
        return [f"{path or '.'}: vllm={a!r} kvlane={b!r}"]
    if isinstance(a, dict) and isinstance(b, dict):
        found = []
        for key in sorted(set(a) | set(b), key=str):
            if key not in a or key not in b:
                found.append(f"{path}.{key}: vllm={short(a.get(key, '<absent>'))} kvlane={short(b.get(key, '<absent>'))}")
            else:
                found += differences(a[key], b[key], f"{path}.{key}")
        return found
    if isinstance(a, list) and isinstance(b, list):
        found = []
        if len(a) != len(b):
            found.append(f"{path}: length vllm={len(a)} kvlane={len(b)}")
        for i, (x, y) in enumerate(zip(a, b)):
            found += differences(x, y, f"{path}[{i}]")
        return found
    return [] if a == b else [f"{path or '.'}: vllm={short(a)} kvlane={short(b)}"]


def short(value: Any, limit: int = 160) -> str:
    text = json.dumps(value, ensure_ascii=False) if not isinstance(value, str) else json.dumps(value, ensure_ascii=False)
    return text if len(text) <= limit else text[:limit] + "…"


def compare(shape: Shape, reference: dict, candidate: dict) -> list[str]:
    if reference["status"] != candidate["status"]:
        return [f"status: vllm={reference['status']} kvlane={candidate['status']}",
                f"vllm body: {reference['excerpt'][:240]}", f"kvlane body: {candidate['excerpt'][:240]}"]
    if reference["status"] != 200:
        return []
    return differences(reference["view"], candidate["view"])


async def run_all(servers: Servers, shapes: list[Shape]) -> list[dict]:
    timeout = aiohttp.ClientTimeout(total=REQUEST_TIMEOUT_S)
    async with aiohttp.ClientSession(timeout=timeout) as vllm_session, aiohttp.ClientSession(timeout=timeout) as kvlane_session:
        results = []
        for shape in shapes:
            # The two servers at once (each its own engine), but one shape at a time to each: batches never differ.
            reference, candidate = await asyncio.gather(ask_safely(vllm_session, servers.vllm_url, shape),
                                                        ask_safely(kvlane_session, servers.kvlane_url, shape))
            diffs = compare(shape, reference, candidate)
            results.append({"name": shape.name, "path": shape.path, "stream": shape.stream, "notes": shape.notes,
                            "identical": not diffs, "diffs": diffs, "request": shape.body, "vllm": reference,
                            "kvlane": candidate})
        return results


async def ask_safely(session: aiohttp.ClientSession, base_url: str, shape: Shape) -> dict:
    try:
        return await ask(session, base_url, shape)
    except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as exc:  # a dropped or broken answer is a mismatch too
        return {"status": f"failed: {type(exc).__name__}: {exc}", "view": None, "excerpt": "", "seconds": None}


def test_same_answers_as_vllm_serve(servers: Servers, tiny_model: Path) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(tiny_model))
    shapes = build_shapes(tokenizer, MODEL, MAX_MODEL_LEN)
    started = time.monotonic()
    results = asyncio.run(run_all(servers, shapes))
    elapsed = time.monotonic() - started
    # Outside pytest's own temp dirs, which later runs (of other engineers too) rotate away.
    out = Path(tempfile.mkdtemp(prefix="kvlane-api-differential-")) / "results.json"
    out.write_text(json.dumps(results, indent=1, ensure_ascii=False, default=str))
    identical = [r for r in results if r["identical"]]
    print(f"\nresults: {out} ({len(shapes)} shapes in {elapsed:.0f}s)")
    for result in results:
        if not result["identical"]:
            print(f"- {result['name']}:")
            for line in result["diffs"][:MAX_DIFFS_PER_SHAPE]:
                print(f"    {line}")
            if len(result["diffs"]) > MAX_DIFFS_PER_SHAPE:
                print(f"    … {len(result['diffs']) - MAX_DIFFS_PER_SHAPE} more")
    summary = f"{len(identical)} of {len(results)} identical"
    print(summary)
    assert len(identical) == len(results), summary
