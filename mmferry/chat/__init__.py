"""Chat messages in: the checkpoint's chat template, content parts, processor options.

`Processor.apply_chat_template` is the front door; these are its parts, for services and
command-line tools that parse requests themselves (`parse_messages` with a `SourcePolicy`).
"""

from __future__ import annotations

from mmferry._exports import lazy_exports

_EXPORTS: dict[str, str] = {
    "ChatPrompt": "mmferry.chat.apply",
    "apply_chat_template": "mmferry.chat.apply",
    "parse_messages": "mmferry.chat.parts",
    "parse_part": "mmferry.chat.parts",
    "MediaPart": "mmferry.chat.parts",
    "ParsedChat": "mmferry.chat.parts",
    "parse_content": "mmferry.chat.parts",
    "read_part": "mmferry.chat.parts",
    "Reference": "mmferry.chat.sources",
    "PartError": "mmferry.chat.sources",
    "SourcePolicy": "mmferry.chat.sources",
    "build_item": "mmferry.chat.media",
    "find_chat_template": "mmferry.chat.template",
    "render": "mmferry.chat.template",
    "processor_overrides": "mmferry.chat.options",
    "UnknownOptionError": "mmferry.chat.options",
}

__all__ = list(_EXPORTS)
__getattr__ = lazy_exports(__name__, _EXPORTS)
