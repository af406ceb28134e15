"""Capabilities from attributes; prepare_encoder_inputs moves features once or not at all."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from mmferry.feed.capabilities import capabilities_of, prepare_encoder_inputs
from mmferry.items import MultimodalItem


class MetaEncoder(nn.Module):
    """Declares device and dtype; leaves moving inputs to the pipeline."""

    device = torch.device("meta")
    dtype = torch.bfloat16
    accepted_layouts = ("hf", "compact-u8")


class SelfMovingEncoder(nn.Module):
    """Moves its own inputs (like the real VisionEncoder)."""

    moves_own_inputs = True
    accepted_layouts = ("hf", "compact-u8")

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(3, 3, device="meta", dtype=torch.bfloat16)


class Undeclared(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(3, 3, device="meta", dtype=torch.float16)


class Copies(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(func.__name__)
        return func(*args, **(kwargs or {}))


def test_image_features_arrive_as_one_bf16_tensor_on_meta():
    feats = [torch.randn(2, 3), torch.randn(1, 3)]
    out = prepare_encoder_inputs(MetaEncoder(), feats, grids=[(1, 1, 2), (1, 1, 1)])
    assert out.moved and out.layout == "hf"
    assert out.features.shape == (3, 3)
    assert out.features.device.type == "meta" and out.features.dtype == torch.bfloat16
    assert out.grid_thw.tolist() == [[1, 1, 2], [1, 1, 1]] and out.grid_thw.device.type == "cpu"


def test_video_features_and_grids_concatenated_unchanged():
    feats = [torch.randn(3, 4), torch.randn(2, 4)]
    out = prepare_encoder_inputs(MetaEncoder(), feats, grids=[(1, 1, 3), (1, 1, 2)])
    assert out.features.shape == (5, 4) and out.features.device.type == "meta"
    assert out.features.dtype == torch.bfloat16
    assert out.grid_thw.dtype == torch.int64
    assert out.grid_thw.tolist() == [[1, 1, 3], [1, 1, 2]]


def test_cpu_encoder_gets_exact_values_from_items():
    enc = MetaEncoder()
    enc.device = torch.device("cpu")
    g = torch.Generator().manual_seed(0)
    items = [
        MultimodalItem("image", torch.randn(4, 6, generator=g), (1, 2, 2), "hf", "a"),
        MultimodalItem("video", torch.randn(8, 6, generator=g), (2, 2, 2), "hf", "b"),
    ]
    out = prepare_encoder_inputs(enc, items)
    ref = torch.cat([it.feature for it in items]).to(torch.bfloat16)
    assert torch.equal(out.features, ref)
    assert out.grid_thw.tolist() == [[1, 2, 2], [2, 2, 2]]


def test_self_moving_encoder_gets_untouched_features_and_no_copy():
    feats = [torch.randn(4, 3), torch.randn(8, 3).t().contiguous().t()[:4]]
    log = Copies()
    with log:
        out = prepare_encoder_inputs(SelfMovingEncoder(), feats, grids=[(1, 2, 2), (1, 2, 2)])
    assert not out.moved
    assert all(a is b for a, b in zip(out.features, feats, strict=True))
    assert not {"copy_.default", "_to_copy.default", "cat.default"} & set(log.ops), log.ops


def test_defaults_for_undeclared_encoder():
    caps = capabilities_of(Undeclared())
    assert caps.device.type == "meta" and caps.dtype == torch.float16
    assert not caps.moves_own_inputs and caps.accepted_layouts == ("hf",)
    bare = capabilities_of(object())
    assert bare.device == torch.device("cpu") and bare.dtype == torch.float32
    out = prepare_encoder_inputs(Undeclared(), [torch.randn(4, 3)], grids=[(1, 2, 2)])
    assert out.moved and out.features.device.type == "meta"
    assert out.features.dtype == torch.float16


def test_compact_u8_accepted_only_when_declared():
    u8 = [torch.randint(0, 256, (4, 3), dtype=torch.uint8)]
    out = prepare_encoder_inputs(MetaEncoder(), u8, grids=[(1, 2, 2)])
    # Moved to the encoder's device but kept uint8: the encoder normalises (folded weights).
    assert out.layout == "compact-u8" and out.features.dtype == torch.uint8
    assert out.moved and out.features.device.type == "meta"
    with pytest.raises(ValueError, match="accepts layouts"):
        prepare_encoder_inputs(Undeclared(), u8, grids=[(1, 2, 2)])


@pytest.mark.parametrize(
    ("feats", "grids", "match"),
    [
        ([], None, "non-empty"),
        ([torch.randn(4, 3)], None, "one grid_thw per tensor"),
        ([torch.randn(3, 3)], [(1, 2, 2)], "needs t\\*h\\*w = 4 rows"),
        ([torch.randn(4, 3)], [(1, 0, 2)], "three positive ints"),
        (
            [torch.randn(4, 3), torch.randint(0, 9, (4, 3), dtype=torch.uint8)],
            [(1, 2, 2)] * 2,
            "mix layouts",
        ),
        (["not a tensor"], None, "MultimodalItems"),
    ],
)
def test_bad_input(feats, grids, match):
    with pytest.raises(ValueError, match=match):
        prepare_encoder_inputs(MetaEncoder(), feats, grids=grids)


def test_no_class_name_lists_in_the_package():
    import inspect

    import mmferry.feed.capabilities as caps

    src = inspect.getsource(caps)
    assert "__name__" not in src and "__class__" not in src and "type(encoder)" not in src
