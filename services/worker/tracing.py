"""The spans of a request's life on a worker.

* `decode`: the request running here, from acceptance to its end (finished,
  aborted, failed); on an aggregated node it covers the prefill too. Its
  first output is a span event, not a span: nothing runs per token.
* `prefill` (prefill node): the prompt run and the hand-off, with a child
  `kv.handoff` for handing the request and its `KvRef` to the decode node
  (the decode node's spans descend from it).
* `kv.transfer` (decode node): from taking the `KvRef` until the KV is in
  place (the first output), with the bytes and the link they crossed.
"""

from __future__ import annotations

from opentelemetry.trace import Span, Tracer

from contracts.messages import KvRef, PrefillRequest, RequestToRun, WorkerRegistration
from shared import genai
from shared.telemetry import set_error

FIRST_OUTPUT_EVENT = "first_output"


def request_span(tracer: Tracer, name: str, registration: WorkerRegistration, request: RequestToRun) -> Span:
    """A span for `request` on this node, child of the current context (the bus handler's span)."""
    span = tracer.start_span(name)
    if span.is_recording():
        attributes = {
            "kvlane.request_id": request.request_id,
            "kvlane.worker.id": registration.worker_id,
            "kvlane.worker.role": registration.role,
            "kvlane.worker.engine": registration.engine,
            genai.REQUEST_MODEL: request.model,
            genai.REQUEST_MAX_TOKENS: request.sampling.max_tokens,
            genai.USAGE_INPUT_TOKENS: len(request.prompt_token_ids),
            "kvlane.resumed_tokens": len(request.resume_token_ids),
        }
        if isinstance(request, PrefillRequest):
            attributes["kvlane.decode_worker.id"] = request.decode_worker_id
        span.set_attributes(attributes)
    return span


def end_request_span(span: Span, outcome: str, failure: str | None, completion_tokens: int | None = None,
                     cached_tokens: int | None = None) -> None:
    """End a `decode` or `prefill` span: `outcome` is the finish reason (or `handed_off`); `failure` an error code."""
    if span.is_recording():
        attributes: dict[str, str | int] = {"kvlane.outcome": outcome}
        if completion_tokens is not None:
            attributes[genai.USAGE_OUTPUT_TOKENS] = completion_tokens
        if cached_tokens is not None:
            attributes[genai.USAGE_CACHE_READ_INPUT_TOKENS] = cached_tokens
        span.set_attributes(attributes)
        if failure is not None:
            set_error(span, failure)
    span.end()


def kv_attributes(ref: KvRef, link: str) -> dict[str, str | int]:
    return {
        "kvlane.kv.bytes": ref.kv_bytes,
        "kvlane.kv.tokens": ref.num_tokens,
        "kvlane.kv.link": link,
        "kvlane.kv.source_worker.id": ref.source_worker_id,
    }


class KvTransferSpan:
    """`kv.transfer` on a decode node: open from taking the `KvRef` until the KV is here (or given up on)."""

    def __init__(self, tracer: Tracer, ref: KvRef, link: str) -> None:
        self.span = tracer.start_span("kv.transfer", attributes=kv_attributes(ref, link))
        self._open = True

    def pull_failed(self, attempt: int, error: str) -> None:
        self.span.add_event("kv_pull_failed", {"kvlane.attempt": attempt, "kvlane.error": error})

    def done(self, outcome: str, attempts: int, failure: str | None = None) -> None:
        """`outcome`: pulled (the KV is here), recomputed (every pull failed: a local prefill), or aborted."""
        if not self._open:
            return
        self._open = False
        self.span.set_attributes({"kvlane.outcome": outcome, "kvlane.kv.pull_attempts": attempts})
        if failure is not None:
            set_error(self.span, failure)
        self.span.end()
