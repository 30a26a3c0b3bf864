"""Prefix pulls between kv_share nodes against computing the prefix again, in virtual time.

The fleet is 8 H100 + 8 A100 sim nodes (Llama-3-8B profiles, 28,000 blocks
each) serving a held-out Mooncake-format trace (`loadtest.bench.trace_gen`
with its own seed: multi-turn histories, 30 Zipf tenants, long documents,
high block reuse) with jffc_per_request. Compared, each on the same requests:

* **today**: no node shares KV (`worker.kv_share = false`);
* **pull at 25, 100 and 400 Gbit/s**: every node kv_share, its KV over
  `ethernet-25g`, `ethernet-100g` or `rdma-400g` (`worker.sim.kv_link`).

Measured:

* each one's **sustained throughput**: the capacity search of
  `routing_study` (the highest rate with >= 90% of requests, and of the last
  quarter of arrivals, within the SLO), target >= 1.2x today's;
* at `--overload` times today's capacity (a rate it does not sustain), the
  **uncached share** of prompt tokens against the fleet-wide prefix oracle's
  (`kvlane simulate --ceiling`), target <= 1.1x, with the pulls made and the
  tokens they moved;
* on a workload with **no shared prefix** (routing_study's long context),
  capacity with every node kv_share against today's, target within 2%, and
  no pull at all.

Writes `study.json` and `study.md` under `--out`.

    python -m loadtest.routing.prefix_pull_study --quick    # shorter runs, a coarser capacity
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from loadtest.bench.command import RESULTS_DIR
from loadtest.bench.trace_gen import TraceSpec, generate
from loadtest.routing.routing_study import A100, H100, SLO, WORKLOADS, run_simulate, search_capacity, sustained_attainment

FLEET = f"{H100}:8,{A100}:8"
NUM_BLOCKS = 28_000
POLICY = "jffc_per_request"
# Held out: not the seed `routing_study`'s trace is generated with.
TRACE = TraceSpec(requests=60_000, tenants=30, seed=7)
LINKS = {"25 Gbit/s": "ethernet-25g", "100 Gbit/s": "ethernet-100g", "400 Gbit/s": "rdma-400g"}
TARGETS = {"throughput_vs_today": 1.2, "uncached_vs_oracle": 1.1, "no_prefix_capacity_within": 0.02}
# Where the capacity searches start (requests per second, roughly today's capacity on each workload).
GUESS = {"trace": 50.0, "long-context": 140.0}
# Queued requests wait as long as the run lasts: overload shows as attainment, not as refusals.
UNBOUNDED_QUEUE = "[balancer.queue]\nmax_length = 1000000\nmax_wait_s = 100000\n"


def config_text(link: str | None) -> str:
    """The run's configuration: today's (None) or every node kv_share over `link`."""
    if link is None:
        return UNBOUNDED_QUEUE
    return f"{UNBOUNDED_QUEUE}\n[worker]\nkv_share = true\n\n[worker.sim]\nkv_link = \"{link}\"\n"


def simulate(base: list[str], link: str | None, rate: float, out: Path, ceiling: bool = False) -> dict[str, Any]:
    """One run at `rate`; its results.json's one run."""
    out.mkdir(parents=True, exist_ok=True)
    config = out / "config.toml"
    config.write_text(config_text(link))
    argv = [*base, "--policies", POLICY, "--rate", f"{rate:.6g}", "--config", str(config), "--out", str(out),
            *(["--ceiling"] if ceiling else [])]
    return next(r for r in run_simulate(argv)["runs"] if "summary" in r)


def capacity(base: list[str], link: str | None, guess: float, resolution: float, where: Path) -> dict[str, Any]:
    search = search_capacity(lambda rate: sustained_attainment(simulate(base, link, rate, where / f"{rate:.6g}")["summary"]),
                             guess, resolution)
    print(f"{where.name}: capacity {search.capacity:.4g} req/s {search.probes}", flush=True)
    return {"capacity_rps": search.capacity, "probes": search.probes}


def overloaded(base: list[str], link: str | None, rate: float, out: Path) -> dict[str, Any]:
    run = simulate(base, link, rate, out, ceiling=True)
    summary, counters = run["summary"], run["simulation"]
    uncached = 1.0 - (summary["prefix_cache_hit_rate"] or 0.0)
    oracle = run["ceiling"]["uncached_share"]
    return {"uncached_share": uncached, "oracle_uncached_share": oracle, "uncached_vs_oracle": uncached / oracle if oracle else None,
            "ceiling_rps": run["ceiling"]["requests_per_s"], "attainment": summary["slo_attainment"],
            "attainment_late": summary.get("slo_attainment_late"), "completed": summary["succeeded"],
            "prefix_pulls": counters.get("prefix_pulls", 0), "prefix_pull_tokens": counters.get("prefix_pull_tokens", 0)}


def study(trace_base: list[str], no_prefix_base: list[str], resolution: float, overload: float, where: Path) -> dict[str, Any]:
    variants: dict[str, str | None] = {"today": None, **LINKS}
    capacities = {label: capacity(trace_base, link, GUESS["trace"], resolution, where / "capacity" / _slug(label))
                  for label, link in variants.items()}
    today = capacities["today"]["capacity_rps"]
    rate = overload * today
    at_overload = {label: overloaded(trace_base, link, rate, where / "overload" / _slug(label)) for label, link in variants.items()}
    no_prefix = {label: capacity(no_prefix_base, link, GUESS["long-context"], resolution, where / "no-prefix" / _slug(label))
                 for label, link in (("today", None), ("100 Gbit/s", LINKS["100 Gbit/s"]))}
    no_prefix_pulls = overloaded(no_prefix_base, LINKS["100 Gbit/s"], no_prefix["today"]["capacity_rps"],
                                 where / "no-prefix" / "pulls")["prefix_pulls"]
    checks: dict[str, Any] = {}
    for label in LINKS:
        checks[label] = {
            "throughput_vs_today": capacities[label]["capacity_rps"] / today if today else None,
            "uncached_vs_oracle": at_overload[label]["uncached_vs_oracle"],
        }
    within = abs(no_prefix["100 Gbit/s"]["capacity_rps"] / no_prefix["today"]["capacity_rps"] - 1.0)
    return {"trace": vars(TRACE), "capacity": capacities, "overload_rate_rps": rate, "at_overload": at_overload,
            "no_prefix": {"capacity": no_prefix, "capacity_change": within, "pulls": no_prefix_pulls},
            "checks": checks}


def _slug(label: str) -> str:
    return label.replace(" ", "-").replace("/", "")


def markdown(result: dict[str, Any]) -> str:
    def number(value: float | None, digits: int = 3) -> str:
        return "-" if value is None else f"{value:.{digits}g}"

    today = result["capacity"]["today"]["capacity_rps"]
    lines = [f"Fleet {FLEET}, {POLICY}, held-out trace (seed {result['trace']['seed']}, {result['trace']['tenants']} tenants); "
             f"overload runs at {number(result['overload_rate_rps'])} req/s.", "",
             "| | sustained req/s | vs today (>= 1.2x) | uncached share at overload | oracle's | vs oracle (<= 1.1x) | pulls | tokens pulled |",
             "|---|---|---|---|---|---|---|---|"]
    for label, cap in result["capacity"].items():
        over = result["at_overload"][label]
        lines.append(f"| {label} | {number(cap['capacity_rps'])} | {number(cap['capacity_rps'] / today if today else None)}x | "
                     f"{number(over['uncached_share'])} | {number(over['oracle_uncached_share'])} | "
                     f"{number(over['uncached_vs_oracle'])}x | {over['prefix_pulls']} | {over['prefix_pull_tokens']} |")
    no_prefix = result["no_prefix"]
    lines += ["", f"No shared prefix (long context): capacity {number(no_prefix['capacity']['today']['capacity_rps'])} req/s today, "
              f"{number(no_prefix['capacity']['100 Gbit/s']['capacity_rps'])} with kv_share at 100 Gbit/s "
              f"(change {no_prefix['capacity_change']:.1%}, target <= 2%); pulls: {no_prefix['pulls']}."]
    return "\n".join(lines) + "\n"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=RESULTS_DIR / "prefix-pull-study")
    parser.add_argument("--duration", type=float, default=20.0, help="simulated seconds of measured arrivals per run")
    parser.add_argument("--warmup", type=float, default=40.0, help="simulated seconds of arrivals before them")
    parser.add_argument("--resolution", type=float, default=0.05, help="the capacity search's relative step")
    parser.add_argument("--overload", type=float, default=1.3, help="the overload run's rate, times today's capacity")
    parser.add_argument("--quick", action="store_true", help="10 s runs after 20 s of warm-up, a 15%% capacity step")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    duration, warmup, resolution = (10.0, 20.0, 0.15) if args.quick else (args.duration, args.warmup, args.resolution)
    args.out.mkdir(parents=True, exist_ok=True)
    trace = args.out / "trace.jsonl"
    if not trace.exists():
        trace.write_text("".join(row.to_json() + "\n" for row in generate(TRACE)))
    common = ["--fleet", FLEET, "--num-blocks", str(NUM_BLOCKS), "--duration", f"{duration:g}", "--warmup", f"{warmup:g}",
              *SLO, "--request-timeout", "100000"]
    trace_base = [*common, "--workload", "trace", "--trace", str(trace), "--max-model-len", "16384"]
    long_context = next(w for w in WORKLOADS if w.name == "long-context")
    no_prefix_base = [*common, *long_context.args]
    result = study(trace_base, no_prefix_base, resolution, args.overload, args.out)
    (args.out / "study.json").write_text(json.dumps(result, indent=2))
    text = markdown(result)
    (args.out / "study.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
