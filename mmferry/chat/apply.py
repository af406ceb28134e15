"""`apply_chat_template`: chat messages -> the rendered text, or the expanded prompt and items.

The steps of transformers' `processor.apply_chat_template(..., tokenize=True)`: render the
checkpoint's template, tokenize the text, preprocess each image and video, expand each
placeholder. The items come out ready for `VisionEncoder`, `merge_vision_embeddings` and
`prefill_step`; `ChatPrompt.to_transformers()` gives transformers' dict for hf-layout items.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import torch

from mmferry.chat.media import Configured, build_item
from mmferry.chat.parts import (
    LIBRARY_POLICY,
    MediaPart,
    PartError,
    SourcePolicy,
    parse_messages,
)
from mmferry.chat.template import pick_template, render
from mmferry.items import Layout, MultimodalItem

if TYPE_CHECKING:
    from mmferry.prompt.expand import ExpandedPrompt
    from mmferry.prompt.mrope import Advance
    from mmferry.prompt.tokenizer import TimestampTokenizer
    from mmferry.prompt.wrapper import VideoWrapper

# Per-call video options that transformers' apply_chat_template turns into sampling.
_CALL_VIDEO = ("fps", "num_frames")


class ChatProcessor(Configured, Protocol):
    """What `apply_chat_template` needs of a processor (`mmferry.Processor` is one): chat is a
    stage the processor calls, so it names what it uses rather than importing the processor."""

    @property
    def chat_template(self) -> str | dict[str, str] | None: ...

    @property
    def special_tokens(self) -> dict[str, str]: ...

    @property
    def tokenizer(self) -> TimestampTokenizer: ...

    def with_options(self, options: dict[str, Any]) -> ChatProcessor: ...

    def expand_prompt(
        self,
        input_ids: Sequence[int],
        items: Sequence[MultimodalItem],
        *,
        mrope_advance: Advance,
        video_wrapper: VideoWrapper,
    ) -> ExpandedPrompt: ...


@dataclass(frozen=True)
class ChatPrompt:
    """A rendered conversation: its text, the expanded prompt and one item per image / video."""

    text: str
    prompt: ExpandedPrompt
    items: list[MultimodalItem]

    @property
    def input_ids(self) -> list[int]:
        return self.prompt.input_ids

    def to_transformers(self) -> dict[str, torch.Tensor]:
        """transformers' `return_dict=True` output (batch of one): ids, mask, pixels, grids."""
        if any(it.layout != "hf" for it in self.items):
            raise ValueError("to_transformers needs hf-layout items (layout='hf')")
        ids = torch.tensor([self.prompt.input_ids])
        out = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
        for modality, key, grid in (
            ("image", "pixel_values", "image_grid_thw"),
            ("video", "pixel_values_videos", "video_grid_thw"),
        ):
            items = [it for it in self.items if it.modality == modality]
            if items:
                out[key] = torch.cat([it.feature for it in items])
                out[grid] = torch.tensor([list(it.grid_thw) for it in items])
        spgt = [it.second_per_grid_t for it in self.items if it.modality == "video"]
        if spgt and None not in spgt:
            out["second_per_grid_ts"] = torch.tensor(spgt)
        return out


def _conversation(messages: Any) -> Sequence[Mapping[str, Any]]:
    messages = getattr(messages, "messages", messages)
    if isinstance(messages, Sequence) and messages and isinstance(messages[0], (list, tuple)):
        raise ValueError("pass one conversation (a list of messages) at a time")
    return messages


def _fails(render_fn: Any, messages: list[dict[str, Any]]) -> bool:
    try:
        render_fn(messages)
    except Exception:
        return True
    return False


def _template_error(render_fn: Any, messages: list[dict[str, Any]], error: Exception) -> PartError:
    """The template's error, at the first message (and part) whose addition makes it fail."""
    where = ""
    k = next((k for k in range(len(messages)) if _fails(render_fn, messages[: k + 1])), None)
    if k is not None:
        where, head = f" at message {k}", messages[:k]
        content = messages[k].get("content")
        if isinstance(content, list):
            part = next(
                (
                    j
                    for j in range(len(content))
                    if _fails(render_fn, [*head, {**messages[k], "content": content[: j + 1]}])
                ),
                None,
            )
            where += f" part {part}" if part is not None else ""
    return PartError(
        f"the chat template does not render these messages{where}: {error}",
        kind="bad_template",
        message_index=k,
    )


def apply_chat_template(
    proc: ChatProcessor,
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
    sources: SourcePolicy = LIBRARY_POLICY,
    mrope_advance: Advance = "extent",
    video_wrapper: VideoWrapper = "auto",
    threads: int | None = None,
    **template_kwargs: Any,
) -> str | list[int] | ChatPrompt:
    """transformers' `apply_chat_template` for one conversation (see `Processor`); the media
    are preprocessed as a batch on up to `threads` threads (see preprocess/batch.py)."""
    parsed = parse_messages(_conversation(messages), sources)
    template = pick_template(proc.chat_template, chat_template)
    variables = {**proc.special_tokens, **template_kwargs}

    def rendered(messages: list[dict[str, Any]]) -> str:
        return render(
            template,
            messages,
            add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message,
            tools=tools,
            documents=documents,
            **variables,
        )

    try:
        text = rendered(parsed.messages)
    except ImportError:
        raise
    except Exception as e:  # jinja2's TemplateError, and whatever a template's code raises
        raise _template_error(rendered, parsed.messages, e) from None
    if not tokenize:
        return text
    options = dict(processor_kwargs or {})
    call = {k: options.pop(k) for k in _CALL_VIDEO if options.get(k) is not None}
    worker = proc.with_options(options) if options else proc
    items = _build_items(worker, parsed.media, layout, call, threads)
    ids = proc.tokenizer.encode_uncached(text)
    try:
        prompt = worker.expand_prompt(
            ids, items, mrope_advance=mrope_advance, video_wrapper=video_wrapper
        )
    except ValueError as e:
        raise PartError(
            f"the rendered template does not hold one placeholder per item: {e}"
        ) from None
    if not return_dict:
        return prompt.input_ids
    return ChatPrompt(text, prompt, items)


def _build_items(
    proc: ChatProcessor,
    media: list[MediaPart],
    layout: Layout,
    call: dict[str, Any],
    threads: int | None,
) -> list[MultimodalItem]:
    """Every media part's item, as a batch; the first failed part's own error is raised (it
    names the message and part). Every part runs, so with several bad parts the error is the
    first one's, as when they ran one after another."""
    from mmferry.preprocess.batch import ImagePart, batch_threads, item_bytes, run_jobs

    jobs = [
        lambda share, part=part: build_item(proc, part, layout, call, threads=share)
        for part in media
    ]
    sizes = [
        item_bytes(ImagePart(part.source), proc.config, layout)
        if part.modality == "image"
        else None
        for part in media
    ]
    results = run_jobs(jobs, sizes, batch_threads(threads), stop_on_error=False)
    for result in results:
        if isinstance(result, BaseException):
            raise result
    return results  # type: ignore[return-value]
