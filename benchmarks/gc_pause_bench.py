"""How long one full garbage collection stops each service's event loop, before and after its start-up heap is frozen.

A full collection walks every object the process tracks, and while it runs
the service's event loop serves nothing: a worker's streams stall, a
balancer's routes wait. Each service freezes what it built to start
(`shared.runner.freeze_startup_heap`, called as it announces ready), so a
collection walks only what serving made since.

Each service runs in a fresh process, alternately, `--rounds` times: it
imports what the service imports (for the vLLM worker, vLLM's engine
front end), then times `--collections` full collections, freezes, and times
as many again. The figures count what importing makes, not what starting
makes (a vLLM worker builds its engine on top): a floor of the pause.

    python benchmarks/gc_pause_bench.py [--rounds N] [--collections N] [--out results.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:  # run as a plain script from anywhere
    sys.path.insert(0, str(REPO_ROOT))

DEFAULT_OUTPUT = REPO_ROOT / "benchmarks" / "results" / "gc_pause.json"

# What each service process imports before it serves.
SERVICES = {
    "ingress": ["services.ingress.main"],
    "balancer": ["services.balancer.main"],
    "cache-manager": ["services.cache_manager.main"],
    "health-prober": ["services.health_prober.main"],
    "worker (sim)": ["services.worker.main"],
    "worker (vLLM)": ["services.worker.main", "services.worker.engines.vllm_engine"],
}

_PROBE = """
import gc, importlib, json, sys, time
try:
    for module in sys.argv[2:]:
        importlib.import_module(module)
except ModuleNotFoundError as exc:  # vLLM not installed here
    print(json.dumps({"missing": exc.name}))
    sys.exit(0)
from shared.runner import freeze_startup_heap

def pauses():
    times = []
    for _ in range(int(sys.argv[1])):
        started = time.perf_counter()
        gc.collect()
        times.append(time.perf_counter() - started)
    return times

tracked = len(gc.get_objects())
before = pauses()
freeze_startup_heap()
print(json.dumps({"tracked": tracked, "before_s": before, "after_s": pauses()}))
"""


def probe(modules: list[str], collections: int) -> dict | None:
    """One fresh process's pauses; None where a module is not installed here (vLLM)."""
    done = subprocess.run([sys.executable, "-c", _PROBE, str(collections), *modules], cwd=REPO_ROOT,
                          capture_output=True, text=True, check=True)
    answer = json.loads(done.stdout.strip().splitlines()[-1])
    return None if "missing" in answer else answer


def run(rounds: int, collections: int) -> dict:
    samples: dict[str, list[dict]] = {name: [] for name in SERVICES}
    skipped: list[str] = []
    for _ in range(rounds):
        for name, modules in SERVICES.items():
            if name in skipped:
                continue
            sample = probe(modules, collections)
            if sample is None:
                skipped.append(name)
                del samples[name]
            else:
                samples[name].append(sample)
    results = {}
    for name, runs in samples.items():
        before = statistics.median(t for r in runs for t in r["before_s"])
        after = statistics.median(t for r in runs for t in r["after_s"])
        results[name] = {"tracked_objects": runs[0]["tracked"], "full_collection_ms_before": 1000 * before,
                         "full_collection_ms_after": 1000 * after, "ratio": after / before if before else None}
    return {"services": results, "rounds": rounds, "collections": collections,
            "skipped": skipped}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--collections", type=int, default=3)
    parser.add_argument("--out", type=Path, default=DEFAULT_OUTPUT)
    args = parser.parse_args()
    results = run(args.rounds, args.collections)
    print(f"{'service':<15} {'tracked':>9} {'full GC ms before':>18} {'after':>8} {'ratio':>7}")
    for name, r in results["services"].items():
        print(f"{name:<15} {r['tracked_objects']:>9} {r['full_collection_ms_before']:>18.1f} "
              f"{r['full_collection_ms_after']:>8.3f} {r['ratio']:>7.4f}")
    for name in results["skipped"]:
        print(f"{name:<15} skipped: its modules do not import here")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2))
    print(f"written to {args.out}")


if __name__ == "__main__":
    main()
