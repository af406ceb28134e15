"""`Processor`: a family's preprocessing settings plus the tokenizer, the user-facing front door."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from mmferry.config import ProcessorConfig
from mmferry.items import Layout, MultimodalItem
from mmferry.models import load_model_config, preset, spec_for

if TYPE_CHECKING:
    from mmferry.prompt.expand import ExpandedPrompt
    from mmferry.prompt.mrope import Advance
    from mmferry.prompt.tokenizer import TimestampTokenizer


class Processor:
    """Turns images, videos and prompts into `MultimodalItem`s and expanded token ids."""

    def __init__(
        self, config: ProcessorConfig, tokenizer: TimestampTokenizer | str | Path | None = None
    ) -> None:
        spec_for(config.family)  # a clear error now for an unknown family, not at first use
        self.config = config
        self._tokenizer = tokenizer

    @classmethod
    def for_model(cls, name: str, **overrides: Any) -> Processor:
        """A preset equal to the public checkpoint's defaults ("qwen3-vl", "qwen2.5-vl", ...)."""
        tokenizer = overrides.pop("tokenizer", None)
        return cls(preset(name).replace(**overrides), tokenizer)

    @classmethod
    def from_pretrained(cls, model_dir: str | Path, **overrides: Any) -> Processor:
        """Read a local checkpoint folder's config.json, preprocessor configs and tokenizer.json."""
        root = Path(model_dir)
        tokenizer = overrides.pop("tokenizer", None)
        if tokenizer is None and (root / "tokenizer.json").is_file():
            tokenizer = root / "tokenizer.json"
        return cls(load_model_config(root).processor.replace(**overrides), tokenizer)

    @property
    def has_tokenizer(self) -> bool:
        return self._tokenizer is not None

    @property
    def tokenizer(self) -> TimestampTokenizer:
        from mmferry.prompt.tokenizer import load_tokenizer

        if self._tokenizer is None:
            # Named by the preset users type for this family, so the message fits the model.
            name = spec_for(self.config.family).preset_name
            raise ValueError(
                f"this {name} Processor has no tokenizer; pass `tokenizer=` (a path to "
                "tokenizer.json, a `tokenizers.Tokenizer` or a transformers tokenizer) or use "
                "Processor.from_pretrained on a folder that holds tokenizer.json"
            )
        self._tokenizer = load_tokenizer(self._tokenizer)
        return self._tokenizer

    def image(
        self, source: Any, layout: Layout = "hf", *, threads: int | None = None
    ) -> MultimodalItem:
        """Decode, resize and patchify one image (`threads`: see preprocess/threads.py)."""
        from mmferry.preprocess.image import process_image

        return process_image(source, self.config, layout=layout, threads=threads)

    def video(
        self,
        source: Any,
        layout: Layout = "hf",
        *,
        fps: float | None = None,
        num_frames: int | None = None,
        source_fps: float | None = None,
        threads: int | None = None,
    ) -> MultimodalItem:
        """Decode (or take frames), sample, resize and patchify one video."""
        from mmferry.preprocess.video import process_video

        return process_video(
            source,
            self.config,
            layout=layout,
            fps=fps,
            num_frames=num_frames,
            source_fps=source_fps,
            threads=threads,
        )

    def expand_prompt(
        self,
        input_ids: Sequence[int],
        items: Sequence[MultimodalItem],
        *,
        mrope_advance: Advance = "extent",
    ) -> ExpandedPrompt:
        """Expand each placeholder to its tokens; offsets and mRoPE positions.

        `mrope_advance="spatial"` reproduces transformers 5.x positions after Qwen2/2.5-VL
        videos (see `mmferry.prompt.mrope`)."""
        from mmferry.prompt.expand import expand_prompt

        needs_text = spec_for(self.config.family).timestamps_in_prompt and any(
            it.modality == "video" for it in items
        )
        return expand_prompt(
            input_ids,
            items,
            self.config,
            tokenizer=self.tokenizer if needs_text else None,
            mrope_advance=mrope_advance,
        )
