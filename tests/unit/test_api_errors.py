"""OpenAI-shaped errors and readable 400s for undecodable bodies (services/ingress/errors.py)."""

from __future__ import annotations

import json

import msgspec
import pytest

from contracts.messages import ErrorReply
from contracts.openai_api import ChatCompletionRequest, CompletionRequest, ErrorResponse
from services.ingress.errors import ApiError, from_decode_error

CHAT = msgspec.json.Decoder(ChatCompletionRequest)
COMPLETION = msgspec.json.Decoder(CompletionRequest)
MESSAGES = [{"role": "user", "content": "hi"}]


def decode_error(decoder: msgspec.json.Decoder, body: bytes | dict) -> ApiError:
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    with pytest.raises(msgspec.DecodeError) as info:
        decoder.decode(raw)
    return from_decode_error(info.value)


def test_valid_bodies_decode() -> None:
    assert CHAT.decode(json.dumps({"model": "m", "messages": MESSAGES}).encode()).model == "m"
    assert COMPLETION.decode(b'{"model": "m", "prompt": [1, 2]}').prompt == [1, 2]


@pytest.mark.parametrize("body", [b"{", b"not json", b'{"model": "m",}', b""])
def test_malformed_json(body: bytes) -> None:
    err = decode_error(CHAT, body)
    assert err.status == 400
    assert err.code == "invalid_json"
    assert err.param is None
    assert err.message.startswith("request body is not valid JSON")


@pytest.mark.parametrize(
    ("decoder", "body"),
    [
        (CHAT, {"model": "m", "messages": MESSAGES, "temprature": 0.5, "store": True, "metadata": {"k": "v"}}),
        (CHAT, {"model": "m", "messages": [{"role": "user", "content": "hi", "bogus": 1}]}),
        (CHAT, {"model": "m", "messages": MESSAGES, "stream": True, "stream_options": {"include_usag": True}}),
        (COMPLETION, {"model": "m", "prompt": "x", "min_tokens": 2, "repetition_penalty": 1.1}),
    ],
)
def test_unknown_fields_are_accepted_as_vllm_serve_accepts_them(decoder: msgspec.json.Decoder, body: dict) -> None:
    """vLLM's server ignores fields it does not know (and a vLLM engine reads its own extras from the body)."""
    decoder.decode(json.dumps(body).encode())


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"messages": MESSAGES}, "model"),
        ({"model": "m"}, "messages"),
    ],
)
def test_missing_top_level_field(body: dict, param: str) -> None:
    err = decode_error(CHAT, body)
    assert err.status == 400
    assert err.code == "missing_required_parameter"
    assert err.param == param
    assert err.message == f"Missing required parameter: '{param}'"


def test_missing_prompt_in_completion() -> None:
    err = decode_error(COMPLETION, {"model": "m"})
    assert (err.code, err.param) == ("missing_required_parameter", "prompt")


def test_missing_nested_field() -> None:
    err = decode_error(CHAT, {"model": "m", "messages": [{"content": "hi"}]})
    assert (err.code, err.param) == ("missing_required_parameter", "messages.role")


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"max_tokens": "ten"}, "max_tokens"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"temperature": 3.0}, "temperature"),
        ({"top_p": 0}, "top_p"),
        ({"n": 0}, "n"),
        ({"stream": "yes"}, "stream"),
        ({"stop": ["a", "b", "c", "d", "e"]}, "stop"),
        ({"model": ""}, "model"),
        ({"messages": []}, "messages"),
        ({"messages": [{"role": "", "content": "hi"}]}, "messages"),
        ({"logprobs": 3}, "logprobs"),
        ({"top_logprobs": 21}, "top_logprobs"),
        ({"tools": [{"type": "function", "function": {"name": ""}}]}, "tools"),
        ({"tool_choice": "sometimes"}, "tool_choice"),
    ],
)
def test_wrong_type_or_constraint(extra: dict, param: str) -> None:
    body = {"model": "m", "messages": MESSAGES, **extra}
    err = decode_error(CHAT, body)
    assert err.status == 400
    assert err.code == "invalid_value"
    assert err.param == param
    assert err.message.startswith("Invalid request: ")


def test_wrong_type_in_completion_prompt() -> None:
    err = decode_error(COMPLETION, {"model": "m", "prompt": 5})
    assert (err.code, err.param) == ("invalid_value", "prompt")
    err = decode_error(COMPLETION, {"model": "m", "prompt": ""})
    assert (err.code, err.param) == ("invalid_value", "prompt")


def test_top_level_type_error_has_no_param() -> None:
    err = decode_error(CHAT, b"[1, 2]")
    assert err.code == "invalid_value"
    assert err.param is None


# --- ApiError ------------------------------------------------------------------------


def test_body_shape() -> None:
    err = ApiError(400, "bad thing", code="bad", param="x")
    body = json.loads(msgspec.json.encode(err.body()))
    assert body == {"error": {"message": "bad thing", "type": "invalid_request_error", "param": "x", "code": "bad"}}
    assert isinstance(err.body(), ErrorResponse)
    assert str(err) == "bad thing"


def test_body_without_code_or_param_has_nulls() -> None:
    body = json.loads(msgspec.json.encode(ApiError(500, "boom").body()))
    assert body["error"] == {"message": "boom", "type": "server_error", "param": None, "code": None}


@pytest.mark.parametrize(
    ("status", "kind"),
    [
        (400, "invalid_request_error"),
        (401, "authentication_error"),
        (403, "permission_denied_error"),
        (404, "invalid_request_error"),
        (413, "invalid_request_error"),
        (429, "rate_limit_error"),
        (499, "invalid_request_error"),
        (500, "server_error"),
        (502, "server_error"),
        (503, "server_error"),
        (504, "timeout_error"),
    ],
)
def test_type_by_status(status: int, kind: str) -> None:
    assert ApiError(status, "x").type == kind


def test_response_status_body_and_no_retry_after() -> None:
    response = ApiError(404, "no such model", code="model_not_found", param="model").response()
    assert response.status == 404
    assert response.content_type == "application/json"
    assert "Retry-After" not in response.headers
    body = json.loads(response.body)
    assert body["error"]["code"] == "model_not_found"
    assert body["error"]["param"] == "model"


@pytest.mark.parametrize(("seconds", "header"), [(1.0, "1"), (0.2, "1"), (0.0, "1"), (3.0, "3"), (7.4, "8"), (2.5, "3")])
def test_retry_after_header(seconds: float, header: str) -> None:
    response = ApiError(503, "busy", retry_after_s=seconds).response()
    assert response.status == 503
    assert response.headers["Retry-After"] == header


def test_from_reply() -> None:
    reply = ErrorReply(code="no_capacity", message="busy", status=503, retry_after_s=2.0)
    err = ApiError.from_reply(reply)
    assert (err.status, err.message, err.code, err.retry_after_s, err.param) == (503, "busy", "no_capacity", 2.0, None)
    assert err.response().headers["Retry-After"] == "2"
