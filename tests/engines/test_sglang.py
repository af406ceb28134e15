"""SGLang's precomputed-embedding input, checked against the installed `sglang` package's own
functions (they import on a CPU; its engine does not run on one, see the README).

Skipped where `sglang` is not installed (it is not a test dependency: its wheels are CUDA
builds of several GB).
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from mmferry.engines.sglang import to_sglang
from tests.engines.cases import cases, items

sglang = pytest.importorskip("sglang")


def test_layout_is_what_sglang_validates_and_splits(models):
    from sglang.srt.models.qwen3_vl import Qwen3VLForConditionalGeneration
    from sglang.srt.multimodal.processors.base_processor import BaseMultimodalProcessor

    m = models["qwen3_vl"]
    case = cases(m.proc.config.factor)["images"]
    its = items(m.proc, case)
    outs = m.enc(its)
    text_ids = m.proc.tokenizer.encode(case.text)
    prompt = m.proc.expand_prompt(text_ids, its)
    req = to_sglang(prompt, its, outs)
    BaseMultimodalProcessor.validate_mm_data(image_data=req["image_data"])
    with pytest.raises(ValueError, match="exactly one item"):
        BaseMultimodalProcessor.validate_mm_data(image_data=req["image_data"] * 2)
    (entry,) = req["image_data"]
    pads = sum(t == m.proc.config.tokens.image for t in req["input_ids"])
    assert entry["feature"].shape[0] == pads
    assert entry["image_grid_thw"].tolist() == [list(it.grid_thw) for it in its]
    # SGLang's own split of the rows: main columns, then the deepstack levels.
    fake = SimpleNamespace(
        config=SimpleNamespace(hidden_size=m.enc.out_hidden_size),
        num_deepstack_embeddings=m.enc.num_deepstack,
    )
    main, deep = Qwen3VLForConditionalGeneration.separate_deepstack_embeds(fake, entry["feature"])
    assert torch.equal(main, torch.cat([o.embeds for o in outs]))
    want = torch.cat([torch.cat(o.deepstack, dim=-1) for o in outs])
    assert torch.equal(deep, want)
