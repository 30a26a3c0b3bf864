"""The simulation's control-plane latencies: where each applies, and how they are measured from a live fleet's spans."""

from __future__ import annotations

import dataclasses
import json
import statistics
from pathlib import Path

import pytest

from launch.fleet import with_overrides
from launch.fleet_mix import fleet_nodes, parse_fleet
from loadtest.bench.run import policy_sections
from loadtest.bench.driver import DriveLimits
from loadtest.simulation.command import main as simulate_main
from loadtest.simulation.calibration import (
    fit_latencies,
    quantile_table,
    read_spans,
    read_delays,
    read_spreads,
    request_stretches,
    spreads_ms,
)
from loadtest.simulation.delays import Latencies, Spread
from loadtest.simulation.world import Simulation, SimulationSpec
from loadtest.bench.workloads import ArrivalSpec, WorkloadSpec
from shared.config import KvlaneConfig

H100 = "h100-80g-llama3-8b"


def one_node_spec(latencies: Latencies, requests: int = 1, seed: int = 3) -> SimulationSpec:
    config = with_overrides(with_overrides(KvlaneConfig(), **policy_sections("round_robin")),
                            **{"worker.sim": {"profile": H100}})
    work = WorkloadSpec(kind="shared-prefix", seed=seed, max_requests=requests,
                        arrival=ArrivalSpec(mode="poisson", rate=0.5), output_tokens=16)
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


def test_a_spread_draws_its_quantiles_at_their_probabilities() -> None:
    import random

    rng = random.Random(7)
    measured = [rng.lognormvariate(-5, 0.8) for _ in range(400)]  # a long-tailed delay of a few milliseconds
    spread = Spread(quantile_table(measured))
    assert spread.quantiles[0] == min(measured) and spread.quantiles[-1] == max(measured)
    draws = sorted(spread.sample(rng) for _ in range(20000))
    for probability in (0.1, 0.5, 0.9):
        assert draws[int(probability * len(draws))] == pytest.approx(quantile_table(measured, 11)[round(10 * probability)],
                                                                     rel=0.08)
    with pytest.raises(ValueError, match="ascending"):
        Spread((0.002, 0.001))
    with pytest.raises(ValueError, match="at least two"):
        Spread((0.001,))


def _ttfts(latencies: Latencies, requests: int = 40) -> list[float]:
    return [r.first_token_s - r.sent_s for r in Simulation(one_node_spec(latencies, requests)).run().records]


def test_each_request_draws_its_own_delays_from_their_spreads_reproducibly() -> None:
    constant = Latencies(0.004, 0.0005, 0.002, 0.003, 0.001)
    # A spread that is one value is that constant.
    pinned = dataclasses.replace(constant, spreads=(("handover", Spread((0.003, 0.003))), ("ingress", Spread((0.004,) * 5))))
    assert _ttfts(pinned) == pytest.approx(_ttfts(constant), abs=1e-12)
    # A wide hand-over spread: each request's own, between its bounds, the same for the same seed.
    wide = dataclasses.replace(constant, spreads=(("handover", Spread((0.001, 0.003, 0.051))),))
    spread_ttfts, constant_ttfts = _ttfts(wide), _ttfts(constant)
    assert spread_ttfts == _ttfts(wide)
    shifts = [a - b for a, b in zip(spread_ttfts, constant_ttfts)]
    assert all(-0.002 - 1e-9 <= shift <= 0.048 + 1e-9 for shift in shifts)
    assert max(shifts) > 0.02 and min(shifts) < 0.0  # it did vary, both ways
    other_seed = [r.first_token_s - r.sent_s for r in Simulation(one_node_spec(wide, 40, seed=4)).run().records]
    assert other_seed != spread_ttfts
    with pytest.raises(ValueError, match="engine"):
        Latencies(spreads=(("engine", Spread((0.0, 0.1))),))


def test_fitted_spreads_are_each_requests_delays_and_kvlane_simulate_reads_them_back(tmp_path: Path) -> None:
    stretches = {"client": [0.004, 0.006, 0.005], "prepare": [0.003, 0.001, 0.002], "message": [0.001, 0.0005, 0.002],
                 "decision": [0.004, 0.005, 0.003], "handover": [0.003, 0.004, 0.020], "engine": [0.02, 0.03, 0.04],
                 "stream": [0.001, 0.002, -0.0001]}
    latencies = fit_latencies(stretches, 0.0085, 0.0065, spreads=True)
    spreads = dict(latencies.spreads)
    assert set(spreads) == {"ingress", "hop", "decision", "handover", "stream"}
    # The client leg and the preparation per request, summed: 7, 7 and 7 ms.
    assert spreads["ingress"].quantiles == pytest.approx((0.007,) * len(spreads["ingress"].quantiles))
    assert spreads["handover"].quantiles[0] == pytest.approx(0.003) and spreads["handover"].quantiles[-1] == pytest.approx(0.020)
    assert spreads["stream"].quantiles[0] == 0.0  # a clock's microsecond below zero is none
    assert fit_latencies(stretches, 0.0085, 0.0065).spreads == ()
    (tmp_path / "calibration.json").write_text(json.dumps({"spreads_ms": spreads_ms(latencies)}))
    assert [(name, s.quantiles) for name, s in read_spreads(tmp_path / "calibration.json")] == [
        (name, pytest.approx(s.quantiles, abs=1e-7)) for name, s in latencies.spreads]
    argv = ["--rate", "5", "--requests", "20", "--workers", "2", "--policies", "round_robin", "--quiet"]
    assert simulate_main([*argv, "--spreads", str(tmp_path / "calibration.json"), "--out", str(tmp_path / "a")]) == 0
    assert simulate_main([*argv, "--spreads", str(tmp_path / "calibration.json"), "--out", str(tmp_path / "b")]) == 0
    first, second = (json.loads((tmp_path / run / "results.json").read_text()) for run in ("a", "b"))
    assert first["parameters"]["latency_spreads_ms"] == spreads_ms(latencies)
    assert first["runs"][0]["records"] == second["runs"][0]["records"]
    (tmp_path / "bad.json").write_text(json.dumps({"spreads_ms": {"engine": [1, 2]}}))
    assert simulate_main([*argv, "--spreads", str(tmp_path / "bad.json"), "--out", str(tmp_path / "c")]) == 2


def test_fidelity_resimulates_against_a_kept_live_run_and_calibration(tmp_path: Path) -> None:
    from loadtest.simulation.fidelity import main as fidelity_main

    shared = ["--rate", "5", "--requests", "20", "--workers", "2", "--policies", "round_robin,least_loaded", "--seed", "2"]
    # A simulation's results stand in for the live run's: the layout is the same, and so the comparison is exact.
    assert simulate_main([*shared, "--out", str(tmp_path / "live"), "--quiet"]) == 0
    stretches_ms = {"client": [2.0, 3.0, 2.5], "prepare": [1.0, 1.0, 1.5], "message": [0.5, 0.7, 0.6],
                    "decision": [1.0, 1.2, 1.1], "handover": [2.0, 9.0, 3.0], "engine": [15.0, 16.0, 15.0],
                    "stream": [0.5, 0.8, 0.6]}
    (tmp_path / "calibration").mkdir()
    (tmp_path / "calibration" / "calibration.json").write_text(json.dumps(
        {"stretches_ms": stretches_ms, "stretches_p50_ms": {}, "tpot_p50_ms": {"live": 7.0, "simulated_without_overhead": 6.5}}))
    assert fidelity_main(["--out", str(tmp_path), "--calibrate", "--resimulate", *shared]) == 0
    result = json.loads((tmp_path / "fidelity.json").read_text())
    assert [row["policy"] for row in result["runs"]] == ["round_robin", "least_loaded"]
    # The defaults are what the stand-in ran with: no error there; the measured delays are longer.
    assert result["median_error_with_default_latencies"] == {"goodput": 0.0, "ttft_p50": 0.0, "ttft_p90": 0.0}
    assert result["median_error"]["ttft_p50"] > 0 and result["median_error_with_constant_latencies"]["ttft_p50"] > 0
    assert result["calibration"]["latencies_ms"]["handover"] == 3.0
    assert result["calibration"]["spreads_ms"]["handover"][-1] == 9.0
    simulated = json.loads((tmp_path / "simulated" / "results.json").read_text())
    assert simulated["parameters"]["latency_spreads_ms"] == result["calibration"]["spreads_ms"]
    assert not (tmp_path / "calibration" / "logs").exists()  # nothing ran live


def test_delays_by_load_are_drawn_from_the_band_of_the_requests_in_flight() -> None:
    from loadtest.simulation.calibration import in_flight_at_send, load_bands
    from loadtest.simulation.delays import SpreadByLoad

    records = [{"request_id": "a", "sent_s": 0.0, "end_s": 1.0}, {"request_id": "b", "sent_s": 0.5, "end_s": 2.0},
               {"request_id": "c", "sent_s": 1.0, "end_s": 1.5}, {"request_id": "d", "sent_s": 1.2, "end_s": None}]
    assert in_flight_at_send(records) == {"a": 1, "b": 2, "c": 2, "d": 3}  # a ended as c was sent
    assert load_bands([1] * 40 + [5] * 40 + [9] * 40) == (1, 5)
    assert load_bands([3] * 200) == () and load_bands(list(range(20))) == ()
    stretches = {name: [0.001] * 60 + [0.030] * 60 for name in ("client", "message", "decision", "handover", "engine", "stream")}
    stretches["prepare"] = [0.0] * 120
    latencies = fit_latencies(stretches, 0.007, 0.007, spreads=True, in_flight=[2] * 60 + [8] * 60)
    handover = dict(latencies.spreads)["handover"]
    assert isinstance(handover, SpreadByLoad) and handover.up_to == (2,)
    assert [band.quantiles[0] for band in handover.bands] == [0.001, 0.030]
    # One request at a time meets the light band's delays; forty at once meet the heavy band's too.
    alone = _ttfts(dataclasses.replace(latencies, spreads=latencies.spreads), requests=10)
    constant = _ttfts(Latencies(0.001, 0.001, 0.001, 0.001, 0.001), requests=10)
    assert alone == pytest.approx(constant, abs=1e-9)
    burst = dataclasses.replace(one_node_spec(latencies, 40), workload=dataclasses.replace(
        one_node_spec(latencies, 40).workload, arrival=ArrivalSpec(mode="poisson", rate=1000.0)))
    ttfts = [r.first_token_s - r.sent_s for r in Simulation(burst).run().records]
    assert max(ttfts) > 0.030 * 4
    with pytest.raises(ValueError, match="one band more"):
        SpreadByLoad((2, 5), (Spread((0.0, 0.1)),))


def test_spreads_by_load_go_through_their_json_unchanged(tmp_path: Path) -> None:
    from loadtest.simulation.delays import SpreadByLoad

    latencies = Latencies(spreads=(("hop", SpreadByLoad((3, 7), (Spread((0.0005, 0.001)), Spread((0.001, 0.004)),
                                                                  Spread((0.002, 0.05))))), ("stream", Spread((0.0, 0.002)))))
    (tmp_path / "spreads.json").write_text(json.dumps(spreads_ms(latencies)))
    assert read_spreads(tmp_path / "spreads.json") == latencies.spreads
    (tmp_path / "bad.json").write_text(json.dumps({"hop": {"quantiles": [[1, 2]]}}))
    with pytest.raises(ValueError, match="in_flight_up_to"):
        read_spreads(tmp_path / "bad.json")


def test_per_request_delays_are_one_measured_requests_delays_together(tmp_path: Path) -> None:
    # Two measured requests: one quick on every stretch, one slow on every stretch.
    quick, slow = (0.001, 0.0005, 0.001, 0.001, 0.0005), (0.010, 0.005, 0.010, 0.010, 0.005)
    names = ("ingress", "hop", "decision", "handover", "stream")
    latencies = Latencies(0.0, 0.0, 0.0, 0.0, 0.0, per_request=tuple((name, (q, s)) for name, q, s in zip(names, quick, slow)))
    shifts = [a - b for a, b in zip(_ttfts(latencies), _ttfts(Latencies(0.0, 0.0, 0.0, 0.0, 0.0)))]
    # Never a mix of the two: each TTFT grew by all of one request's delays, or all of the other's (save a
    # request or two that met another's step on the node, and so waited for it).
    whole = [shift for shift in shifts if shift == pytest.approx(sum(quick), abs=1e-9) or shift == pytest.approx(sum(slow), abs=1e-9)]
    assert len(whole) >= len(shifts) - 3 and len({round(shift, 6) for shift in whole}) == 2
    assert _ttfts(latencies) == _ttfts(latencies)
    (tmp_path / "delays.json").write_text(json.dumps({"per_request_ms": {n: [1000 * q, 1000 * s] for n, q, s in zip(names, quick, slow)}}))
    spreads, per_request = read_delays(tmp_path / "delays.json")
    assert spreads == () and [(n, pytest.approx(v)) for n, v in per_request] == list(latencies.per_request)
    with pytest.raises(ValueError, match="one value per measured request"):
        Latencies(per_request=(("hop", (0.001,)), ("stream", (0.001, 0.002))))
