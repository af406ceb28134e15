"""Builders for tests of code that uses mmferry, as `torch.testing` is for torch.

mmferry's own tests and benchmarks use these, and an engine embedding mmferry can use them in
its tests too:
- `save_tiny_checkpoint(model_type, path)`: a tiny Qwen-VL checkpoint saved by transformers
  (the oracle), with transformers' vision model of the same weights;
- `hf_config`, `tiny_text`, `hf_vision`: the configs behind it, for checkpoints of other sizes;
- `tiny_base_model(model_type)`: a tiny transformers base model (its `get_rope_index` is the
  mRoPE reference); `small_patch_qwen3()`: a tiny Qwen3-VL tower with small grids;
- `compact_to_hf(item, cfg)`: a compact-u8 item's rows in the hf layout.
The checkpoint builders need transformers (`pip install 'mmferry[testing]'`), imported when
first called.
"""

from __future__ import annotations

from mmferry._exports import lazy_exports

_EXPORTS: dict[str, str] = {
    "HF_CLASSES": "mmferry.testing.checkpoints",
    "TOKENS": "mmferry.testing.checkpoints",
    "hf_config": "mmferry.testing.checkpoints",
    "hf_vision": "mmferry.testing.checkpoints",
    "save_perturbed": "mmferry.testing.checkpoints",
    "save_tiny_checkpoint": "mmferry.testing.checkpoints",
    "small_patch_qwen3": "mmferry.testing.checkpoints",
    "tiny_base_model": "mmferry.testing.checkpoints",
    "tiny_text": "mmferry.testing.checkpoints",
    "compact_to_hf": "mmferry.testing.layouts",
}

__all__ = list(_EXPORTS)
__getattr__ = lazy_exports(__name__, _EXPORTS)
