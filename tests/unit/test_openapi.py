"""The ingress OpenAPI document (contracts/openapi.py)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest

from contracts.openapi import build_openapi

PREFIX = "#/components/schemas/"


@pytest.fixture(scope="module")
def doc() -> dict[str, Any]:
    return build_openapi("1.2.3")


def refs(node: Any) -> Iterator[str]:
    if isinstance(node, dict):
        for key, value in node.items():
            if key == "$ref":
                yield value
            else:
                yield from refs(value)
    elif isinstance(node, list):
        for item in node:
            yield from refs(item)


def test_header(doc: dict[str, Any]) -> None:
    assert doc["openapi"].startswith("3.1")
    assert doc["info"]["version"] == "1.2.3"
    assert doc["info"]["title"] == "kvlane"


def test_is_json_serialisable(doc: dict[str, Any]) -> None:
    assert json.loads(json.dumps(doc)) == doc


def test_paths(doc: dict[str, Any]) -> None:
    assert set(doc["paths"]) == {"/v1/chat/completions", "/v1/completions", "/v1/models", "/tokenize", "/detokenize",
                                 "/v1/messages", "/v1/responses", "/v1/responses/{response_id}", "/health", "/ready", "/metrics"}
    assert set(doc["paths"]["/v1/chat/completions"]) == {"post"}
    assert set(doc["paths"]["/v1/completions"]) == {"post"}
    for path in ("/v1/models", "/health", "/ready", "/metrics"):
        assert set(doc["paths"][path]) == {"get"}


def test_every_ref_resolves(doc: dict[str, Any]) -> None:
    schemas = doc["components"]["schemas"]
    found = list(refs(doc))
    assert found, "expected $refs in the document"
    for ref in found:
        assert ref.startswith(PREFIX), ref
        assert ref[len(PREFIX) :] in schemas, ref


def test_every_schema_is_reachable_or_a_top_level_type(doc: dict[str, Any]) -> None:
    referenced = {r[len(PREFIX) :] for r in refs(doc)}
    assert set(doc["components"]["schemas"]) <= referenced


def test_completion_operations(doc: dict[str, Any]) -> None:
    for path, request, response in [
        ("/v1/chat/completions", "ChatCompletionRequest", "ChatCompletion"),
        ("/v1/completions", "CompletionRequest", "Completion"),
    ]:
        post = doc["paths"][path]["post"]
        assert post["requestBody"]["required"] is True
        assert post["requestBody"]["content"]["application/json"]["schema"] == {"$ref": PREFIX + request}
        ok = post["responses"]["200"]["content"]
        # kvlane's notes (`kvlane.degraded`) come only with a response kvlane changed.
        assert ok["application/json"]["schema"] == {"anyOf": [{"$ref": PREFIX + response}, {"$ref": PREFIX + "Noted" + response}]}
        assert "text/event-stream" in ok
        for status in ("400", "404", "408", "413", "414", "429", "431", "500", "503", "504"):
            error = post["responses"][status]["content"]["application/json"]["schema"]
            assert error == {"$ref": PREFIX + "ErrorResponse"}
    # Each server-sent event: its `data` is a chunk's (or an error body's) JSON text, the last one `[DONE]`.
    event = doc["paths"]["/v1/chat/completions"]["post"]["responses"]["200"]["content"]["text/event-stream"]["schema"]
    assert event["required"] == ["data"]
    data = event["properties"]["data"]
    assert data["if"] == {"const": "[DONE]"} and data["else"]["contentMediaType"] == "application/json"
    assert data["else"]["contentSchema"] == {"anyOf": [
        {"anyOf": [{"$ref": PREFIX + "ChatCompletionChunk"}, {"$ref": PREFIX + "NotedChatCompletionChunk"}]},
        {"$ref": PREFIX + "ErrorResponse"},
    ]}
    noted = doc["components"]["schemas"]["NotedChatCompletion"]
    assert "kvlane" in noted["required"] and doc["components"]["schemas"]["KvlaneNotes"]["properties"]["degraded"]


def test_get_operations(doc: dict[str, Any]) -> None:
    models = doc["paths"]["/v1/models"]["get"]["responses"]
    assert models["200"]["content"]["application/json"]["schema"] == {"$ref": PREFIX + "ModelList"}
    ready = doc["paths"]["/ready"]["get"]["responses"]
    assert ready["200"]["content"]["application/json"]["schema"] == {"$ref": PREFIX + "HealthStatus"}
    assert "503" in ready
    assert "200" in doc["paths"]["/metrics"]["get"]["responses"]


def test_chat_request_schema(doc: dict[str, Any]) -> None:
    schema = doc["components"]["schemas"]["ChatCompletionRequest"]
    assert schema["type"] == "object"
    assert {"model", "messages"} <= set(schema["required"])
    assert set(schema["required"]) == {"model", "messages"}
    props = schema["properties"]
    max_tokens = props["max_tokens"]
    variants = max_tokens.get("anyOf", [max_tokens])
    integer = [v for v in variants if v.get("type") == "integer"]
    assert integer and integer[0]["minimum"] == 1
    assert props["messages"]["minItems"] == 1
    assert props["messages"]["items"] == {"$ref": PREFIX + "ChatMessage"}
    assert props["model"]["minLength"] == 1


def test_completion_request_schema(doc: dict[str, Any]) -> None:
    schema = doc["components"]["schemas"]["CompletionRequest"]
    assert set(schema["required"]) == {"model", "prompt"}
    max_tokens = schema["properties"]["max_tokens"]
    assert max_tokens["default"] == 16
    assert any(v.get("minimum") == 1 for v in max_tokens["anyOf"])


def test_chat_message_roles(doc: dict[str, Any]) -> None:
    message = doc["components"]["schemas"]["ChatMessage"]
    # Any role the model's chat template renders (vLLM's server accepts any).
    assert message["properties"]["role"] == {"type": "string", "minLength": 1}
    assert set(message["required"]) == {"role"}
