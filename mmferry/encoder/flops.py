"""Matmul FLOPs of one vision-tower forward, and a device's bf16 peak: model FLOPs utilisation.

Counted as 2 FLOPs a multiply-add, matmuls only (norms, activations, rope and the learned
position lookup are a rounding error beside them), with the model's own shapes: the patch
embedding at the checkpoint's width C*T*P*P (whatever layout mmferry feeds it), attention over
each frame (or Qwen2.5-VL window) alone. Padding is not the model's work and is not counted.
"""

from __future__ import annotations

from collections.abc import Sequence

from mmferry.config import VisionConfig
from mmferry.encoder.metadata import frame_windows
from mmferry.models import spec_for

Grid = tuple[int, int, int]

# Dense bf16 tensor peaks (no sparsity), FLOP/s, by a substring of torch's device name; the
# first that matches wins, so the more specific names come first.
BF16_PEAKS: tuple[tuple[str, float], ...] = (
    ("H100 PCIe", 756e12),
    ("H100 NVL", 835e12),
    ("H100", 989e12),
    ("H200", 989e12),
    ("B200", 2250e12),
    ("A100", 312e12),
    ("L40S", 362e12),
    ("A10G", 70e12),
    ("L4", 121e12),
)


def bf16_peak(device_name: str) -> float | None:
    """The dense bf16 peak (FLOP/s) of a device named like `torch.cuda.get_device_name()`."""
    for key, peak in BF16_PEAKS:
        if key in device_name:
            return peak
    return None


def _attention(lengths: Sequence[int], hidden: int) -> int:
    # Q K^T and P V: 2 * L * L * hidden each, summed over heads (hidden = heads * head_dim).
    return sum(4 * n * n * hidden for n in lengths)


def tower_flops(config: VisionConfig, grids: Sequence[Grid]) -> int:
    """Matmul FLOPs of one forward of `config`'s tower over items of `grids`."""
    c = config
    spec = spec_for(c.family)  # the family's cost facts: MLP matmuls, window attention
    d, inter, unit = c.hidden_size, c.intermediate_size, c.spatial_merge_size**2
    n = sum(t * h * w for t, h, w in grids)
    frames = [h * w for t, h, w in grids for _ in range(t)]
    flops = 2 * n * (c.in_channels * c.temporal_patch_size * c.patch_size**2) * d
    per_layer = 2 * n * d * (3 * d + d + spec.mlp_matmuls * inter)
    full = _attention(frames, d)
    windowed = full
    if spec.windowed:
        window = c.window_size // c.spatial_merge_size // c.patch_size
        lengths = [
            m
            for t, h, w in grids
            for _ in range(t)
            for m in frame_windows(h, w, c.spatial_merge_size, window)[1]
        ]
        windowed = _attention(lengths, d)
    for layer in range(c.depth):
        is_full = not spec.windowed or layer in c.fullatt_block_indexes
        flops += per_layer + (full if is_full else windowed)
    # The merger (and each deepstack merger): [N/unit, unit*d] -> unit*d -> out.
    merged = n // unit
    merger = 2 * merged * (unit * d) * (unit * d + c.out_hidden_size)
    return flops + merger * (1 + len(c.deepstack_visual_indexes))


def utilisation(flops: int, seconds: float, peak: float) -> float:
    """Model FLOPs utilisation: the share of the device's peak a forward of `flops` used."""
    return flops / seconds / peak
