"""Expected service time of a request on a chain (pure).

The model is the sim engine's step-time line, `step = a + b*prefill_tokens
+ c*decode_seqs + d*kv_tokens`, with the coefficients the node advertises
(`WorkerRegistration.step_time`) or else those of a named fallback profile,
divided by the node's measured speed factor (`SpeedTracker`). It is used
for ranking chains per request (`jffc_per_request`), for prefill backlogs,
and for per-slot service rates in the response-time bounds.
"""

from __future__ import annotations

from msgspec import Struct

from contracts.messages import StepTime


class StepModel(Struct, frozen=True):
    a: float
    b: float
    c: float
    d: float = 0.0
    per_request: float = 0.0

    @classmethod
    def of(cls, step_time: StepTime) -> StepModel:
        return cls(step_time.a, step_time.b, step_time.c, step_time.d, step_time.per_request)

    def scaled(self, factor: float) -> StepModel:
        """The same node running `factor` times as fast."""
        if factor == 1.0 or factor <= 0:
            return self
        return StepModel(self.a / factor, self.b / factor, self.c / factor, self.d / factor, self.per_request / factor)

    def reference_seconds(self) -> float:
        """One typical busy step (64 prompt tokens, 8 sequences decoding over 1k tokens each): what node speeds compare."""
        return self.a + 64 * self.b + 8 * self.c + 8192 * self.d

    def imposed_seconds(self, *, uncached_tokens: int, prompt_tokens: int, output_tokens: int, running: float) -> float:
        """Delay a newcomer adds, summed over the `running` requests already on the node.

        Its prefill lengthens the steps they share by `b` per prompt token,
        and each of its decode steps adds `c + d*context` to a step they share;
        on average each of them shares half of the newcomer's decode steps.
        """
        if running <= 0:
            return 0.0
        per_decode_step = self.c + self.d * (prompt_tokens + output_tokens / 2)
        return running * (self.b * uncached_tokens + per_decode_step * output_tokens / 2)

    def busy_seconds(self, steps_per_s: float, prefill_tokens_per_s: float, batch: int, kv_tokens: int) -> float:
        """Seconds of profile work in one second that ran these rates at this batch."""
        return steps_per_s * (self.a + self.c * batch + self.d * kv_tokens) + self.b * prefill_tokens_per_s

    def prefill_seconds(self, uncached_tokens: int, factor: float) -> float:
        if uncached_tokens <= 0:
            return 0.0
        return (self.a + self.b * uncached_tokens) / factor

    def decode_seconds(self, output_tokens: int, batch: float, kv_tokens: float, factor: float) -> float:
        """`output_tokens` steps at `batch` sequences attending `kv_tokens` in total."""
        return output_tokens * (self.a + self.c * batch + self.d * kv_tokens) / factor

    def request_seconds(
        self,
        *,
        uncached_tokens: int,
        prompt_tokens: int,
        output_tokens: int,
        batch: float,
        node_kv_tokens: float,
        factor: float,
        transfer_s: float = 0.0,
    ) -> float:
        """The engine taking the request in + prefill(uncached prompt) + KV transfer + decode(output at the chain's batch)."""
        # This request's own context is, on average, its prompt plus half its output.
        kv_tokens = node_kv_tokens + prompt_tokens + output_tokens / 2
        return (
            self.per_request / factor
            + self.prefill_seconds(uncached_tokens, factor)
            + transfer_s
            + self.decode_seconds(output_tokens, batch, kv_tokens, factor)
        )
