"""The generic family: any image-text checkpoint transformers serves, through its own code.

Preprocessing and prompt expansion are the checkpoint folder's own `AutoProcessor`; the rows
are the model's `get_image_features` with only the vision weights loaded (built on `meta`, the
vision tensors streamed in one at a time, the language model never materialised). What an
engine needs per checkpoint (the placeholder, each item's prompt tokens and row count, the row
width, the grid for mRoPE families) is read from the config and the processor, never from a
table here. A checkpoint mmferry has a native spec for keeps it (the fast path) unless the
caller asks for `family="generic"`.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import torch

from mmferry.models.registry import spec_for

GENERIC = "generic"
# What `--family` takes: "auto" (the native spec where mmferry has one, else generic) or
# "generic" (transformers' own code, for a native checkpoint too).
FAMILY_CHOICES = ("auto", GENERIC)
# The processor's outputs that belong to the text, not to one item.
_TEXT_KEYS = frozenset({"input_ids", "attention_mask", "token_type_ids", "mm_token_type_ids"})


def _transformers():
    try:
        import transformers
    except ImportError:
        raise ImportError(
            "the generic family runs transformers' own processor and vision code: "
            "pip install 'mmferry[generic]'"
        ) from None
    return transformers


def family_choice(value: str) -> str | None:
    """The `family=` the loaders take for a `--family` value: None for "auto"."""
    return None if value == "auto" else value


def checked_family(value: Any, what: str) -> str | None:
    """`family_choice` of a setting named `what`; ValueError unless one of `FAMILY_CHOICES`."""
    if value not in FAMILY_CHOICES:
        raise ValueError(f"{what} must be one of {FAMILY_CHOICES}, got {value!r}")
    return family_choice(value)


def uses_generic(model_dir: str | Path, family: str | None) -> bool:
    """Whether `model_dir` goes through the generic family: asked for, or no native spec
    (`family` None or "auto")."""
    if family is not None and family != "auto":
        if family == GENERIC:
            return True
        spec_for(family)  # a native family by name: a clear error when unknown
        return False
    cfg_path = Path(model_dir) / "config.json"
    try:
        model_type = json.loads(cfg_path.read_text()).get("model_type")
    except (OSError, ValueError, AttributeError):
        return False  # the native loader names what is wrong with the folder
    try:
        spec_for(str(model_type))
    except ValueError:
        return True
    return False


@dataclass(frozen=True)
class GenericFacts:
    """What engines need of one checkpoint, read from its config and processor."""

    model_type: str
    # The text a prompt holds once per image, and its id (the chat template writes it).
    placeholder: str
    placeholder_id: int
    # The token whose embeddings an image's rows replace (config.json's image token).
    row_token_id: int
    # The language model's hidden size: the width of every row.
    row_width: int
    # The processor's class, for messages.
    processor_name: str


@dataclass(frozen=True)
class GenericItem:
    """One image as the checkpoint's own processor prepared it.

    `inputs`: the processor's tensors for this item alone (`pixel_values`, `image_grid_thw`,
    ...); `prompt_ids`: what its placeholder becomes in the prompt; `num_tokens`: the rows the
    vision path gives for it (its row tokens in `prompt_ids`)."""

    modality: str
    inputs: Mapping[str, torch.Tensor]
    hash: str
    prompt_ids: tuple[int, ...]
    num_tokens: int
    # Grid-based processors (GLM-4.1V, Qwen-VL) say (t, h, w) in patches; others give none.
    grid_thw: tuple[int, int, int] | None = None
    layout: str = "hf"

    # NOTE: vLLM (0.32) takes no grid or rows of these families as its input, only pixels:
    # an engine is handed the image itself and loads the rows by uuid (the cache routes say so).
    engine_needs_pixels: ClassVar[bool] = True
    # Images only: no frame times (the routes' facts carry them for native videos).
    timestamps: None = None
    second_per_grid_t: None = None

    def __post_init__(self) -> None:
        if self.modality != "image":
            raise ValueError(f"generic items are images, got {self.modality!r}")
        if not self.inputs:
            raise ValueError("a generic item needs the processor's tensors")
        if not 1 <= self.num_tokens <= len(self.prompt_ids):
            raise ValueError(
                f"num_tokens {self.num_tokens} is not within the {len(self.prompt_ids)} "
                "prompt tokens of the item"
            )

    @property
    def num_patches(self) -> int:
        """What the service's batch budget counts: the grid's patches where the processor
        gives a grid, else the item's rows (a fixed-size tower, Gemma 3's)."""
        if self.grid_thw is None:
            return self.num_tokens
        t, h, w = self.grid_thw
        return t * h * w


@dataclass(frozen=True)
class GenericPrompt:
    """Expanded ids and, per item, the `[start, end)` spans its rows fill."""

    input_ids: list[int]
    offsets: list[list[tuple[int, int]]]


class _Settings:
    """The processor's saved settings as `item_hash` takes them (one fingerprint)."""

    def __init__(self, hf_processor: Any, options: Mapping[str, Any]) -> None:
        saved = hf_processor.to_json_string() if hasattr(hf_processor, "to_json_string") else ""
        self._bytes = json.dumps([saved, repr(sorted(options.items()))]).encode()

    def fingerprint(self) -> bytes:
        return self._bytes


def _load_processor(tf: Any, root: Path, config: Any) -> Any:
    """The folder's `AutoProcessor`; without torchvision, the same processor for images only.

    transformers' video processors need torchvision and its processors refuse to be built
    without theirs; images need neither, so a processor is then built from the folder's image
    processor and tokenizer with no video processor (videos are a clear error, see `video`)."""
    try:
        return tf.AutoProcessor.from_pretrained(root)
    except ImportError:
        if tf.utils.is_torchvision_available():
            raise
    from transformers.models.auto.processing_auto import PROCESSOR_MAPPING

    base = PROCESSOR_MAPPING[type(config)]

    class ImagesOnly(base):  # type: ignore[misc, valid-type]
        def check_argument_for_proper_class(self, name: str, arg: Any) -> Any:
            if name == "video_processor" and arg is None:
                return None
            return super().check_argument_for_proper_class(name, arg)

    ImagesOnly.__name__ = base.__name__
    kwargs: dict[str, Any] = {
        "image_processor": tf.AutoImageProcessor.from_pretrained(root),
        "tokenizer": tf.AutoTokenizer.from_pretrained(root),
    }
    if "video_processor" in base.get_attributes():
        kwargs["video_processor"] = None
    return ImagesOnly(**kwargs)


def _facts(config: Any, hf_processor: Any, model_type: str) -> GenericFacts:
    name = type(hf_processor).__name__
    placeholder = getattr(hf_processor, "image_token", None)
    if not isinstance(placeholder, str):
        raise ValueError(
            f"{model_type}: its processor ({name}) names no image token, so the checkpoint "
            "takes no images and the generic family cannot serve it"
        )
    tok = hf_processor.tokenizer
    placeholder_id = tok.convert_tokens_to_ids(placeholder)
    row = getattr(config, "image_token_id", None)
    row = getattr(config, "image_token_index", None) if row is None else row
    if not isinstance(placeholder_id, int) or placeholder_id == tok.unk_token_id or row is None:
        raise ValueError(
            f"{model_type}: the image token is missing from the tokenizer or config, so the "
            "generic family cannot serve it"
        )
    return GenericFacts(
        model_type=model_type,
        placeholder=placeholder,
        placeholder_id=placeholder_id,
        row_token_id=int(row),
        row_width=int(config.get_text_config().hidden_size),
        processor_name=name,
    )


def hf_config(tf: Any, root: Path) -> Any:
    """The folder's transformers config; a ValueError saying neither path can read it."""
    try:
        return tf.AutoConfig.from_pretrained(root)
    except ValueError:  # a model_type this transformers does not know
        from mmferry.models import supported_model_types

        try:
            model_type = json.loads((root / "config.json").read_text()).get("model_type")
        except (OSError, ValueError, AttributeError):
            model_type = None
        if model_type is None:
            raise
        raise ValueError(
            f"{root}: model_type {model_type!r} is neither native to mmferry "
            f"({', '.join(supported_model_types())}) nor known to transformers "
            f"{tf.__version__}, so neither the native nor the generic family can serve it"
        ) from None


class GenericProcessor:
    """`Processor` for a checkpoint through its own transformers processor (`image`, `images`,
    `expand_prompt`)."""

    def __init__(self, model_dir: str | Path, **options: Any) -> None:
        tf = _transformers()
        self.model_dir = Path(model_dir)
        config = hf_config(tf, self.model_dir)
        self.hf = _load_processor(tf, self.model_dir, config)
        self.facts = _facts(config, self.hf, config.model_type)
        # Options go to every processor call as transformers spells them (`images_kwargs`, ...).
        self.options = dict(options)
        self._settings = _Settings(self.hf, self.options)
        from mmferry.config import DEFAULT_MAX_DECODED_PIXELS

        self.max_decoded_pixels = DEFAULT_MAX_DECODED_PIXELS

    @classmethod
    def from_pretrained(cls, model_dir: str | Path, **options: Any) -> GenericProcessor:
        """The checkpoint folder's own processor; `options` go to each of its calls."""
        return cls(model_dir, **options)

    # The item layouts this processor gives: its own processor's tensors only.
    layouts: tuple[str, ...] = ("hf",)
    # Transformers' own code: no native settings, keys or videos.
    native: bool = False

    @property
    def family(self) -> str:
        return GENERIC

    @property
    def no_video(self) -> str:
        """Why a video is refused (the generic family carries images)."""
        name = self.facts.processor_name
        if getattr(self.hf, "video_processor", None) is None:
            return f"this checkpoint's processor ({name}) takes no video"
        return (
            f"videos through the generic family are not supported ({name} has a video "
            "processor, but mmferry carries only images for it)"
        )

    def with_options(self, options: dict[str, Any]) -> GenericProcessor:
        """This processor with more options for every call."""
        return GenericProcessor(self.model_dir, **{**self.options, **options})

    def image(self, source: Any, layout: str = "hf", *, threads: int | None = None):
        """Decode one image (as the native path does) and run the checkpoint's processor on it."""
        from mmferry.preprocess.decode import decode_image, pixels_identity
        from mmferry.preprocess.hashing import item_hash

        if layout != "hf":
            raise ValueError(
                f"layout {layout!r}: the generic family carries its processor's own tensors "
                "(layout 'hf'); compact-u8 is a native-family format"
            )
        decoded = decode_image(source, self.max_decoded_pixels)
        hwc = decoded.pixels.permute(1, 2, 0).contiguous()  # [3, H, W] -> [H, W, 3]
        identity = decoded.identity or pixels_identity(hwc, b"pixels")
        out = self.hf(
            text=[self.facts.placeholder],
            images=[hwc.numpy()],
            return_tensors="pt",
            add_special_tokens=False,
            **self.options,
        )
        prompt_ids = tuple(int(i) for i in out["input_ids"][0].tolist())
        grid = out.get("image_grid_thw")
        return GenericItem(
            modality="image",
            inputs={k: v for k, v in out.items() if k not in _TEXT_KEYS},
            hash=item_hash("image", identity, self._settings),  # type: ignore[arg-type]
            prompt_ids=prompt_ids,
            num_tokens=prompt_ids.count(self.facts.row_token_id),
            grid_thw=None if grid is None else tuple(int(v) for v in grid[0].tolist()),
        )

    def images(
        self, sources: Sequence[Any], *, layout: str = "hf", partial: bool = False
    ) -> list[Any]:
        """Many images, one after another, in input order. A failed item raises `ItemError`
        naming its index; with `partial=True` its place holds the `ItemError` instead."""
        from mmferry.preprocess.batch import ItemError

        out: list[Any] = []
        for i, source in enumerate(sources):
            try:
                out.append(self.image(source, layout))
            except ValueError as e:
                if not partial:
                    raise ItemError(i, e) from None
                out.append(ItemError(i, e))
        return out

    def items(
        self,
        parts: Sequence[Any],
        *,
        layout: str = "hf",
        threads: int | None = None,
        partial: bool = False,
    ) -> list[Any]:
        """`Processor.items` for a batch of `ImagePart` / `VideoPart`: images one after
        another; a video is that item's `ItemError` (the generic family carries images)."""
        from mmferry.preprocess.batch import ItemError, VideoPart

        out: list[Any] = []
        for i, part in enumerate(parts):
            try:
                if isinstance(part, VideoPart):
                    raise ValueError(self.no_video)
                out.append(self.image(part.source, layout, threads=threads))
            except ValueError as e:
                if not partial:
                    raise ItemError(i, e) from None
                out.append(ItemError(i, e))
        return out

    def video(self, source: Any, *args: Any, **kwargs: Any):
        """Videos are not carried by the generic family (a clear error either way)."""
        raise ValueError(self.no_video)

    def expand_prompt(
        self, input_ids: Sequence[int], items: Sequence[GenericItem]
    ) -> GenericPrompt:
        """Each placeholder becomes its item's prompt tokens, in order; the rows' spans."""
        ids = [int(i) for i in input_ids]
        at = [n for n, i in enumerate(ids) if i == self.facts.placeholder_id]
        if len(at) != len(items):
            raise ValueError(
                f"the prompt holds {len(at)} {self.facts.placeholder} placeholders for "
                f"{len(items)} items"
            )
        out: list[int] = []
        offsets: list[list[tuple[int, int]]] = []
        prev = 0
        for pos, item in zip(at, items, strict=True):
            out += ids[prev:pos]
            offsets.append(_runs(item.prompt_ids, self.facts.row_token_id, len(out)))
            out += item.prompt_ids
            prev = pos + 1
        out += ids[prev:]
        return GenericPrompt(out, offsets)


def _runs(ids: Sequence[int], token: int, base: int) -> list[tuple[int, int]]:
    """`[start, end)` spans of consecutive `token`s in `ids`, shifted by `base`."""
    spans: list[tuple[int, int]] = []
    for n, i in enumerate(ids):
        if i != token:
            continue
        if spans and spans[-1][1] == base + n:
            spans[-1] = (spans[-1][0], base + n + 1)
        else:
            spans.append((base + n, base + n + 1))
    return spans
