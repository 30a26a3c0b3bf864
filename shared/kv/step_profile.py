"""Step-time model of the sim engine: how long one batched forward pass takes.

``step = a + b * prefill_tokens + c * decode_seqs + d * kv_tokens``

* ``a``: fixed cost of any step. On a GPU a step reads every weight once, so
  ``a`` is about weight bytes / memory bandwidth.
* ``b``: compute per prompt token (2 FLOPs per parameter per token).
* ``c``: extra cost per decoding sequence (its token's share of the matmuls
  plus sampling and bookkeeping).
* ``d``: attention reads the KV cache: KV bytes per token / bandwidth, paid
  for every token of context of every sequence in the step.

Work per request outside the forward pass has the two terms llm-d's BLIS
simulator gives it beside its per-step ones (a fixed cost per request, a
cost per output token):

``+ per_request * requests admitted for the first time + per_output_token * tokens emitted``

BLIS adds them to the request's latency alone; here they lengthen the step
that admits the request or emits the token, because vLLM v1's engine core
does that work (taking the request in, setting up its slot in the batch,
building each output) between forward passes, so the whole batch waits.
The serving process hands requests to the engine core one at a time, and
an idle engine core starts a step on the first: ``lone_first_step`` runs
the first request of a burst that reaches an idle engine alone.

Two more terms, both 0 unless fitted (``kvlane calibrate``):

* ``b2 * prefill_tokens**2``: the cost of a prompt token grows with the
  step's size. On the tiny CPU model the TTFT of bursts grew by ~10 us per
  prompt token between 512 and 1024 tokens, ~18 us between 1024 and 2048
  and more beyond (likely a big step's activations outgrowing the caches);
  with a linear ``b`` alone the sim ran high on a burst of 4 x 256 tokens
  and low on one of 12 x 256 (up to +17% and -22%). Fitted values vary
  from run to run (0 to 3 ns per squared token: at most 13 ms in a step
  of 2048 tokens), ``b`` taking up what ``b2`` leaves.
* ``wake_latency``: added to the first step after requests reach an idle
  engine. A request's trip through the serving process, to the engine core
  and its first token's trip back (1.5 ms each way for a lone request, up
  to 3-5 ms in a burst of 16, tiny CPU model) are latency no step
  accounts for; on a busy engine they overlap the running step. Fitted:
  2.3-4.7 ms.

The GPU profiles below are derived, not measured: a roofline with
efficiency factors, written out as code so each number can be traced to a
public figure (``/work/shared/design/REFERENCE-NUMBERS.md``). A profile
fitted on a real engine (``kvlane calibrate``) is loaded by naming its JSON
file: ``get_profile("file:loadtest/results/calibrated-profile.json")``.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from types import MappingProxyType
from typing import Annotated, Any, NamedTuple

import msgspec

from shared.kv.links import kv_bytes_per_token


class StepTimeProfile(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Coefficients of the linear step-time model (seconds)."""

    name: str
    a: float  # seconds per step
    b: float  # seconds per prefill token
    c: float  # seconds per decoding sequence
    d: float = 0.0  # seconds per KV token attended (sum of context lengths)
    # KV cache bytes per token of the modelled model (for hand-off transfers).
    kv_bytes_per_token: int = 0
    per_request: float = 0.0  # seconds per request, in the step that first admits it
    per_output_token: float = 0.0  # seconds per token emitted (the first one included)
    # An idle engine's first step runs only the first request of a burst that
    # arrives at it; the rest join the next step.
    lone_first_step: bool = False
    b2: float = 0.0  # seconds per squared prefill token of a step
    wake_latency: float = 0.0  # seconds, in the first step after requests reach an idle engine

    def step_seconds(
        self,
        prefill_tokens: int,
        decode_seqs: int,
        kv_tokens: int,
        new_requests: int = 0,
        emitted_tokens: int = 0,
        wakes: bool = False,
    ) -> float:
        """Simulated duration of a step (``wakes``: the first after requests reached an idle engine); 0 if it runs no tokens."""
        if prefill_tokens == 0 and decode_seqs == 0:
            return 0.0
        return (
            self.a
            + self.b * prefill_tokens
            + self.b2 * prefill_tokens * prefill_tokens
            + self.c * decode_seqs
            + self.d * kv_tokens
            + self.per_request * new_requests
            + self.per_output_token * emitted_tokens
            + (self.wake_latency if wakes else 0.0)
        )


# --- derivation of the GPU profiles ----------------------------------------------

_BF16_BYTES = 2
# Fraction of datasheet HBM bandwidth that streaming large weight and KV
# tensors achieves in practice (our assumption: roughly what memcpy-like
# kernels reach on A100/H100); the roofline itself is only a lower bound.
_HBM_EFFICIENCY = 0.8
# Achievable share of dense bf16 peak in prefill GEMMs (50-60% is typical).
_PREFILL_FLOP_UTILISATION = 0.55


class _Gpu(NamedTuple):
    hbm_bytes_per_s: float
    bf16_flops: float  # dense


class _Model(NamedTuple):
    params: float
    layers: int
    kv_heads: int
    head_dim: int


def _roofline_profile(name: str, model: _Model, gpu: _Gpu, gpus: int) -> StepTimeProfile:
    """Profile of a bf16 ``model`` tensor-parallel over ``gpus`` x ``gpu``.

    Tensor parallelism splits weights, KV heads and FLOPs evenly, so every
    term divides by ``gpus``; all-reduce latency is left out (a few ms per
    step at TP4 at most, inside the error of this sketch).
    """
    bandwidth = gpus * gpu.hbm_bytes_per_s * _HBM_EFFICIENCY
    flops_per_token = 2.0 * model.params
    kv_bytes = kv_bytes_per_token(model.layers, model.kv_heads, model.head_dim, _BF16_BYTES)
    return StepTimeProfile(
        name=name,
        a=model.params * _BF16_BYTES / bandwidth,
        b=flops_per_token / (gpus * gpu.bf16_flops * _PREFILL_FLOP_UTILISATION),
        # A decode token's matmuls partly hide under the weight read that `a`
        # already pays for, so a linear fit lands near the cost at full peak:
        # inference-sim/BLIS's fitted per-decode-token terms on H100 (13.6 us
        # for Llama-2-7B, 35.2 us for Llama-2-70B) equal 2 * params / peak
        # for 6.7B on one GPU and 69B on four, within 3%.
        c=flops_per_token / (gpus * gpu.bf16_flops),
        d=kv_bytes / bandwidth,
        kv_bytes_per_token=kv_bytes,
    )


# REFERENCE-NUMBERS.md, hardware table: A100 SXM 80GB ~2.0 TB/s and ~312
# TFLOP/s bf16 dense; H100 SXM ~3.35 TB/s and ~989 TFLOP/s.
_A100_80G = _Gpu(hbm_bytes_per_s=2.0e12, bf16_flops=312e12)
_H100_80G = _Gpu(hbm_bytes_per_s=3.35e12, bf16_flops=989e12)
# REFERENCE-NUMBERS.md, model shapes: Llama-3-8B 32 layers, 8 KV heads,
# head dim 128, 8.0 B params (KV 128 KiB/token); Llama-3-70B 80 layers,
# 8 KV heads, head dim 128, 70.6 B params (KV 320 KiB/token).
_LLAMA3_8B = _Model(params=8.0e9, layers=32, kv_heads=8, head_dim=128)
_LLAMA3_70B = _Model(params=70.6e9, layers=80, kv_heads=8, head_dim=128)

NAMED_PROFILES: Mapping[str, StepTimeProfile] = MappingProxyType(
    {
        # No simulated GPU time at all: measures the control plane alone.
        "zero": StepTimeProfile(name="zero", a=0.0, b=0.0, c=0.0, d=0.0),
        # A tiny random-weight model on this project's 2-core CPU machines.
        # kvlane's tiny model: 2 layers, 1 KV head of 64, float32.
        "tiny-cpu": StepTimeProfile(
            name="tiny-cpu", a=2e-3, b=2e-5, c=2e-4, d=0.0, kv_bytes_per_token=kv_bytes_per_token(2, 1, 64, 4)
        ),
        # a 10.0 ms, b 93 us, c 51 us, d 82 ns.
        "a100-80g-llama3-8b": _roofline_profile("a100-80g-llama3-8b", _LLAMA3_8B, _A100_80G, gpus=1),
        # a 6.0 ms, b 29 us, c 16 us, d 49 ns.
        "h100-80g-llama3-8b": _roofline_profile("h100-80g-llama3-8b", _LLAMA3_8B, _H100_80G, gpus=1),
        # 141 GB of bf16 weights over 4 x 80 GB. a 22 ms, b 206 us, c 113 us, d 51 ns.
        "a100-80g-llama3-70b-tp4": _roofline_profile(
            "a100-80g-llama3-70b-tp4", _LLAMA3_70B, _A100_80G, gpus=4
        ),
        # a 13 ms, b 65 us, c 36 us, d 31 ns. BLIS's fitted Llama-2-70B H100
        # intercept (18 ms) sits above our `a`: it also holds engine CPU time.
        "h100-80g-llama3-70b-tp4": _roofline_profile(
            "h100-80g-llama3-70b-tp4", _LLAMA3_70B, _H100_80G, gpus=4
        ),
    }
)


FILE_PREFIX = "file:"


class ProfileFileError(KeyError):
    """A ``file:`` profile that cannot be read; a KeyError, as for unknown names, so callers catch one type."""

    def __str__(self) -> str:  # KeyError would repr-quote the message
        return str(self.args[0])


_Seconds = Annotated[float, msgspec.Meta(ge=0.0)]


class _ProfileFile(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """What ``kvlane calibrate`` writes: the coefficients, strictly typed, plus free-form metadata."""

    name: str
    # A negative coefficient would make some steps take negative time.
    a: _Seconds
    b: _Seconds
    c: _Seconds
    d: _Seconds = 0.0
    kv_bytes_per_token: Annotated[int, msgspec.Meta(ge=0)] = 0
    # Absent from files written before the per-request terms existed: no such costs.
    per_request: _Seconds = 0.0
    per_output_token: _Seconds = 0.0
    lone_first_step: bool = False
    # Absent from files written before these terms existed: a linear prefill cost, no wake latency.
    b2: _Seconds = 0.0
    wake_latency: _Seconds = 0.0
    # Listed (as optional) so that the strict decode accepts them; the sim ignores them.
    fitted_on: dict[str, Any] | None = None
    fit_error: dict[str, Any] | None = None


def load_profile_file(path: str | Path) -> StepTimeProfile:
    """A StepTimeProfile from a calibrated-profile JSON file; ProfileFileError saying why not."""
    try:
        raw = Path(path).expanduser().read_bytes()
    except OSError as exc:
        raise ProfileFileError(f"step-time profile file {str(path)!r}: cannot read it ({exc.strerror})") from None
    try:
        spec = msgspec.json.decode(raw, type=_ProfileFile)
    except msgspec.DecodeError as exc:  # also ValidationError: a missing or mistyped field
        raise ProfileFileError(f"step-time profile file {str(path)!r} is not a valid profile: {exc}") from None
    return StepTimeProfile(
        name=spec.name,
        a=spec.a,
        b=spec.b,
        c=spec.c,
        d=spec.d,
        kv_bytes_per_token=spec.kv_bytes_per_token,
        per_request=spec.per_request,
        per_output_token=spec.per_output_token,
        lone_first_step=spec.lone_first_step,
        b2=spec.b2,
        wake_latency=spec.wake_latency,
    )


def get_profile(name: str) -> StepTimeProfile:
    """The named profile, or ``file:<path>`` read from a calibrated-profile JSON file.

    KeyError naming the known profiles for an unknown name; ProfileFileError
    (a KeyError) for a file that is missing or not a valid profile.
    """
    if name.startswith(FILE_PREFIX):
        return load_profile_file(name[len(FILE_PREFIX) :])
    try:
        return NAMED_PROFILES[name]
    except KeyError:
        known = ", ".join(sorted(NAMED_PROFILES))
        raise KeyError(f"unknown step-time profile {name!r}; known profiles: {known} (or file:<path>)") from None
