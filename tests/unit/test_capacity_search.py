"""The routing study's capacity search: a bracket around the rate where attainment falls below 90%."""

import json
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from loadtest.routing import routing_study
from loadtest.routing.routing_study import search_capacity


def falling_at(threshold: float):
    return lambda rate: 1.0 if rate <= threshold else 0.5


@given(threshold=st.floats(1.0, 1000.0), guess=st.floats(1.0, 1000.0), resolution=st.sampled_from([0.02, 0.05, 0.1]))
def test_brackets_the_threshold_within_the_resolution(threshold, guess, resolution):
    search = search_capacity(falling_at(threshold), guess, resolution, max_probes=40)
    assert search.capacity <= threshold < search.ceiling
    assert search.ceiling / search.capacity <= 1 + resolution
    assert all((attained >= 0.9) == (rate <= threshold) for rate, attained in search.probes)


def test_stops_at_the_probe_budget_and_reports_what_it_found():
    search = search_capacity(falling_at(1e9), guess=10.0, max_probes=5)
    assert len(search.probes) == 5
    assert search.ceiling is None
    assert search.capacity == 10.0 * 1.5**4


def test_a_policy_that_never_attains_has_no_capacity():
    search = search_capacity(lambda rate: 0.2, guess=10.0, max_probes=6)
    assert search.capacity == 0.0
    assert search.ceiling == 10.0 / 1.5**5


def _capacity_study(directory: Path, capacity: dict[str, float], warmup_s: float | None = None, config: str = "",
                    seeds: int | None = None) -> Path:
    searches = {p: {"capacity": c, "ceiling": c * 1.05, "probes": [[c, 0.95]]} for p, c in capacity.items()}
    pair = {"workload": "long-context", "fleet": "8 H100 + 8 A100", "resolution": 0.05, "capacity": capacity,
            "searches": searches, "targets": routing_study.capacity_targets(capacity)}
    directory.mkdir()
    study = {"policies": list(capacity), "pairs": [pair]} | ({} if warmup_s is None else {"warmup_s": warmup_s})
    study |= {"config": config} if config else {}  # a study from before --config has none
    study |= {} if seeds is None else {"seeds": seeds}
    (directory / "study.json").write_text(json.dumps(study))
    return directory


def test_studies_measured_after_different_warm_ups_are_not_merged(tmp_path: Path) -> None:
    cold = _capacity_study(tmp_path / "cold", {"jffc_per_request": 186.0})  # a study from before warm-ups: none
    warm = _capacity_study(tmp_path / "warm", {"round_robin": 156.0}, warmup_s=40.0)
    with pytest.raises(ValueError, match=r"long-context on 8 H100 \+ 8 A100: .* different warm-ups \(0 s, 40 s\)"):
        routing_study.merge([cold, warm], tmp_path / "merged")
    assert routing_study.main(["--merge", str(cold), str(warm), "--out", str(tmp_path / "merged")]) == 2
    also_warm = _capacity_study(tmp_path / "also-warm", {"jffc_per_request": 186.0}, warmup_s=40.0)
    study, text = routing_study.merge([warm, also_warm], tmp_path / "merged")
    assert study["warmup_s"] == 40.0 and study["pairs"][0]["targets"]["capacity_vs_round_robin"] == pytest.approx(186 / 156)
    assert study["pairs"][0]["warmup_s"] == 40.0  # the study's, for pairs from before each kept its own
    assert "after 40 simulated seconds of warm-up" in text
    assert "warm-up" not in routing_study.merge([cold], tmp_path / "cold-only")[1]


def test_a_workload_s_own_warm_up_merges_with_the_same_warm_up_given_explicitly(tmp_path: Path) -> None:
    # One study run with each workload's own warm-up (the study's is None), one with `--warmup 40`: the same runs.
    own = _capacity_study(tmp_path / "own", {"jffc_per_request": 186.0}, warmup_s=None)
    study = json.loads((own / "study.json").read_text())
    study["warmup_s"], study["pairs"][0]["warmup_s"] = None, 40.0
    (own / "study.json").write_text(json.dumps(study))
    given = _capacity_study(tmp_path / "given", {"round_robin": 156.0}, warmup_s=40.0)
    merged, text = routing_study.merge([own, given], tmp_path / "merged")
    assert merged["warmup_s"] is None and merged["pairs"][0]["warmup_s"] == 40.0
    assert merged["pairs"][0]["targets"]["capacity_vs_round_robin"] == pytest.approx(186 / 156)
    assert "long-context 40 s" in text


def test_capacity_studies_of_separate_policies_merge_into_one_comparison(tmp_path: Path) -> None:
    headline = _capacity_study(tmp_path / "a", {"jffc_per_request": 215.0})
    others = _capacity_study(tmp_path / "b", {"jffc": 163.0, "round_robin": 82.0, "naive:round_robin": 80.0})
    study, text = routing_study.merge([headline, others], tmp_path / "merged")
    (pair,) = study["pairs"]
    assert pair["capacity"] == {"jffc_per_request": 215.0, "jffc": 163.0, "round_robin": 82.0, "naive:round_robin": 80.0}
    assert pair["targets"]["best_capacity_other"] == "jffc"
    assert pair["targets"]["capacity_vs_best_other"] == pytest.approx(215 / 163)
    assert pair["targets"]["capacity_vs_round_robin"] == pytest.approx(215 / 82)
    assert "1.32x (jffc)" in text and (tmp_path / "merged" / "study.md").read_text() == text
    # Alone, the headline policy has nothing to be compared with.
    assert routing_study.merge([headline], tmp_path / "alone")[0]["pairs"][0]["targets"]["best_capacity_other"] is None


WEIGHT_4 = "[balancer.jffc_per_request]\nimposed_delay_weight = 4\n"


def test_studies_run_with_different_configurations_are_not_merged(tmp_path: Path) -> None:
    default = _capacity_study(tmp_path / "default", {"jffc_per_request": 191.0})
    heavier = _capacity_study(tmp_path / "heavier", {"round_robin": 96.0}, config=WEIGHT_4)
    with pytest.raises(ValueError, match="different --config"):
        routing_study.merge([default, heavier], tmp_path / "merged")
    assert routing_study.main(["--merge", str(default), str(heavier), "--out", str(tmp_path / "merged")]) == 2
    also = _capacity_study(tmp_path / "also", {"jffc_per_request": 191.0}, config=WEIGHT_4)
    study, text = routing_study.merge([heavier, also], tmp_path / "merged")
    assert study["config"] == WEIGHT_4 and "imposed_delay_weight = 4" in text


@pytest.mark.parametrize(("content", "reason"), [
    (None, "No such file"),
    ("[balancer\n", "not valid TOML"),
    ("[balancer.jffc_per_request]\nimposed_delay_weight = -1\n", "imposed_delay_weight"),
])
def test_a_bad_config_file_exits_2_before_anything_runs(tmp_path: Path, capsys, content, reason) -> None:
    path = tmp_path / "kvlane.toml"
    if content is not None:
        path.write_text(content)
    out = tmp_path / "study"
    assert routing_study.main(["--capacity", "--workloads", "long-context", "--fleets", "16m", "--config", str(path),
                               "--out", str(out)]) == 2
    assert reason in capsys.readouterr().err and not out.exists()


def test_every_run_gets_the_config_file_and_the_study_keeps_its_text(tmp_path: Path, monkeypatch) -> None:
    """The search driver alone: the simulator answers from a known threshold (it is tested in test_simulation.py)."""
    path = tmp_path / "kvlane.toml"
    path.write_text(WEIGHT_4)
    calls: list[list[str]] = []

    def simulate(argv: list[str]) -> dict:
        calls.append(argv)
        rate = float(argv[argv.index("--rate") + 1])
        return {"runs": [{"summary": {"slo_attainment": 1.0 if rate <= 150.0 else 0.5}}]}

    monkeypatch.setattr(routing_study, "run_simulate", simulate)
    out = tmp_path / "study"
    assert routing_study.main(["--capacity", "--workloads", "long-context", "--fleets", "16m", "--policies",
                               "jffc_per_request", "--config", str(path), "--out", str(out)]) == 0
    assert calls and all(argv[argv.index("--config") + 1] == str(path) for argv in calls)
    study = json.loads((out / "study.json").read_text())
    assert study["config"] == WEIGHT_4 and 150.0 / 1.05 <= study["pairs"][0]["capacity"]["jffc_per_request"] <= 150.0
    assert "imposed_delay_weight = 4" in (out / "study.md").read_text()


def test_with_seeds_each_probe_runs_every_seed_and_attains_their_mean(tmp_path: Path, monkeypatch) -> None:
    """Seed 0 keeps the SLO up to 150 req/s, seed 1 up to 120: between them the mean, 0.75, is not enough."""
    outs: list[str] = []

    def simulate(argv: list[str]) -> dict:
        outs.append(argv[argv.index("--out") + 1])
        rate, seed = float(argv[argv.index("--rate") + 1]), int(argv[argv.index("--seed") + 1])
        return {"runs": [{"summary": {"slo_attainment": 1.0 if rate <= (150.0, 120.0)[seed] else 0.5}}]}

    monkeypatch.setattr(routing_study, "run_simulate", simulate)
    out = tmp_path / "study"
    assert routing_study.main(["--capacity", "--seeds", "2", "--workloads", "long-context", "--fleets", "16m",
                               "--policies", "jffc_per_request", "--out", str(out)]) == 0
    study = json.loads((out / "study.json").read_text())
    assert study["seeds"] == 2 and 120.0 / 1.05 <= study["pairs"][0]["capacity"]["jffc_per_request"] <= 120.0
    assert len(outs) == len(set(outs)) and len(outs) % 2 == 0  # each seed's run keeps its own results
    assert "mean over seeds 0-1" in (out / "study.md").read_text()


@pytest.mark.parametrize("argv", [["--capacity", "--seeds", "0"], ["--seeds", "2"]])
def test_seeds_below_one_or_without_a_capacity_search_exit_2(tmp_path: Path, capsys, argv: list[str]) -> None:
    out = tmp_path / "study"
    assert routing_study.main([*argv, "--workloads", "long-context", "--fleets", "16m", "--out", str(out)]) == 2
    assert "--seeds" in capsys.readouterr().err and not out.exists()


def test_studies_averaged_over_different_seed_counts_are_not_merged(tmp_path: Path) -> None:
    one = _capacity_study(tmp_path / "one", {"jffc_per_request": 191.0})  # a study from before --seeds: one seed
    four = _capacity_study(tmp_path / "four", {"prefix_affinity": 152.0}, seeds=4)
    with pytest.raises(ValueError, match="different seed counts"):
        routing_study.merge([one, four], tmp_path / "merged")


def test_conversations_are_measured_after_their_own_warm_up_unless_one_is_given(tmp_path: Path, monkeypatch) -> None:
    """Multi-turn load rises for a conversation's life: its runs are warmed up by default, long contexts not;
    `--warmup` sets every workload's."""
    warmups: dict[str, set[str]] = {}

    def simulate(argv: list[str]) -> dict:
        workload = argv[argv.index("--workload") + 1]
        warmups.setdefault(workload, set()).add(argv[argv.index("--warmup") + 1])
        return {"runs": [{"summary": {"slo_attainment": 1.0 if float(argv[argv.index("--rate") + 1]) <= 30.0 else 0.5}}]}

    monkeypatch.setattr(routing_study, "run_simulate", simulate)
    out = tmp_path / "study"
    assert routing_study.main(["--capacity", "--workloads", "multi-turn,long-context", "--fleets", "16m",
                               "--policies", "jffc_per_request", "--out", str(out)]) == 0
    assert warmups == {"multi-turn": {"60"}, "long-context": {"0"}}
    study = json.loads((out / "study.json").read_text())
    assert study["warmup_s"] is None and [p["warmup_s"] for p in study["pairs"]] == [60.0, 0.0]
    assert "after their workload's warm-up at their rate: multi-turn 60 s." in (out / "study.md").read_text()
    merged, text = routing_study.merge([out], tmp_path / "merged")
    assert merged["pairs"][0]["warmup_s"] == 60.0 and "multi-turn 60 s" in text

    warmups.clear()
    assert routing_study.main(["--capacity", "--workloads", "multi-turn,long-context", "--fleets", "16m",
                               "--policies", "jffc_per_request", "--warmup", "10", "--out", str(tmp_path / "given")]) == 0
    assert warmups == {"multi-turn": {"10"}, "long-context": {"10"}}


def test_a_rate_attains_only_if_the_last_quarter_of_its_arrivals_does_too_unless_the_whole_run_is_asked(
        tmp_path: Path, monkeypatch) -> None:
    """Above 100 req/s the run keeps 95% within the SLO, but its last arrivals fall behind (a transient)."""

    def simulate(argv: list[str]) -> dict:
        rate = float(argv[argv.index("--rate") + 1])
        late = 1.0 if rate <= 100.0 else 0.6
        return {"runs": [{"summary": {"slo_attainment": 0.95 if rate <= 150.0 else 0.5, "slo_attainment_late": late}}]}

    monkeypatch.setattr(routing_study, "run_simulate", simulate)
    common = ["--capacity", "--workloads", "long-context", "--fleets", "16m", "--policies", "jffc_per_request",
              "--resolution", "0.02"]
    assert routing_study.main([*common, "--out", str(tmp_path / "sustained")]) == 0
    assert routing_study.main([*common, "--whole-run", "--out", str(tmp_path / "whole")]) == 0
    sustained = json.loads((tmp_path / "sustained" / "study.json").read_text())
    whole = json.loads((tmp_path / "whole" / "study.json").read_text())
    assert 98.0 <= sustained["pairs"][0]["capacity"]["jffc_per_request"] <= 100.0
    assert 147.0 <= whole["pairs"][0]["capacity"]["jffc_per_request"] <= 150.0
    assert sustained["attainment"] == routing_study.SUSTAINED and whole["attainment"] == routing_study.WHOLE_RUN
    assert "last quarter of its arrivals" in (tmp_path / "sustained" / "study.md").read_text()
    with pytest.raises(ValueError, match="different attainment measures"):
        routing_study.merge([tmp_path / "sustained", tmp_path / "whole"], tmp_path / "merged")
    # A summary from before the late figure was kept: the whole run's.
    assert routing_study.sustained_attainment({"slo_attainment": 0.93}) == 0.93
    assert routing_study.sustained_attainment({"slo_attainment": None, "slo_attainment_late": 0.5}) == 0.0
