"""Who a request is from, and with what weight: keys, the tenant header, workloads' tenants and their report."""

from __future__ import annotations

import msgspec
import pytest
from multidict import CIMultiDict, CIMultiDictProxy

from loadtest.bench.client import RequestRecord
from loadtest.bench.metrics import Slo, fair_level, jain_index, tenant_summary
from loadtest.bench.workloads import TenantShare, WorkloadSpec, parse_tenants, sessions
from services.ingress.auth import Authenticator
from services.ingress.errors import ApiError
from services.ingress.prompts import PreparedRequest
from shared.api_keys import KeyRecord, make_record
from contracts.messages import SamplingParams


def test_a_key_carries_its_tenant_and_weight_into_the_request() -> None:
    record, _ = make_record("acme", weight=2.5)
    asked = PreparedRequest(model="m", prompt_token_ids=[1], block_hashes=[], sampling=SamplingParams(max_tokens=8), stream=False,
                            include_usage=False, tenant="spoofed")
    prepared = Authenticator.apply(record, asked)
    assert (prepared.tenant, prepared.tenant_weight) == ("acme", 2.5)


@pytest.mark.parametrize("weight", [0.0, -1.0, 1001.0])
def test_a_key_of_no_weight_or_a_huge_one_is_refused(weight: float) -> None:
    with pytest.raises(msgspec.ValidationError):
        make_record("acme", weight=weight)


def test_an_older_key_record_without_a_weight_has_weight_one() -> None:
    record, _ = make_record("acme")
    stored = {k: v for k, v in msgspec.structs.asdict(record).items() if k != "weight"}
    assert msgspec.convert(stored, KeyRecord).weight == 1.0


def test_the_tenant_header_names_a_tenant_in_any_letter_case_with_its_configured_weight() -> None:
    http = CIMultiDictProxy(CIMultiDict({"X-Tenant": "batch"}))
    assert Authenticator.named_tenant(http, "x-tenant", {"batch": 0.5}) == ("batch", 0.5)
    assert Authenticator.named_tenant({"X-TENANT": "chat"}, "x-tenant", {}) == ("chat", 1.0)  # NATS headers
    assert Authenticator.named_tenant({"x-tenant": ""}, "x-tenant", {}) is None
    assert Authenticator.named_tenant({"other": "x"}, "x-tenant", {}) is None
    assert Authenticator.named_tenant(None, "x-tenant", {}) is None
    assert Authenticator.named_tenant({"x-tenant": "chat"}, "", {}) is None  # the operator turned it off


def test_a_tenant_name_longer_than_a_keys_is_refused_with_400() -> None:
    with pytest.raises(ApiError) as refused:
        Authenticator.named_tenant({"x-tenant": "t" * 129}, "x-tenant", {})
    assert refused.value.status == 400 and refused.value.code == "invalid_tenant"


def test_tenants_parse_with_shares_and_weights() -> None:
    assert parse_tenants("a:10,b:1:2") == (TenantShare("a", 10.0), TenantShare("b", 1.0, 2.0))


@pytest.mark.parametrize("value", ["a", "a:0", "a:-1", "a:x", "a:1:0", ":1", "a:1,a:2", "a:inf"])
def test_bad_tenant_specs_are_refused(value: str) -> None:
    with pytest.raises(ValueError):
        parse_tenants(value)


def test_sessions_are_drawn_by_their_tenants_shares() -> None:
    spec = WorkloadSpec(max_requests=2000, tenants=parse_tenants("a:10,b:1:3"))
    drawn = list(sessions(spec))
    b = [s for s in drawn if s.tenant == "b"]
    assert 0.06 < len(b) / len(drawn) < 0.12
    assert {s.tenant_weight for s in b} == {3.0}
    assert [s.tenant for s in drawn] == [s.tenant for s in sessions(spec)]  # the seed decides


def test_the_fair_level_fills_the_small_demands_first() -> None:
    assert fair_level({"a": 100.0, "b": 10.0}, {}, 60.0) == 50.0  # b gets its 10, a the 50 left
    assert fair_level({"a": 100.0, "b": 100.0}, {"a": 2.0}, 90.0) == 30.0  # per unit of weight
    assert fair_level({"a": 10.0, "b": 10.0}, {}, 20.0) == 10.0  # everyone got what it asked for


def test_jains_index_is_one_for_equals_and_one_over_n_for_one_taking_all() -> None:
    assert jain_index([5.0, 5.0, 5.0]) == pytest.approx(1.0)
    assert jain_index([9.0, 0.0, 0.0]) == pytest.approx(1 / 3)
    assert jain_index([]) is None


def record(tenant: str, prompt: int, output: int, ok: bool = True) -> RequestRecord:
    r = RequestRecord("s", "g", 0, "completions", output, 0.0, tenant=tenant, prompt_tokens=prompt)
    if ok:
        r.status, r.end_s, r.first_token_s, r.completion_tokens = 200, 1.0, 0.1, output
        r.token_times_s = [0.1 + 0.01 * i for i in range(output)]
    return r


def test_the_report_counts_backlogged_tenants_only_in_jains_index() -> None:
    # a and b asked for far more than they got, equally served; c asked for little and got it all.
    records = ([record("a", 90, 10) for _ in range(5)] + [record("a", 90, 10, ok=False) for _ in range(20)]
               + [record("b", 90, 10) for _ in range(5)] + [record("b", 90, 10, ok=False) for _ in range(20)]
               + [record("c", 90, 10)])
    summary = tenant_summary(records, Slo(ttft_s=1.0, tpot_s=0.1), {})
    assert summary["backlogged"] == ["a", "b"]
    assert summary["jain_index_backlogged"] == pytest.approx(1.0)
    assert summary["per_tenant"]["c"]["slo_attainment"] == 1.0 and summary["per_tenant"]["a"]["slo_attainment"] == 0.2
