"""`Processor`: a family's preprocessing settings plus the tokenizer, the user-facing front door."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from mmferry.config import ProcessorConfig
from mmferry.items import Layout, MultimodalItem
from mmferry.models import load_model_config, preset, spec_for

if TYPE_CHECKING:
    from mmferry.chat.apply import ChatPrompt
    from mmferry.chat.parts import SourcePolicy
    from mmferry.models.generic import GenericProcessor
    from mmferry.prompt.expand import ExpandedPrompt
    from mmferry.prompt.mrope import Advance
    from mmferry.prompt.tokenizer import TimestampTokenizer
    from mmferry.prompt.wrapper import VideoWrapper


class Processor:
    """Turns images, videos and prompts into `MultimodalItem`s and expanded token ids."""

    def __init__(
        self,
        config: ProcessorConfig,
        tokenizer: TimestampTokenizer | str | Path | None = None,
        *,
        chat_template: str | dict[str, str] | None = None,
        model_dir: str | Path | None = None,
    ) -> None:
        spec_for(config.family)  # a clear error now for an unknown family, not at first use
        self.config = config
        self._tokenizer = tokenizer
        # The folder the chat template and special tokens are read from, when first needed.
        self.model_dir = None if model_dir is None else Path(model_dir)
        self._chat_template = chat_template

    # The item layouts this processor gives, the default first.
    layouts: tuple[str, ...] = ("compact-u8", "hf")
    # A native spec's processor: its resize rules, per-item keys, videos and store keys are
    # mmferry's own.
    native: bool = True

    @property
    def family(self) -> str:
        return self.config.family

    @classmethod
    def for_model(cls, name: str, **overrides: Any) -> Processor:
        """A preset equal to the public checkpoint's defaults ("qwen3-vl", "qwen2.5-vl", ...).

        `overrides`: processor options as transformers spells them or `ProcessorConfig` fields
        (see `mmferry.chat.options`), plus `tokenizer=` and `chat_template=`."""
        from mmferry.chat.options import apply_options

        tokenizer = overrides.pop("tokenizer", None)
        template = overrides.pop("chat_template", None)
        return cls(apply_options(preset(name), overrides), tokenizer, chat_template=template)

    @classmethod
    def from_pretrained(
        cls, model_dir: str | Path, *, family: str | None = None, **overrides: Any
    ) -> Processor | GenericProcessor:
        """Read a local checkpoint folder's config.json, preprocessor configs and tokenizer.json
        (the chat template too, when first used); `overrides` as in `for_model`.

        A checkpoint without a native spec, or `family="generic"`, gets a `GenericProcessor`
        (the folder's own transformers processor; `overrides` go to each of its calls)."""
        from mmferry.chat.options import apply_options
        from mmferry.models.generic import GenericProcessor, uses_generic

        root = Path(model_dir)
        if uses_generic(root, family):
            return GenericProcessor.from_pretrained(root, **overrides)
        tokenizer = overrides.pop("tokenizer", None)
        template = overrides.pop("chat_template", None)
        if tokenizer is None and (root / "tokenizer.json").is_file():
            tokenizer = root / "tokenizer.json"
        config = apply_options(load_model_config(root).processor, overrides)
        return cls(config, tokenizer, chat_template=template, model_dir=root)

    def with_options(self, options: dict[str, Any]) -> Processor:
        """This processor with processor options applied (same tokenizer and template)."""
        from mmferry.chat.options import apply_options

        out = Processor(apply_options(self.config, options), self._tokenizer)
        out.model_dir, out._chat_template = self.model_dir, self._chat_template
        return out

    @property
    def chat_template(self) -> str | dict[str, str] | None:
        """The chat template (a dict when the checkpoint names several); None if unknown."""
        if self._chat_template is None and self.model_dir is not None:
            from mmferry.chat.template import find_chat_template

            self._chat_template = find_chat_template(self.model_dir)
        return self._chat_template

    @property
    def special_tokens(self) -> dict[str, str]:
        """The special-token strings templates may use (`eos_token`, ...)."""
        from mmferry.chat.template import special_tokens

        return special_tokens(self.model_dir)

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

    def images(
        self,
        sources: Sequence[Any],
        *,
        layout: Layout = "hf",
        threads: int | None = None,
        partial: bool = False,
    ) -> list[Any]:
        """Many images in parallel on up to `threads` threads (default: the cores), in input
        order; errors name the item's index. With `partial=True`, a failed item's place holds
        its `ItemError` and the others are still returned (see preprocess/batch.py)."""
        from mmferry.preprocess.batch import ImagePart, process_batch

        parts = [ImagePart(s) for s in sources]
        return process_batch(parts, self.config, layout=layout, threads=threads, partial=partial)

    def items(
        self,
        parts: Sequence[Any],
        *,
        layout: Layout = "hf",
        threads: int | None = None,
        partial: bool = False,
    ) -> list[Any]:
        """`images` for a mix of `ImagePart`s and `VideoPart`s (a bare source is an image)."""
        from mmferry.preprocess.batch import ImagePart, VideoPart, process_batch

        wrapped = [p if isinstance(p, (ImagePart, VideoPart)) else ImagePart(p) for p in parts]
        return process_batch(wrapped, self.config, layout=layout, threads=threads, partial=partial)

    def apply_chat_template(
        self,
        messages: Sequence[Mapping[str, Any]],
        chat_template: str | None = None,
        tools: Sequence[Mapping[str, Any]] | None = None,
        documents: Sequence[Mapping[str, Any]] | None = None,
        add_generation_prompt: bool = False,
        continue_final_message: bool | str = False,
        tokenize: bool = False,
        return_dict: bool = False,
        processor_kwargs: Mapping[str, Any] | None = None,
        *,
        layout: Layout = "hf",
        sources: SourcePolicy | None = None,
        mrope_advance: Advance = "extent",
        video_wrapper: VideoWrapper = "auto",
        threads: int | None = None,
        **template_kwargs: Any,
    ) -> str | list[int] | ChatPrompt:
        """transformers' `apply_chat_template`, same parameters and defaults: the rendered text;
        with `tokenize=True` the expanded ids; with `return_dict=True` too, a `ChatPrompt`
        (text, expanded prompt, items). `sources` says what parts may read (default: the
        paths named, no network); bad messages raise one ValueError naming message and part.
        The media are preprocessed in parallel on up to `threads` threads (as `images`)."""
        from mmferry.chat.apply import apply_chat_template
        from mmferry.chat.parts import LIBRARY_POLICY

        return apply_chat_template(
            self,
            messages,
            chat_template,
            tools,
            documents,
            add_generation_prompt,
            continue_final_message,
            tokenize,
            return_dict,
            processor_kwargs,
            layout=layout,
            sources=sources or LIBRARY_POLICY,
            mrope_advance=mrope_advance,
            video_wrapper=video_wrapper,
            threads=threads,
            **template_kwargs,
        )

    def expand_prompt(
        self,
        input_ids: Sequence[int],
        items: Sequence[MultimodalItem],
        *,
        mrope_advance: Advance = "extent",
        video_wrapper: VideoWrapper = "auto",
    ) -> ExpandedPrompt:
        """Expand each placeholder to its tokens; offsets and mRoPE positions.

        `mrope_advance="spatial"` reproduces transformers 5.x positions after Qwen2/2.5-VL
        videos (see `mmferry.prompt.mrope`). `video_wrapper` says whether a Qwen3-family video
        keeps the template's outer `<|vision_start|>`/`<|vision_end|>`: "auto" (the installed
        transformers' form), "keep" or "drop" (see `mmferry.prompt.wrapper`)."""
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
            video_wrapper=video_wrapper,
        )
