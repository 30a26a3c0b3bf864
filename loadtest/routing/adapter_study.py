"""LoRA adapters: adapter-aware routing against the same policy unaware, round robin and LoRA affinity, in virtual time.

The fleet is 8 H100 + 8 A100 sim nodes (`routing_study`'s mixed fleet), each
with `--max-loras` 4 adapter batch slots and vLLM's default host cache for
adapters (`--max-cpu-loras` = `--max-loras`); every session runs with one of
128 adapters, drawn from a Zipf law of exponent 1.1 (`kvlane simulate
--adapters`). Compared, per workload (`routing_study`'s shared prefix and
trace):

* `jffc_per_request`: the adapter-aware balancer (`balancer.adapters.aware`):
  each node's adapter load, and the slot it takes there (`price_slots`), in
  the request's cost, and only nodes with a slot the adapter can take offered;
* `jffc_per_request, unaware`: the same policy with `aware = false`;
* `jffc_per_request, slots unpriced`: the same with `price_slots = false`;
* `round_robin`: kvlane's round robin, on the aware balancer (it is offered
  the nodes with a slot for the adapter, and ignores the load cost);
* `lora_affinity`: the Gateway API Inference Extension's LoRA affinity rule.

Reported per policy: capacity (the highest rate with >= 90% of requests, and
of the last quarter of arrivals, within the SLO, searched on its own as
`routing_study --capacity` does, on the mean over `--seeds` runs at each
rate); and at round robin's knee (the lowest rate round robin's search
found below that), from the first seed's run: adapter loads per 1,000
requests, TTFT p99, the adapters with a request in flight at once (against
the fleet's slots), the throughput ceiling with the adapter loads no
routing avoids counted (`kvlane simulate --ceiling`), and the share within
the SLO of the requests of adapters by popularity rank (`RANK_BANDS`). Targets, the headline
`jffc_per_request` against the others: capacity >= 1.5x the best other's;
adapter loads per 1,000 requests <= 0.5x the fewest of the others; TTFT p99
at round robin's knee <= 0.5x round robin's.

Everything is in simulated time. Writes `study.json` and `study.md` under
`--out`.

    python -m loadtest.routing.adapter_study --quick      # fewer, shorter runs, coarser capacities
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import Counter
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

from loadtest.bench.client import RequestRecord
from loadtest.bench.command import RESULTS_DIR
from loadtest.bench.metrics import Slo, meets_slo
from loadtest.bench.trace_gen import TraceSpec, generate
from loadtest.bench.workloads import WorkloadSpec, adapter_name
from loadtest.routing.routing_study import (A100, ATTAINMENT, H100, NUM_BLOCKS, SLO, WORKLOADS, CapacitySearch, run_simulate,
                                            search_capacity, sustained_attainment)

FLEET_NODES = 16
FLEET = f"{H100}:{FLEET_NODES // 2},{A100}:{FLEET_NODES // 2}"
ADAPTERS = 128
ZIPF = 1.1
MAX_LORAS = 4
# What loading a rank-16 adapter of Llama-3-8B costs, the same on both cards (the sim's times are fleet-wide).
# On all seven projections it holds 16 x 81,920 x 32 = 42M parameters, 84 MB in 16 bits. Into a batch slot from
# host memory it crosses PCIe: about 2 ms on an H100 (Gen5, ~40 GB/s achieved) and 3.4 ms on an A100 (Gen4,
# ~25 GB/s); 3 ms here. Into host memory it is read from storage and unpacked first: tens of ms from a local NVMe
# drive (~2-3 GB/s), hundreds from network storage; 80 ms here. S-LoRA (Sheng et al., "S-LoRA: Serving Thousands
# of Concurrent LoRA Adapters", MLSys 2024, arXiv:2311.03285) keeps every adapter in host memory and copies it to
# the GPU on demand for this reason; vLLM keeps an LRU of `--max-cpu-loras` adapters in host memory and
# `--max-loras` on the GPU.
ACTIVATE_S = 0.003
LOAD_S = 0.08
HEADLINE = "jffc_per_request"
BASELINE = "round_robin"
TARGETS = {"capacity_vs_best_other": 1.5, "loads_vs_fewest_other": 0.5, "ttft_p99_vs_round_robin": 0.5}
SLO_S = Slo(ttft_s=float(SLO[SLO.index("--ttft-slo-ms") + 1]) / 1000.0, tpot_s=float(SLO[SLO.index("--tpot-slo-ms") + 1]) / 1000.0)
# Adapters by popularity rank (1: the most asked for): with Zipf(1.1) over 128 the bands carry about 45%, 24%,
# 21% and 10% of sessions.
RANK_BANDS = ((1, 4), (5, 16), (17, 64), (65, ADAPTERS))


@dataclass(frozen=True)
class Variant:
    label: str
    policy: str
    aware: bool = True
    price_slots: bool = True


VARIANTS = [
    Variant(HEADLINE, "jffc_per_request"),
    Variant("jffc_per_request, unaware", "jffc_per_request", aware=False),
    Variant("jffc_per_request, slots unpriced", "jffc_per_request", price_slots=False),
    Variant(BASELINE, "round_robin"),
    Variant("lora_affinity", "lora_affinity"),
]

# Requests per second the fleet serves within the SLO with these adapters, roughly: where a capacity search starts.
GUESS = {"shared-prefix": 50.0, "trace": 30.0}


# --- the study ----------------------------------------------------------------------------------------------


def config_text(variant: Variant) -> str:
    """The sim's load times, and the balancer's estimates of them (before a node has measured one)."""
    return (f"[worker.sim]\nadapter_activate_s = {ACTIVATE_S}\nadapter_load_s = {LOAD_S}\n\n"
            f"[balancer.adapters]\naware = {'true' if variant.aware else 'false'}\n"
            f"price_slots = {'true' if variant.price_slots else 'false'}\n"
            f"activate_s = {ACTIVATE_S}\nload_s = {ACTIVATE_S + LOAD_S}\n")


def slug(label: str) -> str:
    return "".join(c if c.isalnum() else "-" for c in label).strip("-")


def simulate(variant: Variant, base: list[str], rate: float, out: Path, ceiling: bool = False) -> dict[str, Any]:
    """One run of `variant` at `rate`; its results.json's one run."""
    out.mkdir(parents=True, exist_ok=True)
    config = out / "adapters.toml"
    config.write_text(config_text(variant))
    argv = [*base, "--policies", variant.policy, "--rate", f"{rate:.6g}", "--config", str(config), "--out", str(out),
            *(["--ceiling"] if ceiling else [])]
    results = run_simulate(argv)
    return next(r for r in results["runs"] if "summary" in r)


def study_workload(name: str, base: list[str], variants: list[Variant], guess: float, resolution: float,
                   where: Path, seeds: int = 1) -> dict[str, Any]:
    searches: dict[str, CapacitySearch] = {}
    for variant in variants:
        def attainment(rate: float, variant: Variant = variant) -> float:
            # One run's attainment swings by several points with the arrivals' draw: the mean over seeds.
            return sum(sustained_attainment(simulate(variant, [*base, "--seed", str(seed)], rate,
                                                     where / slug(variant.label) / f"{rate:.6g}" / f"seed-{seed}")["summary"])
                       for seed in range(seeds)) / seeds
        searches[variant.label] = search_capacity(attainment, guess, resolution)
        print(f"{name}, {variant.label}: capacity {searches[variant.label].capacity:.3g} req/s "
              f"{searches[variant.label].probes}", flush=True)
    baseline = searches.get(BASELINE)
    knee = None if baseline is None else baseline.ceiling
    if knee is None:
        knee = max(rate for search in searches.values() for rate, _ in search.probes)
    at_knee = {}
    for variant in variants:
        run = simulate(variant, base, knee, where / "knee" / slug(variant.label), ceiling=True)
        summary, ceiling = run["summary"], run.get("ceiling", {})
        at_knee[variant.label] = {
            "attainment": summary["slo_attainment"], "ttft_p99_ms": summary["ttft_ms"]["p99"],
            "adapter_loads_per_1k": run["adapters"]["loads_per_1k"], "hit_rate": summary["prefix_cache_hit_rate"],
            "ceiling_rps": ceiling.get("requests_per_s"), "ceiling_adapter_loads_per_1k": ceiling.get("adapter_loads_per_1k"),
            "within_slo_by_rank": within_slo_by_rank(run["records"]),
            "adapters_in_flight": adapters_in_flight(run["records"]),
        }
    capacity = {label: search.capacity for label, search in searches.items()}
    return {"workload": name, "knee_rate": knee, "capacity": capacity, "at_knee": at_knee,
            "searches": {label: asdict(search) for label, search in searches.items()},
            "targets": targets(capacity, at_knee)}


def within_slo_by_rank(records: list[dict[str, Any]], seed: int = 0) -> dict[str, float | None]:
    """Per band of `RANK_BANDS`, the share of its adapters' requests within the SLO (None: it had none).

    A session's adapter is a function of the workload's seed and the session's index (`adapter_name`), which its
    id carries after its one-letter kind ("s12", "t12").
    """
    spec = WorkloadSpec(seed=seed, adapters=ADAPTERS, adapter_zipf=ZIPF)
    known = {f.name for f in fields(RequestRecord)}
    met: Counter[str] = Counter()
    total: Counter[str] = Counter()
    for data in records:
        record = RequestRecord(**{k: v for k, v in data.items() if k in known})
        rank = int(adapter_name(spec, int(record.session_id[1:])).removeprefix("adapter-")) + 1
        band = next(f"{low}-{high}" for low, high in RANK_BANDS if low <= rank <= high)
        total[band] += 1
        met[band] += meets_slo(record, SLO_S)
    return {f"{low}-{high}": met[f"{low}-{high}"] / total[f"{low}-{high}"] if total[f"{low}-{high}"] else None
            for low, high in RANK_BANDS}


def adapters_in_flight(records: list[dict[str, Any]], step_s: float = 0.1, settle_s: float = 5.0) -> float | None:
    """The mean number of distinct adapters with a request between its sending and its end, sampled every `step_s`
    from `settle_s` after the first request is sent (`records` leave out the warm-up's, still in flight then) to
    the last sending.

    Against the fleet's slots (nodes x `MAX_LORAS`): beyond them, some adapters' requests wait for a slot to free
    however they are routed, since a slot runs one adapter.
    """
    spans = [(r["sent_s"], r["end_s"], r["model"]) for r in records if r.get("end_s") is not None]
    if not spans:
        return None
    start, end = min(s for s, _, _ in spans) + settle_s, max(s for s, _, _ in spans)
    events = sorted([(s, 1, m) for s, _, m in spans] + [(e, -1, m) for _, e, m in spans])
    open_per_adapter: Counter[str] = Counter()
    samples, at, i = [], start, 0
    while at <= end:
        while i < len(events) and events[i][0] <= at:
            open_per_adapter[events[i][2]] += events[i][1]
            i += 1
        samples.append(sum(1 for count in open_per_adapter.values() if count > 0))
        at += step_s
    return sum(samples) / len(samples) if samples else None


def targets(capacity: dict[str, float], at_knee: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """The headline's ratios to the others."""
    if HEADLINE not in capacity:
        return {}
    others = [label for label in capacity if label != HEADLINE]
    best = max(others, key=lambda label: capacity[label], default=None)
    loads = {label: at_knee[label]["adapter_loads_per_1k"] for label in capacity}
    fewest = min((label for label in others if loads[label] is not None), key=lambda label: loads[label], default=None)
    ttft = {label: at_knee[label]["ttft_p99_ms"] for label in capacity}
    return {
        "capacity_vs_best_other": _ratio(capacity[HEADLINE], capacity.get(best)) if best else None,
        "best_capacity_other": best,
        "loads_vs_fewest_other": _ratio(loads[HEADLINE], loads.get(fewest)) if fewest else None,
        "fewest_loads_other": fewest,
        "loads_vs_round_robin": _ratio(loads[HEADLINE], loads.get(BASELINE)),
        "ttft_p99_vs_round_robin": _ratio(ttft[HEADLINE], ttft.get(BASELINE)),
    }


def _ratio(value: float | None, reference: float | None) -> float | None:
    return value / reference if value is not None and reference else None


def markdown(study: dict[str, Any]) -> str:
    fmt = lambda value, spec: "-" if value is None else format(value, spec)  # noqa: E731
    slots = FLEET_NODES * MAX_LORAS
    lines = ["| workload | policy | capacity (req/s) | adapter loads / 1k requests | TTFT p99 (ms) | within SLO | "
             f"adapters in flight (of {slots} slots) | ceiling (req/s) | ceiling's loads / 1k |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|"]
    for pair in study["workloads"]:
        for label, capacity in pair["capacity"].items():
            knee = pair["at_knee"][label]
            lines.append(f"| {pair['workload']} (knee {pair['knee_rate']:.3g} req/s) | {label} | {capacity:.3g} | "
                         f"{fmt(knee['adapter_loads_per_1k'], '.0f')} | {fmt(knee['ttft_p99_ms'], '.0f')} | "
                         f"{fmt(knee['attainment'], '.3f')} | {fmt(knee.get('adapters_in_flight'), '.1f')} | "
                         f"{fmt(knee['ceiling_rps'], '.1f')} | "
                         f"{fmt(knee['ceiling_adapter_loads_per_1k'], '.1f')} |")
    judged = [pair for pair in study["workloads"] if pair["targets"]]  # those where the headline ran
    if judged:
        lines += ["", "| workload | capacity vs best other (>= 1.5) | loads vs fewest other (<= 0.5) | loads vs RR | "
                  "TTFT p99 vs RR (<= 0.5) |", "|---|---|---|---|---|"]
    for pair in judged:
        t = pair["targets"]
        verdict = lambda value, key, above: "-" if value is None else (  # noqa: E731
            f"{value:.2f}x, {'met' if (value >= TARGETS[key]) == above else 'missed'}")
        lines.append(f"| {pair['workload']} | {verdict(t.get('capacity_vs_best_other'), 'capacity_vs_best_other', True)} "
                     f"({t.get('best_capacity_other')}) | "
                     f"{verdict(t.get('loads_vs_fewest_other'), 'loads_vs_fewest_other', False)} ({t.get('fewest_loads_other')}) | "
                     f"{fmt(t.get('loads_vs_round_robin'), '.2f')}x | "
                     f"{verdict(t.get('ttft_p99_vs_round_robin'), 'ttft_p99_vs_round_robin', False)} |")
    return "\n".join(lines) + "\n"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m loadtest.routing.adapter_study", description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=RESULTS_DIR / "adapter-study")
    parser.add_argument("--workloads", default="shared-prefix,trace", help="comma-separated: shared-prefix, trace")
    parser.add_argument("--policy", action="append", default=[], metavar="LABEL",
                        help=f"run this one of {', '.join(repr(v.label) for v in VARIANTS)} (repeatable; default: all)")
    parser.add_argument("--duration", type=float, default=20.0, help="simulated seconds of measured arrivals per run")
    parser.add_argument("--warmup", type=float, default=20.0, help="simulated seconds of arrivals before those")
    parser.add_argument("--resolution", type=float, default=0.05, help="capacity searches stop within this, relative")
    parser.add_argument("--max-cpu-loras", type=int, help="adapters a node keeps in host memory (default: vLLM's, = 4)")
    parser.add_argument("--seeds", type=int, default=3,
                        help="runs per probed rate, one per seed; their mean attainment decides the capacity")
    parser.add_argument("--quick", action="store_true", help="10 s + 10 s runs, capacities to 15%%, one seed")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    unknown = [label for label in args.policy if label not in {v.label for v in VARIANTS}]
    if unknown:
        print(f"--policy: unknown {', '.join(unknown)}", file=sys.stderr)
        return 2
    variants = [v for v in VARIANTS if not args.policy or v.label in args.policy]
    duration, warmup, resolution = (10.0, 10.0, 0.15) if args.quick else (args.duration, args.warmup, args.resolution)
    seeds = 1 if args.quick else args.seeds
    if seeds < 1:
        print("--seeds: 1 or more", file=sys.stderr)
        return 2
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    workloads = {w.name: w for w in WORKLOADS}
    names = [name for name in args.workloads.split(",") if name]
    if any(name not in GUESS for name in names):
        print(f"--workloads: choose from {', '.join(GUESS)}", file=sys.stderr)
        return 2
    trace = out / "trace.jsonl"
    if "trace" in names and not trace.exists():
        trace.write_text("".join(row.to_json() + "\n" for row in generate(TraceSpec(requests=60_000))))
    lora = ["--adapters", str(ADAPTERS), "--adapter-popularity", f"zipf:{ZIPF}", "--max-loras", str(MAX_LORAS),
            *(["--max-cpu-loras", str(args.max_cpu_loras)] if args.max_cpu_loras is not None else [])]
    study: dict[str, Any] = {"fleet": FLEET, "num_blocks": NUM_BLOCKS, "adapters": ADAPTERS, "zipf": ZIPF,
                             "max_loras": MAX_LORAS, "max_cpu_loras": args.max_cpu_loras or MAX_LORAS,
                             "adapter_activate_s": ACTIVATE_S, "adapter_load_s": LOAD_S, "warmup_s": warmup,
                             "duration_s": duration, "resolution": resolution, "seeds": seeds, "attainment": ATTAINMENT,
                             "targets": TARGETS, "argv": list(sys.argv[1:] if argv is None else argv), "workloads": []}
    for name in names:
        workload = workloads[name]
        base = ["--fleet", FLEET, "--num-blocks", str(NUM_BLOCKS), "--duration", f"{duration:g}", "--warmup", f"{warmup:g}",
                *workload.args, *SLO, *lora, *(["--trace", str(trace)] if workload.needs_trace else [])]
        study["workloads"].append(study_workload(name, base, variants, GUESS[name], resolution, out / name, seeds))
        (out / "study.json").write_text(json.dumps(study, indent=1) + "\n")
        (out / "study.md").write_text(markdown(study))
    print(markdown(study))
    return 0


if __name__ == "__main__":
    sys.exit(main())
