"""CPU cost of `PrefixIndex.match` and `apply` at fleet sizes the balancer routes over.

A fleet of `--nodes` nodes; prompts of 2k-8k tokens at block size 16
(128-512 blocks), of which `--shared` (70%) is one of `--groups` shared
system prompts and the rest unique. Each shared prompt is cached on a few
nodes, some of them only partly (evicted tails), and `--requests` earlier
prompts on the nodes that served them; then as many new prompts are
matched: each walks a long shared prefix, sees nodes drop out, and stops
at its unique tail. Measured in CPU time (`time.process_time`), best of `--repeat`:

* match: per call and per leading block walked;
* apply: one request's blocks stored on a node (a worker's KV event).

    python -m benchmarks.prefix_index_bench [--nodes 256] [--requests 2000] [--repeat 5]

Writes benchmarks/results/prefix_index_bench.json and prints the figures.
"""

from __future__ import annotations

import argparse
import json
import random
import time
from pathlib import Path

from shared.kv.prefix_index import PrefixIndex

BLOCK_SIZE = 16


class Workload:
    """The index as a running fleet would have it, and a source of new prompts (shared prefix, unique tail) to route."""

    def __init__(self, nodes: int, groups: int, history: int, shared: float, seed: int) -> None:
        self.rng = random.Random(seed)
        self.shared = shared
        self.node_ids = [f"n{i:03d}" for i in range(nodes)]
        longest = int(8192 // BLOCK_SIZE * shared)
        self.group_prefixes = [[self.rng.getrandbits(63) for _ in range(longest)] for _ in range(groups)]
        self.index = PrefixIndex(max_blocks=1_000_000)
        for prefix in self.group_prefixes:
            for node in self.rng.sample(self.node_ids, self.rng.randint(2, 8)):
                # Some holders have lost the prefix's tail to eviction.
                self.index.apply(node, stored=prefix[: self.rng.choice((len(prefix), len(prefix), len(prefix) // 2, len(prefix) // 4))])
        for prompt in self.prompts(history):  # earlier requests' prompts, each on the node that served it
            self.index.apply(self.rng.choice(self.node_ids), stored=prompt)

    def prompts(self, count: int) -> list[list[int]]:
        made = []
        for _ in range(count):
            blocks = self.rng.randint(2048, 8192) // BLOCK_SIZE
            shared_blocks = int(blocks * self.shared)
            made.append(self.rng.choice(self.group_prefixes)[:shared_blocks] + [self.rng.getrandbits(63) for _ in range(blocks - shared_blocks)])
        return made


def best_cpu_s(run, prepare, repeat: int) -> float:
    best = float("inf")
    for _ in range(repeat):
        argument = prepare()
        started = time.process_time()
        run(argument)
        best = min(best, time.process_time() - started)
    return best


def bench(nodes: int, groups: int, requests: int, shared: float, repeat: int, seed: int) -> dict:
    workload = Workload(nodes, groups, requests, shared, seed)
    index = workload.index
    queries = workload.prompts(requests)
    walked = sum(max(index.match(p).values(), default=0) for p in queries)
    holders = sum(len(index.match(p)) for p in queries)

    def match_all(prompts: list[list[int]]) -> None:
        for prompt in prompts:
            index.match(prompt)

    def apply_all(placed: list[tuple[str, list[int]]]) -> None:
        for node, prompt in placed:
            index.apply(node, stored=prompt)

    match_s = best_cpu_s(match_all, lambda: queries, repeat)
    # Each round stores new prompts (new tails), as a fleet's KV events do.
    apply_s = best_cpu_s(apply_all, lambda: [(workload.rng.choice(workload.node_ids), p) for p in workload.prompts(requests)], repeat)
    blocks = sum(len(p) for p in queries)
    return {
        "nodes": nodes, "groups": groups, "requests": requests, "shared": shared, "indexed_blocks": len(index),
        "mean_prompt_blocks": round(blocks / requests, 1), "mean_matched_blocks": round(walked / requests, 1),
        "mean_matching_nodes": round(holders / requests, 1),
        "match_us": round(match_s / requests * 1e6, 2), "match_ns_per_matched_block": round(match_s / max(1, walked) * 1e9, 1),
        "apply_us": round(apply_s / requests * 1e6, 2), "apply_ns_per_block": round(apply_s / blocks * 1e9, 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.prefix_index_bench")
    parser.add_argument("--nodes", type=int, default=256)
    parser.add_argument("--groups", type=int, default=64, help="distinct shared system prompts")
    parser.add_argument("--requests", type=int, default=2000, help="prompts indexed beforehand, and as many routed")
    parser.add_argument("--shared", type=float, default=0.7, help="share of each prompt that is a shared system prompt")
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--out", default="benchmarks/results/prefix_index_bench.json")
    args = parser.parse_args()
    result = bench(args.nodes, args.groups, args.requests, args.shared, args.repeat, args.seed)
    print(f"{result['nodes']} nodes, {result['indexed_blocks']} indexed blocks, prompts of {result['mean_prompt_blocks']} blocks "
          f"({result['mean_matched_blocks']} matched, on {result['mean_matching_nodes']} nodes): match {result['match_us']} us "
          f"({result['match_ns_per_matched_block']} ns per matched block), apply {result['apply_us']} us "
          f"({result['apply_ns_per_block']} ns per block)")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
