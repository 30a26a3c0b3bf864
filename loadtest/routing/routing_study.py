"""Which routing policy wins, where: `kvlane simulate` sweeps over workloads and fleets, with the targets checked.

For each (workload, fleet) pair, every policy runs at rates around a guess
of round robin's capacity (0.8x to 1.4x; one `kvlane simulate` sweep, with
its own results.json and goodput-versus-rate plot), each run `--duration`
simulated seconds of arrivals, so that it reaches a steady state; multi-turn
after a warm-up of one conversation's life as well (`Workload.warmup_s`),
since until then its load still rises. The knee
is the lowest swept rate at which round robin's SLO attainment falls below
90%. Reported per pair:

* at the knee: jffc_per_request's goodput over round robin's (kvlane's, and
  a plain load balancer's: `naive:round_robin`) and over the best other
  policy's, and its TTFT p99 over round robin's;
* capacity per policy: the highest swept rate with >= 90% attainment; on
  mixed fleets jffc_per_request's over the best other policy's.

With `--at-knee`, round robin alone runs the sweep and every other policy
only at its knee (a third of the runs; capacities are then not measured).
With `--capacity`, each policy's capacity is instead searched for on its
own (`search_capacity`): widened from the guess, then bisected to within
`--resolution`, so that capacity ratios are not limited by a coarse grid;
with `--seeds N`, a probed rate's attainment is the mean over seeds 0 to
N-1, so that one draw of arrivals near a cliff does not decide it. A rate
attains only if the last quarter of its arrivals does too
(`sustained_attainment`; `--whole-run` drops that check): a fleet given
more than it sustains falls behind a little more every second.
`kvlane simulate --ceiling` bounds what any policy could sustain.

Everything is in simulated time. Writes `study.json` and `study.md` under
`--out`.

    python -m loadtest.routing.routing_study --quick          # a small version, minutes
    python -m loadtest.routing.routing_study                  # the full matrix
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from loadtest.bench.command import RESULTS_DIR
from loadtest.simulation.command import main as simulate_main
from loadtest.bench.trace_gen import TraceSpec, generate
from shared.config import ConfigError, load_config

H100, A100 = "h100-80g-llama3-8b", "a100-80g-llama3-8b"
# A real 80 GB card holds about 490k tokens of Llama-3-8B KV (128 KiB/token) beside the weights.
NUM_BLOCKS = 30_000
HEADLINE = "jffc_per_request"
BASELINE = "round_robin"
ATTAINMENT = 0.9
# What a capacity search counts as a rate's attainment (`sustained_attainment`).
WHOLE_RUN, SUSTAINED = "whole run", "whole run and the last quarter of its arrivals"


@dataclass(frozen=True)
class Workload:
    name: str
    args: tuple[str, ...]
    # Requests (conversations, for multi-turn) per second one H100 node serves within the SLO, roughly.
    rate_per_node: float
    needs_trace: bool = False
    # Seconds of arrivals served before the measured ones unless `--warmup` says otherwise: for
    # conversations, one conversation's life, before which the load itself is still rising (every
    # conversation started so far is still running) and a run measures how a burst is absorbed.
    warmup_s: float = 0.0


@dataclass(frozen=True)
class Fleet:
    name: str
    spec: str
    nodes: int
    mixed: bool
    # In H100s: an A100 serves about 0.6 of what an H100 does (its step time, a, is 10 ms against 6).
    h100_equivalent: float


SLO = ("--ttft-slo-ms", "2000", "--tpot-slo-ms", "100")
SWEEP = (0.8, 1.0, 1.2, 1.4)  # rates, as multiples of the guessed capacity


WORKLOADS = [
    Workload("shared-prefix", ("--workload", "shared-prefix", "--groups", "256", "--system-tokens", "2048",
                               "--question-tokens", "128", "--output-tokens", "256"), 12.5),
    Workload("multi-turn", ("--workload", "multi-turn", "--groups", "32", "--system-tokens", "1024", "--turns", "6",
                            "--question-tokens", "256", "--output-tokens", "256", "--think-time", "5",
                            "--max-model-len", "8192"), 2.5, warmup_s=60.0),
    Workload("long-context", ("--workload", "long-context", "--long-share", "0.05", "--max-model-len", "32768"), 16.0),
    Workload("trace", ("--workload", "trace", "--max-model-len", "16384"), 3.0, needs_trace=True),
]
FLEETS = [
    Fleet("16 H100", f"{H100}:16", 16, False, 16),
    Fleet("8 H100 + 8 A100", f"{H100}:8,{A100}:8", 16, True, 12.8),
    Fleet("32 H100 + 32 A100", f"{H100}:32,{A100}:32", 64, True, 51.2),
    Fleet("128 H100 + 128 A100", f"{H100}:128,{A100}:128", 256, True, 204.8),
]
POLICIES = ["naive:round_robin", "round_robin", "least_loaded", "prefix_affinity", "kv_cost", "jffc",
            "jffc_per_request"]


@dataclass
class CapacitySearch:
    """The highest rate at which a policy keeps ATTAINMENT, found to within `resolution` (relative)."""

    capacity: float  # the highest probed rate that attained; 0.0 when none did
    ceiling: float | None  # the lowest probed rate above it that did not; None when none failed
    probes: list[tuple[float, float]] = field(default_factory=list)  # (rate, attainment), in probing order


def search_capacity(attainment: Callable[[float], float], guess: float, resolution: float = 0.05,
                    widen: float = 1.5, max_probes: int = 12) -> CapacitySearch:
    """Widen from `guess` by `widen` until one rate attains and a higher one does not, then bisect.

    Attainment is treated as falling with the rate; where the simulation is not
    monotone the result is a rate that attained below one that did not,
    which is what "capacity" can mean on a finite number of runs.
    """
    probes: list[tuple[float, float]] = []

    def probe(rate: float) -> bool:
        value = attainment(rate)
        probes.append((rate, value))
        return value >= ATTAINMENT

    low: float | None = None
    high: float | None = None
    rate = guess
    while len(probes) < max_probes and (low is None or high is None):
        if probe(rate):
            low = rate
            rate = rate * widen
        else:
            high = rate
            rate = rate / widen
        if low is not None and high is not None:
            break
    while low is not None and high is not None and high / low > 1 + resolution and len(probes) < max_probes:
        middle = (low * high) ** 0.5
        if probe(middle):
            low = middle
        else:
            high = middle
    return CapacitySearch(capacity=low or 0.0, ceiling=high, probes=probes)


def run_simulate(argv: list[str]) -> dict[str, Any]:
    out = Path(argv[argv.index("--out") + 1])
    code = simulate_main([*argv, "--quiet"])
    if code != 0:
        raise RuntimeError(f"kvlane simulate {' '.join(argv)} exited {code}")
    return json.loads((out / "results.json").read_text())


def knee_rate(results: dict[str, Any]) -> float | None:
    """The lowest swept rate where round robin's attainment is below 90% (None: it never is)."""
    runs = sorted((r for r in results["runs"] if r["policy"] == BASELINE and "summary" in r), key=lambda r: r["rate"])
    return next((r["rate"] for r in runs if (r["summary"]["slo_attainment"] or 0.0) < ATTAINMENT), None)


def summarize_pair(results: dict[str, Any], mixed: bool) -> dict[str, Any]:
    runs = [r for r in results["runs"] if "summary" in r]
    policies = list(dict.fromkeys(r["policy"] for r in runs))
    rates = sorted({r["rate"] for r in runs})
    knee = knee_rate(results)
    at_knee = knee if knee is not None else rates[-1]

    def summary(policy: str, rate: float) -> dict[str, Any]:
        return next(r["summary"] for r in runs if r["policy"] == policy and r["rate"] == rate)

    swept = {p for p in policies if all(any(r["policy"] == p and r["rate"] == rate for r in runs) for rate in rates)}
    # Only a policy run at every swept rate has a measured capacity (`--at-knee` runs most at one rate).
    capacity = {p: max((rate for rate in rates if (summary(p, rate)["slo_attainment"] or 0) >= ATTAINMENT), default=0.0)
                for p in policies if p in swept}
    goodput = {p: summary(p, at_knee)["goodput_rps"] for p in policies}
    attainment = {p: summary(p, at_knee)["slo_attainment"] or 0.0 for p in policies}
    others = [p for p in policies if p != HEADLINE]
    best_other = max(others, key=lambda p: goodput[p])
    best_attained = max(others, key=lambda p: attainment[p])
    best_capacity = max((p for p in others if p in capacity), key=lambda p: capacity[p], default=None)
    ttft_p99 = {p: summary(p, at_knee)["ttft_ms"]["p99"] for p in policies}
    targets = {
        "goodput_vs_round_robin": _ratio(goodput[HEADLINE], goodput.get(BASELINE)),
        "goodput_vs_naive_round_robin": _ratio(goodput[HEADLINE], goodput.get(f"naive:{BASELINE}")),
        "goodput_vs_best_other": _ratio(goodput[HEADLINE], goodput[best_other]),
        "best_other": best_other,
        # Requests within the SLO per second of arrivals (attainment x rate): free of the run's tail.
        "attained_vs_round_robin": _ratio(attainment[HEADLINE], attainment.get(BASELINE)),
        "attained_vs_best_other": _ratio(attainment[HEADLINE], attainment[best_attained]),
        "best_attained_other": best_attained,
        "ttft_p99_vs_round_robin": _ratio(ttft_p99[HEADLINE], ttft_p99.get(BASELINE)),
    }
    if mixed and HEADLINE in capacity and best_capacity is not None:
        targets["capacity_vs_best_other"] = _ratio(capacity[HEADLINE], capacity[best_capacity])
        targets["best_capacity_other"] = best_capacity
    return {"knee_rate": knee, "compared_at_rate": at_knee, "goodput_at_knee": goodput, "attainment_at_knee": attainment,
            "ttft_p99_at_knee_ms": ttft_p99,
            "capacity": capacity, "targets": targets,
            "hit_rate_at_knee": {p: summary(p, at_knee)["prefix_cache_hit_rate"] for p in policies}}


def _ratio(value: float | None, reference: float | None) -> float | None:
    return value / reference if value is not None and reference else None


def markdown(study: dict[str, Any]) -> str:
    lines = ["| workload | fleet | RR knee (req/s) | goodput vs RR (>= 2) | vs naive RR | vs best other (>= 1.2) | "
             "within SLO vs RR | vs best other | TTFT p99 vs RR (<= 0.5) | capacity vs best other (>= 1.3, mixed) |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for pair in study["pairs"]:
        t = pair["targets"]
        fmt = lambda v: "-" if v is None else f"{v:.2f}x"  # noqa: E731
        capacity = f"{fmt(t.get('capacity_vs_best_other'))} ({t.get('best_capacity_other', '-')})" if "capacity_vs_best_other" in t else "-"
        knee = "beyond the sweep" if pair["knee_rate"] is None else f"{pair['knee_rate']:.3g}"
        lines.append(f"| {pair['workload']} | {pair['fleet']} | {knee} | {fmt(t['goodput_vs_round_robin'])} | "
                     f"{fmt(t['goodput_vs_naive_round_robin'])} | {fmt(t['goodput_vs_best_other'])} ({t['best_other']}) | "
                     f"{fmt(t['attained_vs_round_robin'])} | {fmt(t['attained_vs_best_other'])} ({t['best_attained_other']}) | "
                     f"{fmt(t['ttft_p99_vs_round_robin'])} | {capacity} |")
    return "\n".join(lines) + "\n" + _conditions_note(study)


def capacity_pair(base: list[str], policies: list[str], guess: float, resolution: float, where: Path,
                  seeds: int = 1, whole_run: bool = False) -> dict[str, Any]:
    """Each policy's capacity searched on its own, and jffc_per_request's over round robin's and the best other's.

    A rate's attainment is the mean over seeds 0 to `seeds - 1`: near a cliff one draw of arrivals can
    decide it (docs/benchmarks.md). Each seed's is the lower of the whole run's and its last quarter's
    (`sustained_attainment`), unless `whole_run`.
    """

    def attainment_of(policy: str) -> Callable[[float], float]:
        def attainment(rate: float) -> float:
            attained = []
            for seed in range(seeds):
                out = where / policy.replace(":", "-") / f"{rate:.6g}"
                results = run_simulate([*base, "--policies", policy, "--rate", f"{rate:.6g}", "--seed", str(seed),
                                        "--out", str(out if seeds == 1 else out / f"seed-{seed}")])
                summary = next(r["summary"] for r in results["runs"] if "summary" in r)
                attained.append((summary["slo_attainment"] or 0.0) if whole_run else sustained_attainment(summary))
            return sum(attained) / seeds
        return attainment

    searches = {policy: search_capacity(attainment_of(policy), guess, resolution) for policy in policies}
    capacity = {policy: search.capacity for policy, search in searches.items()}
    return {"resolution": resolution, "capacity": capacity,
            "searches": {policy: asdict(search) for policy, search in searches.items()}, "targets": capacity_targets(capacity)}


def sustained_attainment(summary: dict[str, Any]) -> float:
    """The run's SLO attainment, or that of the last quarter of its arrivals if lower.

    A rate the fleet cannot sustain falls behind a little more every second; a
    run of 10-60 s still keeps most requests within the SLO (the engines' slots
    absorb the excess, and conversations' later turns meet an emptying fleet),
    but its last arrivals show the overload (docs/benchmarks.md, "What any
    routing could sustain").
    """
    whole = summary["slo_attainment"] or 0.0
    late = summary.get("slo_attainment_late")
    return whole if late is None else min(whole, late)


def capacity_targets(capacity: dict[str, float]) -> dict[str, Any]:
    """jffc_per_request's capacity over round robin's, a plain round robin's and the best other policy's (empty without it)."""
    if HEADLINE not in capacity:
        return {}
    best_other = max((p for p in capacity if p != HEADLINE), key=lambda p: capacity[p], default=None)
    return {"capacity_vs_round_robin": _ratio(capacity[HEADLINE], capacity.get(BASELINE)),
            "capacity_vs_naive_round_robin": _ratio(capacity[HEADLINE], capacity.get(f"naive:{BASELINE}")),
            "capacity_vs_best_other": _ratio(capacity[HEADLINE], capacity[best_other]) if best_other else None,
            "best_capacity_other": best_other}


def capacity_markdown(study: dict[str, Any]) -> str:
    lines = ["| workload | fleet | capacity per policy (req/s) | vs RR | vs naive RR | vs best other (>= 1.3, mixed) |",
             "|---|---|---|---|---|---|"]
    fmt = lambda v: "-" if v is None else f"{v:.2f}x"  # noqa: E731
    for pair in study["pairs"]:
        t = pair["targets"]
        per_policy = ", ".join(f"{p} {c:.3g}" for p, c in sorted(pair["capacity"].items(), key=lambda kv: -kv[1]))
        lines.append(f"| {pair['workload']} | {pair['fleet']} | {per_policy} | {fmt(t.get('capacity_vs_round_robin'))} | "
                     f"{fmt(t.get('capacity_vs_naive_round_robin'))} | "
                     f"{fmt(t.get('capacity_vs_best_other'))} ({t.get('best_capacity_other', '-')}) |")
    return "\n".join(lines) + "\n" + _conditions_note(study)


def _conditions_note(study: dict[str, Any]) -> str:
    """What every run shared beyond the defaults: a warm-up, a configuration file."""
    notes = []
    warmup = study.get("warmup_s", 0.0)
    if warmup is None:
        own = sorted({(pair["workload"], pair["warmup_s"]) for pair in study["pairs"] if pair.get("warmup_s")})
        if own:
            notes.append("Runs measured after their workload's warm-up at their rate: "
                         + ", ".join(f"{name} {seconds:g} s" for name, seconds in own) + ".")
    elif warmup:
        notes.append(f"Each run measured after {warmup:g} simulated seconds of warm-up at its rate.")
    if study.get("attainment") == SUSTAINED:
        notes.append("A rate attained when 90% of its requests, and 90% of those of the last quarter of its arrivals, "
                     "met the SLO.")
    if (seeds := study.get("seeds", 1)) > 1:
        notes.append(f"Each rate's attainment is the mean over seeds 0-{seeds - 1}.")
    if config := study.get("config", ""):
        notes.append(f"Every run used this configuration (`--config`):\n\n```toml\n{config.strip()}\n```")
    return "".join(f"\n{note}\n" for note in notes)


def merge(directories: list[Path], out: Path) -> tuple[dict[str, Any], str]:
    """One study of the pairs that studies under `directories` ran, summarized again from their results, and its
    markdown. Capacity studies (`--capacity`, one policy or several each) merge into one pair per workload and fleet."""
    fleets = {fleet.name: fleet for fleet in FLEETS}
    pairs: list[dict[str, Any]] = []
    searched: dict[tuple[str, str], dict[str, Any]] = {}
    studies = [json.loads((directory / "study.json").read_text()) for directory in directories]
    conditions: dict[str, Any] = {}
    # What every run of a study shared, with its value in studies from before it was recorded.
    for key, before, what in (("config", "", "--config files"), ("seeds", 1, "seed counts"),
                              ("attainment", WHOLE_RUN, "attainment measures")):
        values = {study.get(key, before) for study in studies}
        if len(values) > 1:
            raise ValueError(f"studies with different {what} ({', '.join(sorted(map(repr, values)))}) do not compare")
        conditions[key] = values.pop()
    # Warm-ups are compared per workload and fleet (below): a study's own (`--warmup`) or, with None, each workload's.
    warmups = {study.get("warmup_s", 0.0) for study in studies}
    conditions["warmup_s"] = warmups.pop() if len(warmups) == 1 else None
    for study in studies:
        for pair in study["pairs"]:
            # A study from before pairs kept their own warm-up had one for all its runs.
            warmup = pair.get("warmup_s", study.get("warmup_s", 0.0))
            if "searches" in pair:
                merged = searched.setdefault((pair["workload"], pair["fleet"]), {
                    "workload": pair["workload"], "fleet": pair["fleet"], "warmup_s": warmup, "resolution": pair["resolution"],
                    "capacity": {}, "searches": {}})
                if merged["warmup_s"] != warmup:
                    raise ValueError(f"{pair['workload']} on {pair['fleet']}: capacities measured after different "
                                     f"warm-ups ({merged['warmup_s']:g} s, {warmup:g} s) do not compare")
                merged["capacity"].update(pair["capacity"])
                merged["searches"].update(pair["searches"])
                continue
            results = json.loads(Path(pair["results"]).read_text())
            pairs.append({"workload": pair["workload"], "fleet": pair["fleet"], "warmup_s": warmup, "results": pair["results"],
                          **summarize_pair(results, fleets[pair["fleet"]].mixed)})
    if searched and pairs:
        raise ValueError("capacity studies and rate sweeps summarize differently: merge them apart")
    capacity_pairs = [{**pair, "targets": capacity_targets(pair["capacity"])} for pair in searched.values()]
    study = {"merged_from": [str(d) for d in directories], "num_blocks": NUM_BLOCKS, **conditions,
             "pairs": pairs or capacity_pairs}
    text = capacity_markdown(study) if capacity_pairs else markdown(study)
    out.mkdir(parents=True, exist_ok=True)
    (out / "study.json").write_text(json.dumps(study, indent=1) + "\n")
    (out / "study.md").write_text(text)
    return study, text


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m loadtest.routing.routing_study", description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=RESULTS_DIR / "routing-study")
    parser.add_argument("--quick", action="store_true", help="two workloads on the 16-node fleets, fewer requests")
    parser.add_argument("--workloads", help="comma-separated subset of: " + ",".join(w.name for w in WORKLOADS))
    parser.add_argument("--fleets", help="comma-separated subset of fleet sizes: 16,16m,64m,256m")
    parser.add_argument("--policies", default=",".join(POLICIES))
    parser.add_argument("--duration", type=float, default=20.0, help="simulated seconds of arrivals per run")
    parser.add_argument("--warmup", type=float,
                        help="simulated seconds of arrivals before those, served and not measured (kvlane simulate --warmup); "
                             "default: each workload's own (multi-turn 60, the others 0)")
    parser.add_argument("--config", type=Path,
                        help="TOML configuration for every run (kvlane simulate --config); study.json keeps its text")
    parser.add_argument("--rate-per-node", type=float,
                        help="centre the sweep on this many requests (conversations) per second per H100 "
                             "instead of the workload's own guess")
    parser.add_argument("--at-knee", action="store_true",
                        help="sweep round robin alone, then run every other policy only at its knee")
    parser.add_argument("--capacity", action="store_true",
                        help="search each policy's capacity on its own (widen, then bisect) instead of a fixed sweep")
    parser.add_argument("--resolution", type=float, default=0.05,
                        help="with --capacity: stop when the bracket is narrower than this, relative")
    parser.add_argument("--seeds", type=int, default=1,
                        help="with --capacity: a rate's attainment is the mean over this many seeds (0, 1, ...)")
    parser.add_argument("--whole-run", action="store_true",
                        help="with --capacity: a rate attains on the whole run's SLO attainment alone, not also on "
                             "the last quarter of its arrivals (how capacities were searched before that)")
    parser.add_argument("--merge", type=Path, nargs="+", metavar="DIR",
                        help="run nothing: summarize again the studies in these --out directories, into --out")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.merge:
        try:
            print(merge(args.merge, args.out)[1])
        except ValueError as exc:
            print(exc, file=sys.stderr)
            return 2
        return 0
    if args.seeds < 1 or (args.seeds > 1 and not args.capacity):
        print(f"--seeds {args.seeds}: at least 1, and more only with --capacity (it averages a search's probes)",
              file=sys.stderr)
        return 2
    config_text = ""
    if args.config:
        try:
            config_text = args.config.read_text()
            load_config(args.config)
        except (OSError, ConfigError) as exc:
            print(f"--config {args.config}: {exc}", file=sys.stderr)
            return 2
    fleet_keys = {"16": FLEETS[0], "16m": FLEETS[1], "64m": FLEETS[2], "256m": FLEETS[3]}
    fleets = [fleet_keys[k] for k in args.fleets.split(",")] if args.fleets else FLEETS
    workloads = [w for w in WORKLOADS if not args.workloads or w.name in args.workloads.split(",")]
    if args.quick:
        fleets = [f for f in fleets if f.nodes == 16] or fleets[:2]
        workloads = [w for w in workloads if w.name in ("shared-prefix", "trace")] or workloads[:2]
    policies = args.policies.split(",")
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    trace = out / "trace.jsonl"
    if any(w.needs_trace for w in workloads) and not trace.exists():
        trace.write_text("".join(row.to_json() + "\n" for row in generate(TraceSpec(requests=60_000))))
    study: dict[str, Any] = {"policies": policies, "num_blocks": NUM_BLOCKS, "warmup_s": args.warmup,
                             "config": config_text, "seeds": args.seeds, "pairs": []}
    if args.capacity:
        study["attainment"] = WHOLE_RUN if args.whole_run else SUSTAINED
    for workload in workloads:
        for fleet in fleets:
            duration = args.duration / (2 if args.quick else 1)
            warmup = workload.warmup_s if args.warmup is None else args.warmup
            base = ["--fleet", fleet.spec, "--num-blocks", str(NUM_BLOCKS), "--duration", f"{duration:g}",
                    "--warmup", f"{warmup:g}", *workload.args, *SLO,
                    *(["--config", str(args.config)] if args.config else [])]
            if workload.needs_trace:
                base += ["--trace", str(trace)]
            where = out / f"{workload.name}-{fleet.nodes}{'m' if fleet.mixed else ''}"
            guess = (args.rate_per_node or workload.rate_per_node) * fleet.h100_equivalent
            rates = ",".join(f"{guess * k:.4g}" for k in SWEEP)
            if args.capacity:
                pair = {"workload": workload.name, "fleet": fleet.name, "warmup_s": warmup,
                        **capacity_pair(base, policies, guess, args.resolution, where / "capacity", args.seeds,
                                        args.whole_run)}
                study["pairs"].append(pair)
                (out / "study.json").write_text(json.dumps(study, indent=1) + "\n")
                (out / "study.md").write_text(capacity_markdown(study))
                print(f"{workload.name} on {fleet.name}: {json.dumps(pair['targets'])}", flush=True)
                continue
            if args.at_knee and BASELINE in policies:
                results = run_simulate([*base, "--policies", BASELINE, "--rates", rates, "--out", str(where / BASELINE)])
                knee = knee_rate(results)
                at = knee if knee is not None else max(r["rate"] for r in results["runs"])
                others = [p for p in policies if p != BASELINE]
                at_knee = run_simulate([*base, "--policies", ",".join(others), "--rates", repr(at), "--out", str(where / "at-knee")])
                results = {**results, "runs": results["runs"] + at_knee["runs"]}
                where.mkdir(parents=True, exist_ok=True)
                (where / "results.json").write_text(json.dumps(results, indent=1) + "\n")
            else:
                results = run_simulate([*base, "--policies", ",".join(policies), "--rates", rates, "--out", str(where)])
            pair = {"workload": workload.name, "fleet": fleet.name, "warmup_s": warmup, "results": str(where / "results.json"),
                    **summarize_pair(results, fleet.mixed)}
            study["pairs"].append(pair)
            (out / "study.json").write_text(json.dumps(study, indent=1) + "\n")
            (out / "study.md").write_text(markdown(study))
            print(f"{workload.name} on {fleet.name}: {json.dumps(pair['targets'])}", flush=True)
    print(capacity_markdown(study) if args.capacity else markdown(study))
    return 0


if __name__ == "__main__":
    sys.exit(main())
