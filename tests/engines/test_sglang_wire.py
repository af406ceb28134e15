"""The messages `mmferry.server.sglang_wire` writes (without SGLang installed), read by SGLang
0.5.23's own receiver code in its environment: its allow-list unpickler takes them, the rows
come back bit for bit in any float dtype, a request's parts (images, then a video with its
timestamps) fold into the grids and metadata its multimodal processor is handed, and the error
form carries its message and code. The state has the fields SGLang's own encoder pickles."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
import torch

from mmferry.server.sglang_wire import Part, error_message, rows_message
from tests.engines.sglang_harness import SGLANG_PYTHON, sglang_env

READER = Path(__file__).resolve().parent / "sglang_wire_reader.py"


def read_with_sglang(folder: Path, model_type: str) -> dict:
    if not SGLANG_PYTHON.is_file():
        pytest.fail(f"SGLang's environment is missing ({SGLANG_PYTHON}); run `make sglang-venv`")
    out = subprocess.run(
        [str(SGLANG_PYTHON), str(READER), str(folder), model_type],
        capture_output=True,
        text=True,
        env=sglang_env(),
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def write(folder: Path, n: int, frames: list) -> None:
    (folder / f"{n}.head").write_bytes(frames[0])
    if len(frames) > 1:
        (folder / f"{n}.rows").write_bytes(bytes(frames[1]))


DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def test_sglang_reads_images_and_a_video_in_two_parts(tmp_path):
    """One request per dtype (ids r0, r1, r2), each an image part and a video part, and a
    failed part; all read by one run of SGLang's code."""
    gen = torch.Generator().manual_seed(0)
    sent = {}
    n = 0
    for k, dtype in enumerate(DTYPES):
        images = torch.randn(6 + 4, 24, generator=gen).to(dtype)  # grids (1,4,6), (1,4,4)
        video = torch.randn(2 * 4, 24, generator=gen).to(dtype)  # grid (2,4,4)
        sent[f"r{k}"] = (images, video)
        part = Part(f"r{k}_local_part_0", 2, 0, "IMAGE")
        write(tmp_path, n, list(rows_message(part, images, [(1, 4, 6), (1, 4, 4)])))
        part = Part(f"r{k}_local_part_1", 2, 1, "VIDEO")
        frames = rows_message(
            part, video, [(2, 4, 4)], video_timestamps=[(0.25, 1.25)], second_per_grid_ts=[1.0]
        )
        write(tmp_path, n + 1, list(frames))
        n += 2
    write(tmp_path, n, [error_message(Part("bad_local_part_0", 1, 0, "IMAGE"), "no: why", 422)])
    got = read_with_sglang(tmp_path, "qwen3_vl")
    *parts, error = got["messages"]
    assert error["error_msg"] == "no: why" and error["error_code"] == 422
    assert "bad" not in got["aggregates"]
    for k, dtype in enumerate(DTYPES):
        first, second = parts[2 * k], parts[2 * k + 1]
        assert first["req_id"] == f"r{k}" and first["modality"] == "IMAGE"  # normalised
        assert first["dtype"] == str(dtype) and first["shape"] == [10, 24]
        assert second["modality"] == "VIDEO" and second["video_timestamps"] == [[0.25, 1.25]]
        agg = got["aggregates"][f"r{k}"]
        assert agg["ready"] and agg["shapes"] == {"IMAGE": [10, 24], "VIDEO": [8, 24]}
        images, video = sent[f"r{k}"]
        # Bit for bit: the sums of the rows as SGLang rebuilt them, in float64.
        assert agg["rows"]["IMAGE"] == images.double().sum().item()
        assert agg["rows"]["VIDEO"] == video.double().sum().item()
        meta = agg["meta"]
        assert meta["img_grid_thw"] == [[1, 4, 6], [1, 4, 4]]
        assert meta["video_grid_thw"] == [[2, 4, 4]]
        assert meta["video_timestamps"] == [[0.25, 1.25]] and meta["second_per_grid_ts"] == [1.0]
    # Every field SGLang's own encoder pickles is in mmferry's state, and nothing else.
    first = parts[0]
    assert set(got["sglang_state"]) - {"video_timestamps", "second_per_grid_ts"} == set(first)
