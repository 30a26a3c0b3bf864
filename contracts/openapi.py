"""The OpenAPI document of the ingress HTTP API, generated from the Structs."""

from __future__ import annotations

import importlib.metadata
from typing import Any

import msgspec

from contracts import anthropic_api as anthropic
from contracts import openai_api as api
from contracts import responses_api as responses

_REF = "#/components/schemas/{name}"


def _json(schema_ref: dict[str, Any]) -> dict[str, Any]:
    return {"application/json": {"schema": schema_ref}}


def _error_responses(*statuses: int) -> dict[str, Any]:
    ref = {"$ref": _REF.format(name="ErrorResponse")}
    return {str(s): {"description": "Error in the OpenAI error shape", "content": _json(ref)} for s in statuses}


def _sse_event(chunk: dict[str, Any]) -> dict[str, Any]:
    """One server-sent event of a streamed completion (what OpenAPI 3.1 tools validate each event against).

    An event is not the chunk itself: its `data` is the chunk's JSON text (or,
    mid-stream, an error body), and the last event's data is `[DONE]`.
    """
    payload = {"anyOf": [chunk, {"$ref": _REF.format(name="ErrorResponse")}]}
    return {
        "type": "object",
        "required": ["data"],
        "properties": {
            "data": {"type": "string", "if": {"const": "[DONE]"}, "then": True,
                     "else": {"contentMediaType": "application/json", "contentSchema": payload}},
            "event": {"type": "string"},
            "id": {"type": "string"},
            "retry": {"type": "integer"},
        },
    }


# What the ingress's HTTP guard and limits answer besides the handlers' own errors (services/ingress/http_guard.py).
_EDGE_ERRORS = (408, 413, 414, 429, 431)


def package_version() -> str:
    try:
        return importlib.metadata.version("kvlane")
    except importlib.metadata.PackageNotFoundError:
        return "0.0.0+unknown"


def build_openapi(version: str | None = None) -> dict[str, Any]:
    types = [
        api.ChatCompletionRequest,
        api.ChatCompletion,
        api.ChatCompletionChunk,
        api.CompletionRequest,
        api.Completion,
        api.ModelList,
        api.ErrorResponse,
        api.HealthStatus,
        api.NotedChatCompletion,
        api.NotedChatCompletionChunk,
        api.NotedCompletion,
        api.TokenizeRequest,
        api.TokenizeResponse,
        api.DetokenizeRequest,
        api.DetokenizeResponse,
        anthropic.MessagesRequest,
        anthropic.Message,
        anthropic.StreamEvent,
        anthropic.ErrorEvent,
        responses.ResponsesRequest,
        responses.Response,
        responses.StreamEvent,
    ]
    (refs, components) = msgspec.json.schema_components(types, ref_template=_REF)
    (chat_req, plain_chat, plain_chat_chunk, comp_req, plain_comp, models, _, health, noted_chat, noted_chunk, noted_comp,
     tokenize_req, tokenize_resp, detokenize_req, detokenize_resp, messages_req, message, message_event, anthropic_error,
     responses_req, response, response_event) = refs
    # A response (or a stream's closing chunk) carries `kvlane` notes only when kvlane changed something.
    chat, chat_chunk, comp = ({"anyOf": [plain, noted]} for plain, noted in
                              ((plain_chat, noted_chat), (plain_chat_chunk, noted_chunk), (plain_comp, noted_comp)))

    def completion_op(summary: str, request: dict, response: dict, chunk: dict) -> dict[str, Any]:
        return {
            "post": {
                "summary": summary,
                "requestBody": {"required": True, "content": _json(request)},
                "responses": {
                    "200": {
                        "description": "The completion, or with stream=true an SSE stream of chunks ending with `data: [DONE]`",
                        "content": {**_json(response), "text/event-stream": {"schema": _sse_event(chunk)}},
                    },
                    **_error_responses(400, 404, 500, 503, 504, *_EDGE_ERRORS),
                },
            }
        }

    def post_op(summary: str, request: dict, response: dict, *errors: int) -> dict[str, Any]:
        return {
            "post": {
                "summary": summary,
                "requestBody": {"required": True, "content": _json(request)},
                "responses": {"200": {"description": summary, "content": _json(response)},
                              **_error_responses(*errors, *_EDGE_ERRORS)},
            }
        }

    def named_events(event: dict[str, Any]) -> dict[str, Any]:
        """A stream of SSE events that name their type (`event:`), each `data` one JSON event."""
        return {"type": "object", "required": ["data"], "properties": {
            "event": {"type": "string"},
            "data": {"type": "string", "contentMediaType": "application/json", "contentSchema": event}}}

    def responses_op() -> dict[str, Any]:
        return {
            "post": {
                "summary": "Create a response (OpenAI Responses API; `store` keeps it for `previous_response_id` on any ingress)",
                "requestBody": {"required": True, "content": _json(responses_req)},
                "responses": {
                    "200": {"description": "The response, or with stream=true an SSE stream of events",
                            "content": {**_json(response), "text/event-stream": {"schema": named_events(response_event)}}},
                    **_error_responses(400, 404, 500, 503, 504, *_EDGE_ERRORS),
                },
            }
        }

    def messages_op() -> dict[str, Any]:
        # Its own errors are in Anthropic's shape; the HTTP edge's (429, 413...) in OpenAI's.
        either = {"anyOf": [anthropic_error, {"$ref": _REF.format(name="ErrorResponse")}]}
        errors = {str(s): {"description": "An error", "content": _json(either)} for s in (400, 404, 500, 503, 504, *_EDGE_ERRORS)}
        event = named_events(message_event)
        return {
            "post": {
                "summary": "Create a message (Anthropic Messages API)",
                "requestBody": {"required": True, "content": _json(messages_req)},
                "responses": {
                    "200": {"description": "The message, or with stream=true an SSE stream of events",
                            "content": {**_json(message), "text/event-stream": {"schema": event}}},
                    **errors,
                },
            }
        }

    def get_op(summary: str, response: dict, *errors: int) -> dict[str, Any]:
        return {
            "get": {
                "summary": summary,
                "responses": {"200": {"description": summary, "content": _json(response)},
                              **_error_responses(*errors, *_EDGE_ERRORS)},
            }
        }

    return {
        "openapi": "3.1.0",
        "info": {"title": "kvlane", "version": version or package_version(), "description": "OpenAI-compatible LLM gateway"},
        "paths": {
            "/v1/chat/completions": completion_op("Create a chat completion", chat_req, chat, chat_chunk),
            "/v1/completions": completion_op("Create a text completion", comp_req, comp, comp),
            "/v1/messages": messages_op(),
            "/v1/responses": responses_op(),
            "/v1/responses/{response_id}": {"get": {
                "summary": "A stored response",
                "parameters": [{"name": "response_id", "in": "path", "required": True, "schema": {"type": "string"}}],
                "responses": {"200": {"description": "The stored response", "content": _json(response)},
                              **_error_responses(404, 503, *_EDGE_ERRORS)},
            }},
            "/v1/models": get_op("List the models served by live workers", models),
            "/tokenize": post_op("Token ids of a text or a conversation, as the model's tokenizer and chat template make them",
                                 tokenize_req, tokenize_resp, 400, 404, 503),
            "/detokenize": post_op("The text of token ids", detokenize_req, detokenize_resp, 400, 404, 503),
            "/health": get_op("Liveness of the ingress process", health),
            "/ready": get_op("Readiness: at least one live worker", health, 503),
            "/metrics": {"get": {"summary": "Prometheus metrics", "responses": {"200": {"description": "text exposition format"}}}},
        },
        "components": {"schemas": components},
    }


def wire_schema() -> dict[str, Any]:
    """JSON Schema of every message that travels on NATS, keyed by subject family."""
    from contracts import messages as m

    families = {
        "route_request": m.RouteRequest,
        "route_reply": m.RouteReply,
        "route_withdrawn": m.RouteWithdrawn,
        "worker_request": m.WorkerRequest,
        "worker_reply": m.WorkerReply,
        "stream_frame": m.StreamFrame,
        "request_finished": m.RequestFinished,
        "heartbeat": m.HeartbeatMessage,
        "worker_left": m.WorkerLeft,
        "kv_events": m.KvEvents,
    }
    refs, components = msgspec.json.schema_components(list(families.values()), ref_template="#/$defs/{name}")
    return {"$defs": components, "messages": dict(zip(families, refs, strict=True))}
