"""A vLLM v1 logits processor that resumes a structured output partway through its grammar.

When a worker dies mid-stream, kvlane resumes the request elsewhere with what
was streamed appended to the prompt (`EngineRequest.resume_token_ids`). vLLM's
own structured output would start its grammar afresh at the first new token,
though the output is already partway through it. For such a request the worker
(vllm_api.py) takes the structured-output spec out of `SamplingParams` and puts
it, with the number of resumed tokens, under `extra_args[RESUMED_GRAMMAR]`; this
processor then does what vLLM's structured output would have done:

* the grammar is compiled by vLLM's own `XgrammarBackend.compile_grammar`, from
  the `StructuredOutputKey` vLLM derives (`get_structured_output_key`) and the
  request's stop tokens, so its masks are vLLM's;
* it is advanced over the resumed tokens (the prompt's last `resumed` tokens),
  then, before every sampling, over the tokens generated since (vLLM's
  `XgrammarGrammar.accept_tokens`: tokens after termination are ignored);
* the logits are masked with the grammar's next-token bitmask, by xgrammar's
  `apply_token_bitmask_inplace` as vLLM applies it; a terminated grammar masks
  nothing, as in vLLM.

A request without the entry costs a dict lookup when it joins the batch and
nothing at each step. This module runs in vLLM's engine-core process: it
imports vLLM and xgrammar only, and is loaded by its qualified name
(`RESUMED_GRAMMAR_PROCESSOR`). It implements the V1 model runner's interface;
the worker loads it only where that runner runs (see vllm_engine.py).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import torch

from vllm import SamplingParams
from vllm.v1.sample.logits_processor.builtin import process_dict_updates
from vllm.v1.sample.logits_processor.interface import BatchUpdate, LogitsProcessor
from vllm.v1.structured_output.backend_types import StructuredOutputOptions

log = logging.getLogger("kvlane.worker.vllm.resumed_grammar")

# The `SamplingParams.extra_args` entry: {"type": <StructuredOutputOptions name>, "spec": <grammar spec>,
# "resumed": <how many of the prompt's last tokens were generated under the grammar>}.
RESUMED_GRAMMAR = "kvlane_resumed_grammar"
RESUMED_GRAMMAR_PROCESSOR = f"{__name__}:ResumedGrammarLogitsProcessor"


def resumed_grammar_entry(request_type: StructuredOutputOptions, spec: str, resumed: int) -> dict[str, Any]:
    return {"type": request_type.name, "spec": spec, "resumed": resumed}


def _parse_entry(entry: Any) -> tuple[StructuredOutputOptions, str, int]:
    if not isinstance(entry, dict):
        raise ValueError(f"{RESUMED_GRAMMAR} must be an object")
    try:
        request_type = StructuredOutputOptions[entry["type"]]
    except (KeyError, TypeError):
        raise ValueError(f"{RESUMED_GRAMMAR}.type must name a structured output kind") from None
    spec, resumed = entry.get("spec"), entry.get("resumed")
    if not isinstance(spec, str):
        raise ValueError(f"{RESUMED_GRAMMAR}.spec must be a string")
    if not isinstance(resumed, int) or isinstance(resumed, bool) or resumed < 0:
        raise ValueError(f"{RESUMED_GRAMMAR}.resumed must be a non-negative integer")
    return request_type, spec, resumed


class _Resumed:
    """One request's grammar and how many of its output tokens it has seen."""

    def __init__(self, grammar: Any, output_tok_ids: list[int], stop_token_ids: Sequence[int]) -> None:
        self.grammar = grammar  # vLLM's XgrammarGrammar, or None once it failed
        self.output_tok_ids = output_tok_ids  # vLLM's running list of the request's output tokens
        self.seen = 0
        self.stop_token_ids = list(stop_token_ids)

    def fail(self, why: str) -> None:
        # vLLM ends a request whose tokens its grammar rejects with an error; a logits processor cannot, and must
        # never raise (that would kill the engine core). It lets the request stop instead.
        log.error("resumed grammar: %s; only stop tokens are allowed from here", why)
        self.grammar = None

    def catch_up(self) -> None:
        grammar, output = self.grammar, self.output_tok_ids
        if len(output) <= self.seen:
            return
        new = output[self.seen:]
        if -1 in new:  # async scheduling's placeholders, filled in just before sampling
            new = new[:new.index(-1)]
        self.seen += len(new)
        if grammar is None:
            return
        try:
            accepted = grammar.accept_tokens("resumed", new)
        except Exception as exc:  # never into the engine core's step
            self.fail(f"advancing the grammar failed: {exc!r}")
            return
        if not accepted:
            self.fail(f"the grammar rejected generated tokens {new}")


class ResumedGrammarLogitsProcessor(LogitsProcessor):
    """Masks a resumed request's logits with its structured-output grammar, advanced past what it already produced."""

    def __init__(self, vllm_config: Any, device: torch.device, is_pin_memory: bool) -> None:
        self._vllm_config = vllm_config
        self._max_num_reqs = vllm_config.scheduler_config.max_num_seqs
        self._backend: Any = None
        self._bitmask: torch.Tensor | None = None
        self._states: dict[int, _Resumed] = {}

    @classmethod
    def validate_params(cls, sampling_params: SamplingParams) -> None:
        entry = (sampling_params.extra_args or {}).get(RESUMED_GRAMMAR)
        if entry is None:
            return
        _parse_entry(entry)
        if sampling_params.structured_outputs is not None:
            raise ValueError(f"{RESUMED_GRAMMAR} replaces structured_outputs: a request cannot have both")

    def is_argmax_invariant(self) -> bool:
        return False  # the mask decides greedy picks too

    def _xgrammar(self) -> Any:
        """vLLM's xgrammar backend, built as its StructuredOutputManager builds it (once, on first use)."""
        if self._backend is None:
            # vLLM internals (the backend, its grammars, how vLLM compiles one): tests/vllm/test_vllm_internals.py.
            from vllm.tokenizers import cached_tokenizer_from_config
            from vllm.v1.structured_output.backend_xgrammar import XgrammarBackend

            model_config = self._vllm_config.model_config
            self._backend = XgrammarBackend(self._vllm_config,
                                            tokenizer=cached_tokenizer_from_config(model_config=model_config),
                                            vocab_size=model_config.get_vocab_size())
            self._bitmask = self._backend.allocate_token_bitmask(self._max_num_reqs)
        return self._backend

    def _start(self, params: SamplingParams, prompt_tok_ids: list[int] | None,
               output_tok_ids: list[int]) -> _Resumed | None:
        extra = params.extra_args
        entry = extra.get(RESUMED_GRAMMAR) if extra else None
        if entry is None:
            return None
        state = _Resumed(None, output_tok_ids, sorted(params.all_stop_token_ids))
        try:
            request_type, spec, resumed = _parse_entry(entry)
            backend = self._xgrammar()
            if not state.stop_token_ids:  # ignore_eos: the end-of-sequence token still ends the output's text
                eos = getattr(backend.tokenizer, "eos_token_id", None)
                state.stop_token_ids = [eos] if isinstance(eos, int) else []
            # As StructuredOutputManager._create_grammar compiles it.
            grammar = backend.compile_grammar(request_type, spec, stop_token_ids=params.all_stop_token_ids)
            prompt = list(prompt_tok_ids or ())
            if resumed > len(prompt):
                state.fail(f"{resumed} resumed tokens, but a prompt of {len(prompt)}")
                return state
            done = prompt[len(prompt) - resumed:] if resumed else []
            if done and not grammar.accept_tokens("resumed", done):
                state.fail(f"the grammar rejected the resumed tokens {done}")
                return state
        except Exception as exc:  # never into the engine core's step
            state.fail(f"starting the grammar failed: {exc!r}")
            return state
        state.grammar = grammar
        # A request re-added after a preemption has output already: catch_up feeds it.
        return state

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        if batch_update is not None:
            process_dict_updates(self._states, batch_update, self._start)

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        if not self._states:
            return logits
        import xgrammar as xgr

        bitmask = self._bitmask
        rows: list[int] = []
        forced: list[tuple[int, list[int]]] = []
        for index, state in self._states.items():
            if index >= logits.shape[0]:
                continue
            # Here, not in update_state: with async scheduling, the last step's tokens are in only now.
            state.catch_up()
            grammar = state.grammar
            if grammar is None:
                if state.stop_token_ids:  # else (nothing to end it with) the row is left as it is
                    forced.append((index, state.stop_token_ids))
            elif not grammar.is_terminated():
                assert bitmask is not None
                grammar.fill_bitmask(bitmask, index)
                rows.append(index)
        if rows:
            assert bitmask is not None
            mask = bitmask[: logits.shape[0]]
            if not logits.is_cpu:
                mask = mask.to(logits.device, non_blocking=True)
            # The rows not listed are left alone, whatever their (stale) bitmask rows hold.
            xgr.apply_token_bitmask_inplace(logits, mask, indices=rows)
        for index, allowed in forced:
            row = logits[index]
            kept = row[allowed].clone()
            row.fill_(float("-inf"))
            row[allowed] = kept
        return logits
