from __future__ import annotations

import re
from pathlib import Path

README = Path(__file__).resolve().parent.parent / "README.md"


def test_quick_start_runs():
    """The README's checkpoint-free quick start runs as written (a stale README fails here)."""
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)
    blocks = [b for b in blocks if "VisionEncoder.random" in b]
    assert blocks, "README has no python quick start"
    scope: dict = {}
    exec(compile(blocks[0], "README.md", "exec"), scope)
    merged, prompt = scope["merged"], scope["prompt"]
    assert merged.inputs_embeds.shape[0] == len(prompt.input_ids)
    assert len(merged.deepstack) == scope["enc"].num_deepstack == 3
