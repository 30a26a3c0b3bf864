"""Schemathesis against a live sim fleet: every operation of the ingress's own `/openapi.json`.

Cases come from schemathesis' hypothesis strategies (its Python API), both
schema-valid (half of those with the fleet's real model, so that requests
get past the model check and generate) and schema-violating ones; each
response is checked with `not_a_server_error` and
`response_schema_conformance`. Derandomized and bounded by example count,
so a run is the same every time. The counts are printed, written to
`schemathesis.json` in the test's tmp dir, and asserted (at least 1,000
requests). Afterwards the fleet serves a normal request.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import requests
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis.errors import Unsatisfiable
from hypothesis import strategies as st
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error
from schemathesis.core.failures import FailureGroup
from schemathesis.specs.openapi.checks import response_schema_conformance

from launch.fleet import Fleet
from tests.integration.conftest import MODEL, launch, stop_and_check

pytestmark = pytest.mark.integration

# Per operation and mode. Operations without parameters (the GETs) have one case each, whatever the budget.
EXAMPLES = {GenerationMode.POSITIVE: 320, GenerationMode.NEGATIVE: 200}
CHECKS = [not_a_server_error, response_schema_conformance]


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    # Fast sim workers: a valid request may ask for thousands of tokens.
    fleet = launch(tmp_path_factory.mktemp("schemathesis"), speed=50.0)
    yield fleet
    stop_and_check(fleet)


def with_real_model(case: Any) -> Any:
    if isinstance(case.body, dict) and "model" in case.body:
        case.body = {**case.body, "model": MODEL}
    return case


def cases(operation: Any, mode: GenerationMode) -> st.SearchStrategy[Any]:
    strategy = operation.as_strategy(generation_mode=mode)
    if mode is GenerationMode.POSITIVE and operation.method.upper() == "POST":
        return st.one_of(strategy, strategy.map(with_real_model))
    return strategy


def test_schemathesis_finds_nothing(fleet: Fleet, tmp_path: Path) -> None:
    schema = schemathesis.openapi.from_url(f"{fleet.base_url}/openapi.json")
    session = requests.Session()
    counts: Counter[str] = Counter()
    statuses: dict[str, Counter[int]] = {}
    failures: list[str] = []
    operations = [result.ok() for result in schema.get_all_operations()]
    assert {op.label for op in operations} >= {"POST /v1/chat/completions", "POST /v1/completions", "GET /v1/models",
                                              "GET /health", "GET /ready", "GET /metrics"}
    for operation in operations:
        for mode, examples in EXAMPLES.items():
            label = f"{operation.label} [{mode.value}]"

            @settings(max_examples=examples, derandomize=True, database=None, deadline=None,
                      phases=(Phase.explicit, Phase.generate), suppress_health_check=list(HealthCheck))
            @given(case=cases(operation, mode))
            def run(case: Any) -> None:
                response = case.call(session=session, timeout=60)
                counts[label] += 1
                statuses.setdefault(label, Counter())[response.status_code] += 1
                try:
                    case.validate_response(response, checks=CHECKS)
                except (AssertionError, FailureGroup) as exc:  # one failed check, or several
                    failures.append(f"{label}: {str(exc)[:600]}\n  {case.as_curl_command()[:600]}")

            try:
                run()
            except Unsatisfiable:  # an operation with nothing to break (no parameters) has no negative cases
                if mode is GenerationMode.POSITIVE or operation.method.upper() != "GET":
                    raise
    report = {"requests": sum(counts.values()), "per_operation": dict(counts),
              "statuses": {k: {str(s): n for s, n in v.items()} for k, v in statuses.items()}, "failures": failures[:50]}
    (tmp_path / "schemathesis.json").write_text(json.dumps(report, indent=2))
    print(f"\nschemathesis: {report['requests']} requests -> {tmp_path / 'schemathesis.json'}")
    for label, n in counts.items():
        print(f"  {label:<48} {n:>4}  {dict(statuses[label])}")
    assert not failures, "\n".join(failures[:20])
    assert report["requests"] >= 1000
    assert all(counts[f"{op.label} [positive]"] >= 1 for op in operations)
    # Both completion endpoints generated real answers, not only refusals.
    for path in ("POST /v1/chat/completions", "POST /v1/completions"):
        assert statuses[f"{path} [positive]"][200] >= 20, statuses[f"{path} [positive]"]
    normal = session.post(f"{fleet.base_url}/v1/completions", json={"model": MODEL, "prompt": "after fuzzing", "max_tokens": 5},
                          timeout=30)
    assert normal.status_code == 200 and normal.json()["usage"]["completion_tokens"] == 5
