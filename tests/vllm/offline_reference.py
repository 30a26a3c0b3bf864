"""vLLM's own offline engine (`LLM.generate`) on given prompt token ids: the reference output.

Run as a subprocess (keeps the engine's memory out of the test process):
    python -m tests.vllm.offline_reference < request.json > outputs.json
The request is {"engine_args": {...}, "prompts": [[ids...]...], "max_tokens": N};
the output is a list of {"text", "token_ids", "finish_reason"}, one per prompt.
"""

from __future__ import annotations

import json
import sys


def main() -> None:
    request = json.load(sys.stdin)
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    from services.worker.amx import request_amx_permission

    request_amx_permission()
    llm = LLM(**request["engine_args"])
    params = SamplingParams(temperature=0.0, max_tokens=request["max_tokens"])
    outputs = []
    # One prompt at a time, as the tests send them: the same batch shapes,
    # so the same kernels and the same floating-point results.
    for ids in request["prompts"]:
        (result,) = llm.generate([TokensPrompt(prompt_token_ids=ids)], params, use_tqdm=False)
        completion = result.outputs[0]
        outputs.append({"text": completion.text, "token_ids": list(completion.token_ids),
                        "finish_reason": completion.finish_reason})
    print("REFERENCE " + json.dumps(outputs), flush=True)


if __name__ == "__main__":  # vLLM's engine starts subprocesses that re-import this module
    main()
