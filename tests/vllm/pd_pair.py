"""A prefill and a decode `VllmEngine` in one process, driven directly (no NATS, no fleet).

Run as a subprocess (keeps the engines' memory and threads out of pytest):
    python -m tests.vllm.pd_pair < request.json
The request is {"vllm": {VllmSettings fields}, "prompts": [[ids...]...], "max_tokens": N, "dead_port": P}.
For each prompt it prefills on the prefill engine, decodes on the decode
engine from the `KvRef`, then runs the same prompt aggregated (no KvRef) on
the prefill engine as the reference; then it pulls from a reference whose
producer is gone (nothing listens on `dead_port`) and from one that expired,
and falls back to a local prefill. It prints one line "RESULT {json}".
"""

from __future__ import annotations

import asyncio
import time

import msgspec

from tests.vllm.engine_subprocess import collect, print_result


async def run(spec: dict) -> dict:
    from contracts.messages import SamplingParams
    from services.worker.engines.base import EngineRequest, KvPullFailed
    from services.worker.engines.vllm_setup import build_vllm_engine
    from shared.config import VllmSettings, WorkerSettings

    def build(role: str):
        settings = WorkerSettings(model="tiny", engine="vllm", role=role, kv_hold_timeout_s=spec.get("hold_s", 30.0),
                                  vllm=msgspec.convert(spec["vllm"], VllmSettings))
        return build_vllm_engine(settings)[0]

    # One after the other: each engine core reads its side-channel port from
    # the environment when it starts, and each build picks a free port.
    prefill, decode = build("prefill"), None
    result: dict = {"prompts": []}
    try:
        started = time.monotonic()
        await prefill.start()
        decode = build("decode")
        await decode.start()
        result["start_s"] = time.monotonic() - started
        sampling = SamplingParams(max_tokens=spec["max_tokens"], temperature=0.0)
        for index, ids in enumerate(spec["prompts"]):
            request = EngineRequest(request_id=f"pd-{index}", prompt_token_ids=ids, sampling=sampling)
            t0 = time.monotonic()
            ref = await prefill.prefill(request, source_worker_id="p0", hold_s=30.0)
            prefill_s = time.monotonic() - t0
            # The prefill engine sits idle while the decode engine pulls: its
            # agent must serve the read without a progress thread of its own.
            await asyncio.sleep(spec.get("idle_before_decode_s", 0.0))
            t1 = time.monotonic()
            disaggregated = await collect(decode, msgspec.structs.replace(request, kv_ref=ref))
            t2 = time.monotonic()
            aggregated = await collect(prefill, msgspec.structs.replace(request, request_id=f"agg-{index}"))
            result["prompts"].append({"kv_ref": msgspec.to_builtins(ref), "disaggregated": disaggregated,
                                      "aggregated": aggregated, "prefill_s": prefill_s, "decode_s": t2 - t1})
        result["decode_stats"] = msgspec.to_builtins(decode.stats())
        # A producer that is gone: nothing listens on its side channel any more.
        dead = msgspec.structs.replace(ref, engine_id="gone-engine", port=spec["dead_port"], hold_s=30.0)
        request = EngineRequest(request_id="pd-dead", prompt_token_ids=spec["prompts"][0], sampling=sampling, kv_ref=dead)
        t0 = time.monotonic()
        try:
            failed = {"outcome": "output", **await collect(decode, request)}
        except KvPullFailed as exc:
            failed = {"outcome": "KvPullFailed", "message": str(exc)}
        failed["seconds"] = time.monotonic() - t0
        result["dead_producer"] = failed
        # The source's hold on the KV ended a second ago, on this host's clock.
        expired = msgspec.structs.replace(request, request_id="pd-expired", kv_held_until=time.monotonic() - 1)
        try:
            result["expired"] = {"outcome": "output", **await collect(decode, expired)}
        except KvPullFailed as exc:
            result["expired"] = {"outcome": "KvPullFailed", "message": str(exc)}
        # The fallback the worker takes after that: prefill locally on the decode engine.
        fallback = msgspec.structs.replace(request, request_id="pd-fallback", kv_ref=None)
        result["fallback"] = await collect(decode, fallback)
        result["decode_stats_after"] = msgspec.to_builtins(decode.stats())
    finally:
        for engine in (decode, prefill):
            if engine is not None:
                await engine.shutdown()
    return result


def main() -> None:
    print_result(run)


if __name__ == "__main__":  # vLLM's engine core may re-import this module
    main()
