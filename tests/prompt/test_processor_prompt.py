"""`Processor.expand_prompt` picks the mRoPE rule; a missing tokenizer names the processor."""

from __future__ import annotations

import pytest
import torch
from prompt_helpers import TOK, make_item

import mmferry

VS, VE, VID = TOK.vision_start, TOK.vision_end, TOK.video


@pytest.mark.parametrize("name", ["qwen2.5-vl", "qwen2-vl"])
def test_missing_tokenizer_names_the_processors_family(name):
    proc = mmferry.Processor.for_model(name)
    with pytest.raises(ValueError, match=f"this {name} Processor has no tokenizer") as err:
        proc.tokenizer  # noqa: B018
    assert "Qwen3" not in str(err.value)


def test_expand_prompt_takes_the_mrope_rule(hf_rope):
    proc = mmferry.Processor.for_model("qwen2.5-vl")
    # 4 temporal patches at 1 s each and 2 tokens/s: time outruns the 1x2 spatial grid.
    video = make_item("video", (4, 2, 4), second_per_grid_t=1.0)
    ids = [1, VS, VID, VE, 2, 3]
    spatial = proc.expand_prompt(ids, [video], mrope_advance="spatial")
    want, want_delta = hf_rope("qwen2_5_vl")(
        spatial.input_ids, video_grids=[(4, 2, 4)], second_per_grid_ts=[1.0]
    )
    assert torch.equal(spatial.positions, want) and spatial.mrope_delta == want_delta
    extent = proc.expand_prompt(ids, [video])  # the default keeps the trained rule
    assert not torch.equal(extent.positions, want)
    assert extent.positions[0, -3].item() == int(extent.positions[:, :-3].max()) + 1
