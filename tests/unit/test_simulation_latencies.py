"""The simulation's control-plane latencies: where each applies, and how they are measured from a live fleet's spans."""

from __future__ import annotations

import dataclasses
import json
import statistics
from pathlib import Path

import pytest

from kvlane.fleet import with_overrides
from kvlane.fleet_mix import fleet_nodes, parse_fleet
from loadtest.bench_run import policy_sections
from loadtest.driver import DriveLimits
from loadtest.simulation.calibration import fit_latencies, read_spans, request_stretches
from loadtest.simulation.world import Latencies, Simulation, SimulationSpec
from loadtest.workloads import ArrivalSpec, WorkloadSpec
from shared.config import KvlaneConfig

H100 = "h100-80g-llama3-8b"


def one_node_spec(latencies: Latencies, requests: int = 1) -> SimulationSpec:
    config = with_overrides(with_overrides(KvlaneConfig(), **policy_sections("round_robin")),
                            **{"worker.sim": {"profile": H100}})
    work = WorkloadSpec(kind="shared-prefix", seed=3, max_requests=requests, arrival=ArrivalSpec(mode="poisson", rate=0.5),
                        output_tokens=16)
    return SimulationSpec(config, tuple(fleet_nodes(parse_fleet(f"{H100}:1"))), work,
                          DriveLimits(issue_for_s=300.0, hard_stop_s=400.0), 120.0, latencies, check_invariants=True)


def test_a_lone_requests_ttft_is_the_sum_of_the_control_plane_latencies_and_its_prefill_step() -> None:
    base = Simulation(one_node_spec(Latencies(0, 0, 0, 0, 0))).run().records[0]
    slow = Latencies(ingress_s=0.004, hop_s=0.0007, decision_s=0.003, handover_s=0.002, stream_s=0.0011)
    record = Simulation(one_node_spec(slow)).run().records[0]
    ttft, base_ttft = record.first_token_s - record.sent_s, base.first_token_s - base.sent_s
    assert ttft - base_ttft == pytest.approx(0.004 + 0.0007 + 0.003 + 0.002 + 0.0011, abs=1e-9)


def test_step_overhead_lengthens_every_step_and_so_each_token_gap() -> None:
    plain = Simulation(one_node_spec(Latencies())).run().records[0]
    slowed = Simulation(one_node_spec(dataclasses.replace(Latencies(), step_overhead_s=0.002))).run().records[0]

    def gaps(record) -> list[float]:
        return [b - a for a, b in zip(record.token_times_s, record.token_times_s[1:])]

    assert len(plain.token_times_s) == len(slowed.token_times_s) == 16
    for gap, slowed_gap in zip(gaps(plain), gaps(slowed)):
        assert slowed_gap - gap == pytest.approx(0.002, abs=1e-9)
    # The prefill step too.
    assert (slowed.first_token_s - slowed.sent_s) - (plain.first_token_s - plain.sent_s) == pytest.approx(0.002, abs=1e-9)


def test_negative_latencies_are_refused() -> None:
    with pytest.raises(ValueError, match="step_overhead_s"):
        Latencies(step_overhead_s=-0.001)
    with pytest.raises(ValueError, match="hop_s"):
        Latencies(hop_s=float("nan"))


def _span(name: str, trace: str, start: float, end: float, kind: str = "SpanKind.INTERNAL",
          events: tuple[tuple[str, float], ...] = (), **attributes: object) -> dict:
    def iso(seconds: float) -> str:
        return f"2026-12-01T10:00:{seconds:09.6f}Z"

    return {"name": name, "context": {"trace_id": trace, "span_id": f"0x{abs(hash((name, trace))):x}"},
            "kind": kind, "start_time": iso(start), "end_time": iso(end), "attributes": attributes,
            "events": [{"name": n, "timestamp": iso(t), "attributes": {}} for n, t in events]}


def _write_logs(log_dir: Path, spans_by_service: dict[str, list[dict]]) -> None:
    log_dir.mkdir()
    for service, spans in spans_by_service.items():
        # As the console exporter writes them, between the service's own log lines.
        text = '{"event": "ready"}\n' + "".join(json.dumps(s, indent=4) + "\n" for s in spans) + '{"event": "stopped"}\n'
        (log_dir / f"{service}.log").write_text(text)


def test_stretches_come_from_the_spans_of_each_request_and_the_clients_record(tmp_path: Path) -> None:
    # Request r1 (trace t1): received at 1.000, attempt at 1.003, routed by 1.010, decode from 1.014,
    # first output at 1.030, ingress's first token at 1.032; the client saw it 0.040 after sending.
    ingress = [_span("chat m", "t1", 1.000, 1.500, "SpanKind.SERVER", (("gen_ai.first_token", 1.032),),
                     **{"kvlane.request_id": "r1"}),
               _span("dispatch.attempt", "t1", 1.003, 1.500)]
    balancer = [_span("handle kvlane.v1.route", "t1", 1.005, 1.011), _span("route", "t1", 1.006, 1.010)]
    worker = [_span("decode", "t1", 1.014, 1.400, events=(("first_output", 1.030),)),
              # A health probe: a trace of its own without ingress's span, left out.
              _span("decode", "t2", 1.100, 1.110, events=(("first_output", 1.105),))]
    # A request routed twice (t3) is not the common way: left out too.
    ingress += [_span("chat m", "t3", 2.0, 2.5, "SpanKind.SERVER", (("gen_ai.first_token", 2.2),), **{"kvlane.request_id": "r3"}),
                _span("dispatch.attempt", "t3", 2.001, 2.1), _span("dispatch.attempt", "t3", 2.1, 2.5)]
    _write_logs(tmp_path / "logs", {"ingress": ingress, "balancer": balancer, "worker-w0": worker})
    records = [{"request_id": "r1", "sent_s": 5.0, "first_token_s": 5.040},
               {"request_id": "r3", "sent_s": 6.0, "first_token_s": 6.3}]

    spans = read_spans(tmp_path / "logs")
    assert len(spans) == 9
    stretches = {name: [round(v, 6) for v in values] for name, values in request_stretches(spans, records).items()}
    assert stretches == {"client": [0.008], "prepare": [0.003], "message": [0.002], "decision": [0.005], "handover": [0.004],
                         "engine": [0.016], "stream": [0.002]}


def test_fitted_latencies_put_each_stretch_where_the_simulation_charges_it() -> None:
    stretches = {"client": [0.004, 0.006, 0.005], "prepare": [0.002, 0.002, 0.003], "message": [0.001, 0.0005, 0.002],
                 "decision": [0.004, 0.005, 0.003],
                 "handover": [0.003, 0.004, 0.002], "engine": [0.02, 0.03, 0.04], "stream": [0.001, 0.002, 0.0015]}
    latencies = fit_latencies(stretches, live_tpot_s=0.0085, simulated_tpot_s=0.0065)
    median = {name: statistics.median(values) for name, values in stretches.items()}
    assert latencies.ingress_s == pytest.approx(median["client"] + median["prepare"])
    assert latencies.hop_s == pytest.approx(median["message"])
    assert latencies.decision_s == pytest.approx(median["decision"])
    assert latencies.handover_s == pytest.approx(median["handover"])
    assert latencies.stream_s == pytest.approx(median["stream"])
    assert latencies.step_overhead_s == pytest.approx(0.002)
    # A live engine no slower than the simulated one has no overhead, not a negative one.
    assert fit_latencies(stretches, 0.006, 0.0065).step_overhead_s == 0.0
    with pytest.raises(ValueError, match="handover"):
        fit_latencies(stretches | {"handover": []}, 0.0085, 0.0065)
