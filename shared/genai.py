"""OpenTelemetry GenAI semantic conventions as kvlane uses them: attribute
names, and the model-server metrics (`gen_ai.server.*`) the ingress records.

The conventions are still "Development" upstream; the names and histogram
bucket boundaries here follow the current ones (semantic-conventions-genai,
gen-ai-metrics.md and the inference span). kvlane's own attributes live
under `kvlane.*`.
"""

from __future__ import annotations

from collections.abc import Mapping

from opentelemetry.metrics import Meter

PROVIDER = "kvlane"

# Span and metric attributes (GenAI conventions).
OPERATION_NAME = "gen_ai.operation.name"
PROVIDER_NAME = "gen_ai.provider.name"
REQUEST_MODEL = "gen_ai.request.model"
REQUEST_MAX_TOKENS = "gen_ai.request.max_tokens"
REQUEST_TEMPERATURE = "gen_ai.request.temperature"
REQUEST_TOP_P = "gen_ai.request.top_p"
REQUEST_TOP_K = "gen_ai.request.top_k"
REQUEST_SEED = "gen_ai.request.seed"
REQUEST_STOP_SEQUENCES = "gen_ai.request.stop_sequences"
REQUEST_PRESENCE_PENALTY = "gen_ai.request.presence_penalty"
REQUEST_FREQUENCY_PENALTY = "gen_ai.request.frequency_penalty"
RESPONSE_ID = "gen_ai.response.id"
RESPONSE_MODEL = "gen_ai.response.model"
RESPONSE_FINISH_REASONS = "gen_ai.response.finish_reasons"
USAGE_INPUT_TOKENS = "gen_ai.usage.input_tokens"
USAGE_OUTPUT_TOKENS = "gen_ai.usage.output_tokens"
USAGE_CACHE_READ_INPUT_TOKENS = "gen_ai.usage.cache_read.input_tokens"
ERROR_TYPE = "error.type"

# Metric names; also the span attribute carrying the request's own time to first token.
TIME_TO_FIRST_TOKEN = "gen_ai.server.time_to_first_token"
TIME_PER_OUTPUT_TOKEN = "gen_ai.server.time_per_output_token"
REQUEST_DURATION = "gen_ai.server.request.duration"

# The span event at the first output token.
FIRST_TOKEN_EVENT = "gen_ai.first_token"

# ExplicitBucketBoundaries the conventions advise for each metric.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0)
TPOT_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5)
DURATION_BUCKETS = (0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56, 5.12, 10.24, 20.48, 40.96, 81.92)


def span_name(operation: str, model: str | None) -> str:
    """`{gen_ai.operation.name} {gen_ai.request.model}`, or the operation alone before the model is known."""
    return f"{operation} {model}" if model else operation


def time_per_output_token(duration_s: float, ttft_s: float, output_tokens: int) -> float | None:
    """Decode time per token after the first: (e2e - ttft) / (tokens - 1); None for fewer than two tokens."""
    if output_tokens < 2:
        return None
    return max(0.0, duration_s - ttft_s) / (output_tokens - 1)


class GenAiServerMetrics:
    """The three `gen_ai.server.*` histograms (seconds), from one meter."""

    def __init__(self, meter: Meter) -> None:
        self._ttft = meter.create_histogram(
            TIME_TO_FIRST_TOKEN, unit="s", description="Time to generate first token for successful responses.",
            explicit_bucket_boundaries_advisory=TTFT_BUCKETS,
        )
        self._tpot = meter.create_histogram(
            TIME_PER_OUTPUT_TOKEN, unit="s",
            description="Time per output token generated after the first token for successful responses.",
            explicit_bucket_boundaries_advisory=TPOT_BUCKETS,
        )
        self._duration = meter.create_histogram(
            REQUEST_DURATION, unit="s",
            description="Generative AI server request duration such as time-to-last byte or last output token.",
            explicit_bucket_boundaries_advisory=DURATION_BUCKETS,
        )

    def record(
        self,
        operation: str,
        model: str | None,
        duration_s: float,
        ttft_s: float | None = None,
        output_tokens: int = 0,
        error: str | None = None,
    ) -> None:
        """One request ended: its duration always; TTFT and TPOT when it succeeded."""
        attributes = metric_attributes(operation, model)
        if error is not None:
            self._duration.record(duration_s, {**attributes, ERROR_TYPE: error})
            return
        self._duration.record(duration_s, attributes)
        if ttft_s is not None:
            self._ttft.record(ttft_s, attributes)
            tpot = time_per_output_token(duration_s, ttft_s, output_tokens)
            if tpot is not None:
                self._tpot.record(tpot, attributes)


def metric_attributes(operation: str, model: str | None) -> Mapping[str, str]:
    attributes = {OPERATION_NAME: operation, PROVIDER_NAME: PROVIDER}
    if model:
        attributes[REQUEST_MODEL] = model
        attributes[RESPONSE_MODEL] = model
    return attributes
