"""What inference engines take from mmferry: vLLM (`mmferry.engines.vllm`, its encoder-cache
connector in `mmferry.engines.vllm_connector`) and SGLang (`mmferry.engines.sglang`).

Neither engine is imported here or at mmferry's import time: each adapter builds plain tensors
and dicts in the engine's documented layout, and the connector imports vLLM only when vLLM
loads it.
"""

from __future__ import annotations

from mmferry.engines.rows import EngineItem, engine_items, packed_rows

__all__ = ["EngineItem", "engine_items", "packed_rows"]
