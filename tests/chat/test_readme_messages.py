"""The README's chat-messages quick start runs as written on a tiny checkpoint folder."""

from __future__ import annotations

import json
import re
from pathlib import Path

from mmferry.testing.checkpoints import save_tiny_checkpoint
from tests.chat.conftest import QWEN3_TEMPLATE, _configs
from tests.chat.oracle import build_tokenizer, write_json

README = Path(__file__).resolve().parents[2] / "README.md"


def test_messages_quick_start_runs(tmp_path):
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)
    block = next(b for b in blocks if "apply_chat_template" in b)
    # A folder as a real checkpoint has it: weights, tokenizer, template, processor configs,
    # with the config's vision token ids those of the tokenizer.
    save_tiny_checkpoint("qwen3_vl", tmp_path)
    ids = build_tokenizer(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    config.update(
        image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"],
    )
    write_json(tmp_path / "config.json", config)
    image, video, _ = _configs("qwen3_vl")
    write_json(tmp_path / "preprocessor_config.json", image)
    write_json(tmp_path / "video_preprocessor_config.json", video)
    (tmp_path / "chat_template.jinja").write_text(QWEN3_TEMPLATE)

    scope: dict = {"model_dir": str(tmp_path)}
    exec(compile(block, "README.md", "exec"), scope)
    merged, prompt, items = scope["merged"], scope["prompt"], scope["items"]
    assert len(items) == 2 and [it.modality for it in items] == ["image", "image"]
    assert merged.inputs_embeds.shape[0] == len(prompt.input_ids)
    pads = sum(1 for t in prompt.input_ids if t == ids["<|image_pad|>"])
    assert pads == sum(it.num_tokens for it in items)
    # Every vision row landed: the text rows were zero, the vision rows are the tower's.
    filled = int(merged.inputs_embeds.abs().sum(-1).gt(0).sum())
    assert filled == pads
