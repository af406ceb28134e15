"""End to end: a tiny synthetic video file -> Processor.video -> expand_prompt, compared with
transformers' processors expanding the same video (frames sampled by the documented rule) and with
its `get_rope_index`."""

from __future__ import annotations

import av
import numpy as np
import pytest
import torch
from prompt_helpers import TOK, hf_processor, hf_timestamps

import mmferry

TOTAL, RATE, HEIGHT, WIDTH = 30, 10, 64, 96


@pytest.fixture(scope="module")
def video_path(tmp_path_factory):
    path = tmp_path_factory.mktemp("video") / "clip.mp4"
    rng = np.random.default_rng(0)
    with av.open(str(path), "w") as container:
        stream = container.add_stream("mpeg4", rate=RATE)
        stream.width, stream.height, stream.pix_fmt = WIDTH, HEIGHT, "yuv420p"
        for _ in range(TOTAL):
            rgb = rng.integers(0, 256, (HEIGHT, WIDTH, 3), dtype=np.uint8)
            container.mux(stream.encode(av.VideoFrame.from_ndarray(rgb, format="rgb24")))
        container.mux(stream.encode())
    return path


PROMPT = "describe <|vision_start|><|video_pad|><|vision_end|> the video ?"


def test_qwen3_video_file_to_expanded_prompt(video_path, tokenizer_json, hf_tokenizer, hf_rope):
    proc = mmferry.Processor.for_model("qwen3-vl", tokenizer=tokenizer_json)
    item = proc.video(video_path)
    # transformers' Qwen3-VL sampling rule (2 fps, at least 4 frames), as documented.
    n = min(max(int(TOTAL / RATE * 2.0), 4), TOTAL)
    indices = np.linspace(0, TOTAL - 1, n).round().astype(int).tolist()
    assert item.timestamps == pytest.approx(hf_timestamps(indices, RATE))

    ids = hf_tokenizer(PROMPT, add_special_tokens=False)["input_ids"]
    out = proc.expand_prompt(ids, [item])
    want = hf_processor("qwen3_vl", hf_tokenizer, [(item.grid_thw, indices, float(RATE))])(
        text=[PROMPT], videos=[np.zeros((n, 8, 8, 3), np.uint8)], return_tensors="pt"
    )
    assert out.input_ids == want["input_ids"][0].tolist()
    assert len(out.offsets[0]) == item.grid_thw[0]
    for s, e in out.offsets[0]:
        assert set(out.input_ids[s:e]) == {TOK.video} and e - s == item.tokens_per_frame
    pos, delta = hf_rope("qwen3_vl")(out.input_ids, video_grids=[item.grid_thw])
    assert torch.equal(out.positions, pos) and out.mrope_delta == delta


def test_qwen2_5_video_file_to_expanded_prompt(video_path, hf_tokenizer, hf_rope):
    proc = mmferry.Processor.for_model("qwen2.5-vl")
    item = proc.video(video_path)
    assert item.second_per_grid_t is not None
    ids = hf_tokenizer(PROMPT, add_special_tokens=False)["input_ids"]
    out = proc.expand_prompt(ids, [item])
    want = hf_processor("qwen2_5_vl", hf_tokenizer, [(item.grid_thw, [0], float(RATE))])(
        text=[PROMPT], videos=[np.zeros((4, 8, 8, 3), np.uint8)], return_tensors="pt"
    )
    assert out.input_ids == want["input_ids"][0].tolist()
    assert out.offsets == [[(2, 2 + item.num_tokens)]]
    spgt = [item.second_per_grid_t]
    pos, delta = hf_rope("qwen2_5_vl")(
        out.input_ids, video_grids=[item.grid_thw], second_per_grid_ts=spgt
    )
    # This clip's time span (t=3) stays inside its spatial extent, so both mRoPE rules agree.
    assert torch.equal(out.positions, pos) and out.mrope_delta == delta
