"""Runs inside vLLM's environment: one `LLM` engine, requests from stdin, results on stdout.

    python vllm_driver.py MODEL_DIR '{"enable_mm_embeds": true, ...}'

Each stdin line names a file written by `torch.save` holding {"requests": [...], "tokens": n}
(each request a vLLM prompt dict); the answer is one JSON line: per request the greedy tokens
and, for every step, the top-5 (token id, logprob) pairs, or {"error": ...}. The test process
(mmferry's environment) writes the requests, with mmferry's embeddings in them.
"""

from __future__ import annotations

import json
import sys
import traceback

READY = "vllm-driver: ready"


def _steps(logprobs) -> list[list[tuple[int, float]]]:
    out = []
    for step in logprobs:
        top = sorted(step.items(), key=lambda kv: kv[1].rank)[:5]
        out.append([(int(tok), float(lp.logprob)) for tok, lp in top])
    return out


def main() -> None:
    import torch
    from vllm import LLM, SamplingParams

    model, options = sys.argv[1], json.loads(sys.argv[2])
    llm = LLM(model=model, **options)
    print(READY, flush=True)
    for line in sys.stdin:
        job = torch.load(line.strip(), weights_only=False)
        params = SamplingParams(
            temperature=0.0, max_tokens=job["tokens"], logprobs=5, detokenize=False
        )
        try:
            outs = llm.generate(job["requests"], params, use_tqdm=False)
            answer = [
                {
                    "tokens": list(o.outputs[0].token_ids),
                    "top5": _steps(o.outputs[0].logprobs or []),
                    "finish": o.outputs[0].finish_reason,
                }
                for o in outs
            ]
        except Exception as e:  # noqa: BLE001 - reported to the test, which decides
            answer = {"error": f"{type(e).__name__}: {e}", "trace": traceback.format_exc()}
        print(json.dumps(answer), flush=True)


if __name__ == "__main__":
    main()
