"""The Responses API end to end: openai SDK → ingress (`/v1/responses`) → chat path → sim worker.

Two ingress services share the fleet's Redis, each on its own port: a
conversation stored through one is continued and fetched through the other.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from shared.config import to_env
from launch.fleet import Fleet
from launch.launcher import Process, free_port, wait_services_ready
from tests.integration.conftest import MODEL, launch, stop_and_check

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    fleet = launch(Path(tmp_path_factory.mktemp("responses")), workers=1)
    yield fleet
    stop_and_check(fleet)


@pytest.fixture(scope="module")
def second_ingress(fleet: Fleet) -> Iterator[tuple[Process, str]]:
    """Another ingress process on its own port, sharing the fleet's NATS and Redis."""
    port = free_port()
    env = to_env(fleet.config) | {"KVLANE__INGRESS__PORT": str(port), "KVLANE__INGRESS__INGRESS_ID": '"second"'}
    process = fleet.launcher.start_service("ingress", env, name="ingress-second-responses")
    try:
        wait_services_ready([process])
        yield process, f"http://127.0.0.1:{port}"
    finally:
        process.stop()


def client_of(base_url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{base_url}/v1", api_key="x", max_retries=0, timeout=30)


@pytest.fixture(scope="module")
def client(fleet: Fleet) -> openai.OpenAI:
    return client_of(fleet.base_url)


def test_text_input_reaching_max_output_tokens_is_incomplete(client: openai.OpenAI) -> None:
    response = client.responses.create(model=MODEL, input="Hello there", max_output_tokens=8)
    assert response.id.startswith("resp_") and response.object == "response" and response.model == MODEL
    assert response.status == "incomplete" and response.incomplete_details.reason == "max_output_tokens"
    [message] = response.output
    assert message.type == "message" and message.role == "assistant"
    assert message.content[0].type == "output_text" and message.content[0].annotations == []
    assert len(response.output_text.split()) == 8  # each sim token is one word
    assert response.usage.output_tokens == 8 and response.usage.input_tokens > 0
    assert response.usage.total_tokens == response.usage.input_tokens + 8
    assert response.max_output_tokens == 8 and response.tool_choice == "none" and response.tools == []


def test_instructions_reach_the_prompt(client: openai.OpenAI) -> None:
    plain = client.responses.create(model=MODEL, input="Tell me", max_output_tokens=2, store=False)
    instructed = client.responses.create(model=MODEL, input="Tell me", instructions="You are terse. Very terse indeed.",
                                         max_output_tokens=2, store=False)
    as_items = client.responses.create(model=MODEL, instructions="You are terse. Very terse indeed.", max_output_tokens=2,
                                       input=[{"role": "user", "content": [{"type": "input_text", "text": "Tell me"}]}],
                                       store=False)
    assert instructed.usage.input_tokens > plain.usage.input_tokens
    assert as_items.usage.input_tokens == instructed.usage.input_tokens
    assert instructed.instructions == "You are terse. Very terse indeed."


def test_streamed_events(client: openai.OpenAI) -> None:
    with client.responses.stream(model=MODEL, input="Count to ten", max_output_tokens=10) as stream:
        events = list(stream)
        final = stream.get_final_response()
    kinds = [event.type for event in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added", "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.completed"]
    assert [event.sequence_number for event in events] == list(range(len(events)))
    deltas = [event.delta for event in events if event.type == "response.output_text.delta"]
    assert len(deltas) == 10 and final.output_text == "".join(deltas)
    assert final.status == "incomplete" and final.usage.output_tokens == 10


def test_streamed_and_whole_agree_and_sse_lines_name_each_event(client: openai.OpenAI) -> None:
    whole = client.responses.create(model=MODEL, input="Once upon a time", max_output_tokens=6, extra_body={"seed": 7})
    raw = client.responses.with_raw_response.create(model=MODEL, input="Once upon a time", max_output_tokens=6,
                                                    extra_body={"seed": 7}, stream=True)
    assert raw.headers["content-type"].startswith("text/event-stream")
    frames = [frame for frame in raw.http_response.read().decode().split("\n\n") if frame]
    data = []
    for frame in frames:
        event_line, data_line = frame.split("\n")
        data.append(json.loads(data_line.removeprefix("data: ")))
        assert event_line.removeprefix("event: ") == data[-1]["type"]
    completed = data[-1]["response"]
    assert completed["output"][0]["content"][0]["text"] == whole.output_text
    assert completed["usage"]["output_tokens"] == whole.usage.output_tokens


def test_a_conversation_continues_on_another_replica(fleet: Fleet, client: openai.OpenAI,
                                                     second_ingress: tuple[Process, str]) -> None:
    process, second_url = second_ingress
    assert second_url != fleet.base_url and fleet.ingress is not None and process.popen.pid != fleet.ingress.pid
    other = client_of(second_url)
    first = client.responses.create(model=MODEL, input="My name is Ada.", instructions="Remember names.", max_output_tokens=4)
    # Through the other ingress process: the conversation comes from Redis, not from the first one's memory.
    second = other.responses.create(model=MODEL, input="What is my name?", previous_response_id=first.id, max_output_tokens=4)
    assert second.previous_response_id == first.id and second.instructions is None
    alone = other.responses.create(model=MODEL, input="What is my name?", max_output_tokens=4, store=False)
    # The history rode along: the first turn's input and answer precede the new input (its instructions do not).
    assert second.usage.input_tokens > alone.usage.input_tokens + first.usage.output_tokens
    # Streamed, a third turn through the first ingress continues the second.
    with client.responses.stream(model=MODEL, input="And again?", previous_response_id=second.id,
                                 max_output_tokens=4) as stream:
        third = stream.get_final_response()
    assert third.usage.input_tokens > second.usage.input_tokens + second.usage.output_tokens
    # Either replica returns any stored response.
    fetched = other.responses.retrieve(first.id)
    assert fetched.id == first.id and fetched.output_text == first.output_text and fetched.status == first.status
    assert client.responses.retrieve(third.id).output_text == third.output_text


def test_unknown_or_unstored_responses_are_a_404(client: openai.OpenAI) -> None:
    with pytest.raises(openai.NotFoundError) as caught:
        client.responses.create(model=MODEL, input="Hi", previous_response_id="resp_unknown", max_output_tokens=2)
    assert caught.value.body["message"] == "Response with id 'resp_unknown' not found."
    unstored = client.responses.create(model=MODEL, input="Hi", max_output_tokens=2, store=False)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)


def test_the_model_calls_a_function_tool(client: openai.OpenAI) -> None:
    """The sim model calls the first tool on a user's turn (its parser, `kvlane_sim`, finds the call)."""
    parameters = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
    tools = [{"type": "function", "name": "weather", "parameters": parameters}]
    response = client.responses.create(model=MODEL, input="Weather?", tools=tools, max_output_tokens=200)  # type: ignore[arg-type]
    (call,) = [item for item in response.output if item.type == "function_call"]
    assert call.name == "weather" and isinstance(json.loads(call.arguments)["city"], str)
