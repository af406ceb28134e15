"""The checkpoint's chat template: found as transformers finds it, rendered as it renders it.

Chat templates come from the Hub and are untrusted code, so they run in jinja2's immutable
sandbox with transformers' globals (`raise_exception`, `strftime_now`, a `tojson` that does not
escape HTML, a `namespace` that refuses underscore names) and see only plain JSON data: media
objects in the messages become inert `"<Image>"`-style placeholders, as in transformers.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from functools import lru_cache
from pathlib import Path
from typing import Any

# Where a checkpoint folder keeps its template, most binding first (transformers 5.x): the
# processor's own config key, the legacy processor file, the processor's jinja file (plus
# named templates beside it), then the tokenizer's config key.
TEMPLATE_FILES = (
    "processor_config.json",
    "chat_template.json",
    "chat_template.jinja",
    "tokenizer_config.json",
)
NAMED_TEMPLATES_DIR = "additional_chat_templates"
# Special-token names transformers passes to every template (`tokenizer.special_tokens_map`).
_SPECIAL_TOKENS = (
    "bos_token",
    "eos_token",
    "unk_token",
    "sep_token",
    "pad_token",
    "cls_token",
    "mask_token",
)
_JINJA_HINT = "rendering chat templates needs jinja2>=3.1.6: pip install 'mmferry[chat]'"


def _json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise ValueError(f"{path} is not valid JSON: {e}") from None
    return data if isinstance(data, dict) else {}


def find_chat_template(model_dir: str | Path) -> str | dict[str, str]:
    """The folder's chat template(s), by transformers' precedence; a dict when it names several.

    ValueError naming the files looked for when the folder has none."""
    root = Path(model_dir)
    config = root / "processor_config.json"
    if config.is_file() and _json(config).get("chat_template") is not None:
        return _json(config)["chat_template"]
    named = {
        p.stem: p.read_text(encoding="utf-8") for p in root.glob(f"{NAMED_TEMPLATES_DIR}/*.jinja")
    }
    legacy = root / "chat_template.json"
    if legacy.is_file():
        if named:
            raise ValueError(
                f"{root} has both chat_template.json and {NAMED_TEMPLATES_DIR}/; keep one "
                "(transformers refuses the pair too)"
            )
        return _json(legacy)["chat_template"]
    jinja = root / "chat_template.jinja"
    if jinja.is_file():
        named["default"] = jinja.read_text(encoding="utf-8")
    if named:
        return named["default"] if list(named) == ["default"] else named
    tok_config = root / "tokenizer_config.json"
    if tok_config.is_file() and _json(tok_config).get("chat_template") is not None:
        template = _json(tok_config)["chat_template"]
        if isinstance(template, list):  # the tokenizer's spelling of named templates
            return {t["name"]: t["template"] for t in template}
        return template
    raise ValueError(
        f"{root} has no chat template; looked for {', '.join(TEMPLATE_FILES[1:3])}, "
        f"{NAMED_TEMPLATES_DIR}/*.jinja and a 'chat_template' key in {TEMPLATE_FILES[0]} and "
        f"{TEMPLATE_FILES[3]}; pass chat_template= (the template text)"
    )


def pick_template(templates: str | Mapping[str, str] | None, name: str | None) -> str:
    """The template to render: `name` may be a template's name or a whole template."""
    if isinstance(templates, Mapping):
        if name is None:
            if "default" in templates:
                return templates["default"]
            raise ValueError(
                "this checkpoint has several chat templates and none is named 'default'; pass "
                f"chat_template= one of: {', '.join(templates)}"
            )
        return templates.get(name, name)
    if name is not None:
        return name
    if templates is None:
        raise ValueError("this Processor has no chat template; pass chat_template=")
    return templates


def special_tokens(model_dir: str | Path | None) -> dict[str, str]:
    """The special-token strings a template may use (`eos_token`, ...), from tokenizer_config."""
    if model_dir is None or not (Path(model_dir) / "tokenizer_config.json").is_file():
        return {}
    config = _json(Path(model_dir) / "tokenizer_config.json")
    out: dict[str, str] = {}
    for key in _SPECIAL_TOKENS:
        value = config.get(key)
        value = value.get("content") if isinstance(value, dict) else value
        if isinstance(value, str):
            out[key] = value
    return out


def plain(value: Any) -> Any:
    """What a template may see of `value`: JSON types only, anything else a placeholder.

    Exactly transformers' `_plain_template_data`: media objects have methods the sandbox does
    not know to be dangerous, and templates only test whether a media key is present."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, int):
        return int.__int__(value)
    if isinstance(value, float):
        return float.__float__(value)
    if isinstance(value, Mapping):
        return {plain(k): plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [plain(v) for v in value]
    if isinstance(value, tuple):
        return tuple(plain(v) for v in value)
    item = getattr(value, "item", None)
    if type(value).__module__ == "numpy" and callable(item) and getattr(value, "ndim", 1) == 0:
        return plain(item())
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    return f"<{type(value).__name__}>"


@lru_cache(maxsize=16)
def _compile(template: str) -> Any:
    try:
        import jinja2
        from jinja2.ext import Extension, loopcontrols
        from jinja2.sandbox import ImmutableSandboxedEnvironment
    except ImportError:
        raise ImportError(_JINJA_HINT) from None
    major, minor, patch = (int(x) for x in jinja2.__version__.split(".")[:3])
    if (major, minor, patch) < (3, 1, 6):
        # Older versions have known sandbox escapes.
        raise ImportError(f"{_JINJA_HINT} (found {jinja2.__version__})")

    class Generation(Extension):
        # `{% generation %}` marks assistant text for transformers' assistant masks; here it
        # renders its body, so templates that use it render the same text.
        tags = {"generation"}

        def parse(self, parser: Any) -> Any:
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(
                lineno
            )

        def _body(self, caller: Any) -> str:
            return caller()

    class TemplateDict:
        # `dict(...)` and `dict.fromkeys(...)` without the type itself (no attribute tricks).
        def __call__(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
            return dict(*args, **kwargs)

        def fromkeys(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
            return dict.fromkeys(*args, **kwargs)

    class TemplateNamespace(jinja2.utils.Namespace):
        # Namespaces refuse underscore names, which lead to CPython internals.
        def __init__(*args: Any, **kwargs: Any) -> None:
            self, args = args[0], args[1:]
            attrs = dict(*args, **kwargs)
            for name in attrs:
                TemplateNamespace.check(name)
            jinja2.utils.Namespace.__init__(self, attrs)

        def __setitem__(self, name: str, value: Any) -> None:
            TemplateNamespace.check(name)
            jinja2.utils.Namespace.__setitem__(self, name, value)

        @staticmethod
        def check(name: Any) -> None:
            if isinstance(name, str) and name.startswith("_"):
                raise jinja2.exceptions.SecurityError(
                    f"chat templates cannot set underscore attributes on a namespace: {name!r}"
                )

    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    def tojson(
        x: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None,
        sort_keys: bool = False,
    ) -> str:  # fmt: skip
        return json.dumps(
            x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
        )

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[Generation, loopcontrols]
    )
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    env.globals["dict"] = TemplateDict()
    env.globals["namespace"] = TemplateNamespace
    return env.from_string(template)


_CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "


def _tag_final_message(chat: list[dict[str, Any]], field: str) -> str:
    """Append the continue tag to the last message's text; returns that text."""
    final = chat[-1].get(field) if chat else None
    if final is None:
        raise ValueError(f"continue_final_message: the last message has no {field!r} to continue")
    if isinstance(final, (list, tuple)):
        for block in reversed(final):
            if isinstance(block, dict) and "text" in block:
                text = block["text"]
                block["text"] = text + _CONTINUE_TAG
                return text
        raise ValueError("continue_final_message: the last message has no text to continue")
    chat[-1][field] = final + _CONTINUE_TAG
    return final


def render(
    template: str,
    messages: Sequence[Mapping[str, Any]],
    *,
    add_generation_prompt: bool = False,
    continue_final_message: bool | str = False,
    tools: Sequence[Mapping[str, Any]] | None = None,
    documents: Sequence[Mapping[str, Any]] | None = None,
    **variables: Any,
) -> str:
    """One conversation rendered by `template` as transformers renders it (same text)."""
    if continue_final_message and add_generation_prompt:
        raise ValueError("continue_final_message and add_generation_prompt exclude each other")
    try:
        compiled = _compile(template)
    except ImportError:
        raise
    except Exception as e:  # jinja2.TemplateSyntaxError and friends
        raise ValueError(f"the chat template does not compile: {e}") from None
    chat = plain([{k: v for k, v in m.items() if v is not None} for m in messages])
    for m in chat:
        # transformers reads older names of a message's reasoning into the standard one.
        reasoning = next(
            (m[k] for k in ("reasoning_content", "thinking", "reasoning") if m.get(k) is not None),
            None,
        )
        if reasoning is not None:
            m.update(thinking=m.get("thinking", reasoning), reasoning_content=reasoning)
    final = None
    if continue_final_message:
        field = continue_final_message if isinstance(continue_final_message, str) else "content"
        final = _tag_final_message(chat, field)
    text = compiled.render(
        messages=chat,
        tools=plain(list(tools)) if tools is not None else None,
        documents=plain(list(documents)) if documents is not None else None,
        add_generation_prompt=add_generation_prompt,
        **plain(variables),
    )
    if final is not None:
        at = text.rfind(_CONTINUE_TAG.strip())
        if at < 0 or final.strip() not in text:
            raise ValueError(
                "continue_final_message: the template dropped the final message's text"
            )
        # A template that keeps spacing keeps the tag whole; one that trims, the text before.
        whole = text[at : at + len(_CONTINUE_TAG)] == _CONTINUE_TAG
        text = text[:at] if whole else text[:at].rstrip()
    return text
