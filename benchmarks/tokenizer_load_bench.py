"""What tokenizing a vLLM model costs ingress: kvlane's HfTokenizer against transformers' AutoTokenizer.

Each side runs in a fresh process, alternately, `--rounds` times: load the
model directory's tokenizer, render a chat prompt and encode it. Reported per
side: CPU seconds, wall seconds and peak RSS of the whole process (imports
included, since a process pays them once, on its first request), and whether
torch ended up imported. The model is kvlane's tiny test model unless
`--model-dir` names another (it needs transformers to be built).

    python benchmarks/tokenizer_load_bench.py [--model-dir DIR] [--rounds N] [--out results.json]
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

DEFAULT_OUTPUT = REPO_ROOT / "benchmarks" / "results" / "tokenizer_load.json"

_PROBE = """
import json, resource, sys, time
cpu, wall = time.process_time(), time.monotonic()
directory, side = sys.argv[1], sys.argv[2]
turns = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello there, how are you?"}]
if side == "kvlane":
    from contracts.openai_api import ChatMessage
    from shared.tokenizer_spec import load_tokenizer
    tokenizer = load_tokenizer("hf:" + directory)
    ids = tokenizer.encode(tokenizer.apply_chat_template([ChatMessage(**t) for t in turns]))
else:
    from transformers import AutoTokenizer
    tokenizer = AutoTokenizer.from_pretrained(directory, local_files_only=True)
    ids = tokenizer.encode(tokenizer.apply_chat_template(turns, tokenize=False, add_generation_prompt=True),
                           add_special_tokens=False)
print(json.dumps({"cpu_s": time.process_time() - cpu, "wall_s": time.monotonic() - wall,
                  "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
                  "torch_imported": "torch" in sys.modules, "prompt_tokens": len(ids)}))
"""


def probe(side: str, directory: Path) -> dict:
    result = subprocess.run([sys.executable, "-c", _PROBE, str(directory), side], cwd=REPO_ROOT,
                            capture_output=True, text=True, timeout=300, check=True)
    return json.loads(result.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-dir", type=Path, help="a Hugging Face model directory (default: the tiny test model)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", type=Path, default=DEFAULT_OUTPUT)
    args = parser.parse_args(argv)
    if args.model_dir is None:
        from launch.tiny_model import default_cache_dir, ensure_tiny_model

        args.model_dir = ensure_tiny_model(default_cache_dir())
    runs: dict[str, list[dict]] = {"kvlane": [], "transformers": []}
    for _ in range(args.rounds):
        for side in runs:
            runs[side].append(probe(side, args.model_dir))
    summary = {
        side: {
            "cpu_s_median": statistics.median(r["cpu_s"] for r in results),
            "wall_s_median": statistics.median(r["wall_s"] for r in results),
            "peak_rss_mib_median": statistics.median(r["peak_rss_mib"] for r in results),
            "torch_imported": any(r["torch_imported"] for r in results),
            "runs": results,
        }
        for side, results in runs.items()
    }
    assert len({r["prompt_tokens"] for results in runs.values() for r in results}) == 1, "the sides tokenized differently"
    ours, theirs = summary["kvlane"], summary["transformers"]
    summary["cpu_ratio"] = ours["cpu_s_median"] / theirs["cpu_s_median"]
    summary["rss_ratio"] = ours["peak_rss_mib_median"] / theirs["peak_rss_mib_median"]
    summary["model_dir"] = str(args.model_dir)
    for side, row in (("kvlane", ours), ("transformers", theirs)):
        print(f"{side:<13} cpu {row['cpu_s_median']:.2f} s  wall {row['wall_s_median']:.2f} s  "
              f"peak RSS {row['peak_rss_mib_median']:.0f} MiB  torch imported: {row['torch_imported']}")
    print(f"kvlane / transformers: cpu {summary['cpu_ratio']:.3f}x, peak RSS {summary['rss_ratio']:.3f}x")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(summary, indent=2))
    print(f"written to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
