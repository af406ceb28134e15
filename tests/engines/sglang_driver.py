"""Runs inside SGLang's environment: one `sglang.Engine` on the CPU, requests from stdin, results
on stdout.

    SGLANG_USE_CPU_ENGINE=1 PYTHONPATH=tests/engines/sglang_shim \
        python sglang_driver.py MODEL_DIR '{"dtype": "float32", ...}'

Each stdin line names a file written by `torch.save` holding {"requests": [...], "tokens": n},
each request the keyword arguments of `Engine.generate` (`input_ids` or `prompt`, `image_data`,
`video_data`); the answer is one JSON line: per request the greedy tokens and, for every step,
the top-5 (token id, logprob) pairs, or {"error": ...} for the first request SGLang refused
(then also "alive": whether the engine still answers). Requests run one at a time, so a refusal
names its request.

With MMFERRY_SGLANG_TOWER_DUMP=DIR every call of SGLang's Qwen-VL `get_image_feature` /
`get_video_feature` (its vision tower on pixels) saves the items' grids and the tower's output
to DIR, for the test to hold against mmferry's tower. The scheduler runs in a process spawned
from this file, which re-imports it there, so the recording is installed at import.
"""

from __future__ import annotations

import itertools
import json
import os
import sys
import time
import traceback
from pathlib import Path

READY = "sglang-driver: ready"
DUMP = os.environ.get("MMFERRY_SGLANG_TOWER_DUMP")


def _record_tower(folder: Path) -> None:
    from sglang.srt.models import qwen2_5_vl, qwen3_vl

    counter = itertools.count()
    for cls in (
        qwen2_5_vl.Qwen2_5_VLForConditionalGeneration,
        qwen3_vl.Qwen3VLForConditionalGeneration,
    ):
        for modality in ("image", "video"):
            name = f"get_{modality}_feature"
            setattr(cls, name, _recording(getattr(cls, name), modality, folder, counter))


def _recording(tower, modality: str, folder: Path, counter):
    import torch

    def recorded(self, items):
        out = tower(self, items)
        grids = torch.cat([getattr(it, f"{modality}_grid_thw") for it in items])
        record = {"modality": modality, "grids": grids.tolist(), "rows": out.float()}
        torch.save(record, folder / f"{os.getpid()}-{next(counter)}.pt")
        return out

    return recorded


if DUMP:
    _record_tower(Path(DUMP))


def _steps(meta: dict) -> list[list[tuple[int, float]]]:
    out = []
    for step in meta["output_top_logprobs"]:
        top = sorted(step, key=lambda e: -e[0])[:5]  # (logprob, token id, text)
        out.append([(int(tok), float(lp)) for lp, tok, *_ in top])
    return out


def _alive(engine) -> bool:
    try:
        engine.generate(input_ids=[1, 2, 3], sampling_params={"max_new_tokens": 1})
        return True
    except Exception:  # noqa: BLE001 - any failure means the engine is gone
        return False


def main() -> None:
    import sglang as sgl
    import torch

    model, options = sys.argv[1], json.loads(sys.argv[2])
    started = time.monotonic()
    engine = sgl.Engine(model_path=model, **options)
    print(f"{READY} in {time.monotonic() - started:.1f} s", flush=True)
    try:
        for line in sys.stdin:
            job = torch.load(line.strip(), weights_only=False)
            params = {"temperature": 0.0, "max_new_tokens": job["tokens"], "ignore_eos": True}
            answer: list | dict = []
            for k, req in enumerate(job["requests"]):
                try:
                    out = engine.generate(
                        **req, sampling_params=params, return_logprob=True, top_logprobs_num=5
                    )
                    meta = out["meta_info"]
                    answer.append({"tokens": list(out["output_ids"]), "top5": _steps(meta)})
                except Exception as e:  # noqa: BLE001 - reported to the test, which decides
                    answer = {
                        "error": f"{type(e).__name__}: {e}",
                        "request": k,
                        "trace": traceback.format_exc(),
                        "alive": _alive(engine),
                    }
                    break
            print(json.dumps(answer), flush=True)
    finally:
        engine.shutdown()


if __name__ == "__main__":
    main()
