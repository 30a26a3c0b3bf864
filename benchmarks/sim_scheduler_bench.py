"""Micro-benchmark: how fast one SimScheduler simulates a fixed offline workload.

The sim engine stands in for GPUs in fleet benchmarks of up to 256 nodes,
so the scheduler's own CPU cost per step bounds how large and how fast a
simulated fleet can be. The workload: 2000 requests of 512 prompt tokens
(16 shared 384-token system prompts + 128 tokens of their own) and 128
output tokens, all queued at once, max_num_seqs 256.

    python benchmarks/sim_scheduler_bench.py [results.json]
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import sys
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:  # run as a plain script from anywhere
    sys.path.insert(0, str(REPO_ROOT))

from services.worker.sim import SimRequest, SimScheduler, get_profile  # noqa: E402

DEFAULT_OUTPUT = REPO_ROOT / "benchmarks" / "results" / "sim_scheduler.json"


def build_workload(args: argparse.Namespace) -> list[SimRequest]:
    rng = random.Random(args.seed)
    vocab = 32000
    system_prompts = [[rng.randrange(vocab) for _ in range(args.shared_prefix)] for _ in range(args.prefixes)]
    own_tokens = args.prompt_tokens - args.shared_prefix
    return [
        SimRequest(
            request_id=f"req-{i}",
            prompt_token_ids=system_prompts[i % args.prefixes] + [rng.randrange(vocab) for _ in range(own_tokens)],
            max_tokens=args.output_tokens,
            seed=i,
        )
        for i in range(args.requests)
    ]


def run(args: argparse.Namespace) -> dict:
    profile = get_profile(args.profile)
    workload = build_workload(args)
    scheduler = SimScheduler(
        num_blocks=args.num_blocks,
        block_size=args.block_size,
        max_num_seqs=args.max_num_seqs,
        max_batched_tokens=args.max_batched_tokens,
        profile=profile,
        output_token_range=(16, 32000),
    )
    started = time.perf_counter()
    for request in workload:
        scheduler.add(request)
    added = time.perf_counter()
    simulated_s = 0.0
    output_tokens = 0
    steps = 0
    while scheduler.has_work():
        outcome = scheduler.step()
        simulated_s += outcome.duration_s
        output_tokens += len(outcome.emitted)
        steps += 1
    finished = time.perf_counter()

    stats = scheduler.stats()
    wall_s = finished - started
    step_wall_s = finished - added
    return {
        "workload": {
            "requests": args.requests,
            "prompt_tokens": args.prompt_tokens,
            "shared_prefix_tokens": args.shared_prefix,
            "distinct_prefixes": args.prefixes,
            "output_tokens": args.output_tokens,
        },
        "scheduler": {
            "num_blocks": args.num_blocks,
            "block_size": args.block_size,
            "max_num_seqs": args.max_num_seqs,
            "max_batched_tokens": args.max_batched_tokens,
            "profile": profile.name,
        },
        "steps": steps,
        "wall_s": round(wall_s, 4),
        "add_wall_s": round(added - started, 4),
        "steps_per_s": round(steps / step_wall_s, 1),
        "wall_us_per_step": round(step_wall_s / steps * 1e6, 1),
        "output_tokens": output_tokens,
        "sim_tokens_per_wall_s": round(output_tokens / step_wall_s, 1),
        "simulated_s": round(simulated_s, 4),
        "simulated_tokens_per_s": round(output_tokens / simulated_s, 1) if simulated_s else None,
        "speedup_vs_real_time": round(simulated_s / wall_s, 2),
        "prefix_hit_rate": round(stats.prefix_hit_tokens / stats.prefix_query_tokens, 4),
        "preemptions": stats.preemptions,
        "python": platform.python_version(),
    }


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("output", nargs="?", type=Path, default=DEFAULT_OUTPUT, help="JSON results path")
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--prompt-tokens", type=int, default=512)
    parser.add_argument("--shared-prefix", type=int, default=384)
    parser.add_argument("--prefixes", type=int, default=16)
    parser.add_argument("--output-tokens", type=int, default=128)
    parser.add_argument("--num-blocks", type=int, default=16384)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--max-batched-tokens", type=int, default=8192)
    parser.add_argument("--profile", default="h100-80g-llama3-8b")
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    result = run(args)
    print(
        f"{result['steps']} steps in {result['wall_s']:.2f} s wall: {result['steps_per_s']:.0f} steps/s "
        f"({result['wall_us_per_step']:.0f} us/step), {result['sim_tokens_per_wall_s']:.0f} simulated tokens "
        f"per wall second; simulated {result['simulated_s']:.2f} s of GPU time "
        f"({result['simulated_tokens_per_s']} tokens/s on {args.profile}, "
        f"{result['speedup_vs_real_time']}x real time); prefix hit rate {result['prefix_hit_rate']:.1%}, "
        f"{result['preemptions']} preemptions"
    )
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
