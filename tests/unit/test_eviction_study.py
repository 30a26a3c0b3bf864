"""The eviction study: retention value against LRU on the same run, per priority class."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from loadtest.routing.eviction_study import main


def test_both_evictions_run_the_same_workload_and_report_each_priority_class(tmp_path: Path) -> None:
    # Two nodes whose slots assume 1k-token requests while 2.4k-token ones arrive: leases are refused and preempt.
    code = main(["--fleet", "h100-80g-llama3-8b:2", "--rates", "40", "--duration", "4", "--num-blocks", "800",
                 "--slot-tokens", "1024", "--groups", "8", "--high-share", "0.3", "--out", str(tmp_path)])
    assert code == 0
    runs = json.loads((tmp_path / "results.json").read_text())["runs"]
    assert [r["eviction"] for r in runs] == ["retention", "lru"]
    for run in runs:
        classes = run["classes"]
        assert set(classes) == {"priority 0", "priority 1"}
        assert run["lease_preemptions"] > 0
    # The same sessions in both arms: only the victims differ.
    assert runs[0]["classes"]["priority 1"]["requests"] == runs[1]["classes"]["priority 1"]["requests"]
    assert (tmp_path / "study.md").read_text().count("| 40 |") == 2


@pytest.mark.parametrize("argv", [["--rates", "0"], ["--rates", "x"], ["--slot-tokens", "1"], ["--high-share", "2"],
                                  ["--fleet", "no-such-gpu:2"]])
def test_bad_options_are_refused_with_exit_2(argv: list[str], tmp_path: Path) -> None:
    assert main([*argv, "--out", str(tmp_path)]) == 2
