"""Everything a vision forward needs that depends only on the grids, computed on the host.

Grids are Python ints, so cu_seqlens, rotary position ids, position-table interpolation taps and
window permutations are built here with CPU tensor ops, cached per frame shape and a whole
call's per list of grids (least recently used first out, bounded by the bytes the cached
tensors hold: `CACHE_BYTES`), and
sent to the encoder's device once (pinned, non-blocking) by `TowerMetadata.to`. The forward then
never asks the device a question: nothing in it reads a tensor value back to the host.
"""

from __future__ import annotations

import dataclasses
import functools
import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import torch

from mmferry.encoder.attention import VarlenBatch, varlen_batch

Grid = tuple[int, int, int]

# Bytes of tensors the per-frame-shape helpers may keep; a 400 x 400-patch frame's entries
# take about 10 MB, so this holds dozens of large shapes and thousands of common ones.
CACHE_BYTES = 64 << 20

F = TypeVar("F", bound=Callable[..., Any])


def _nbytes(value: Any) -> int:
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, tuple):
        return sum(_nbytes(v) for v in value)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return sum(_nbytes(getattr(value, f.name)) for f in dataclasses.fields(value))
    return 0


class _ShapeCache:
    """One least-recently-used store for every helper, bounded in bytes, thread-safe."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.bytes = 0
        self._entries: OrderedDict[tuple, tuple[Any, int]] = OrderedDict()
        self._lock = threading.Lock()

    def __call__(self, fn: F) -> F:
        @functools.wraps(fn)
        def cached(*args: Any) -> Any:
            key = (fn.__name__, *args)
            with self._lock:
                hit = self._entries.get(key)
                if hit is not None:
                    self._entries.move_to_end(key)
                    return hit[0]
            value = fn(*args)
            size = _nbytes(value)
            with self._lock:
                if key not in self._entries and size <= self.capacity:
                    self._entries[key] = (value, size)
                    self.bytes += size
                    while self.bytes > self.capacity:
                        _, (_, dropped) = self._entries.popitem(last=False)
                        self.bytes -= dropped
            return value

        return cached  # type: ignore[return-value]

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()
            self.bytes = 0


_CACHE = _ShapeCache(CACHE_BYTES)


def cache_bytes() -> int:
    """Bytes the per-frame-shape and per-grids cache holds now (at most `CACHE_BYTES`)."""
    return _CACHE.bytes


def clear_caches() -> None:
    """Drop every cached per-frame-shape tensor."""
    _CACHE.clear()


# NOTE: the cached helpers below return shared tensors; callers only read them and build
# new tensors from them (repeat, cat, +), never write into them.


@_CACHE
def frame_positions(h: int, w: int, merge: int) -> torch.Tensor:
    """(row, col) of each patch of one h x w frame in merge-block order: int64 [h*w, 2]."""
    rows = torch.arange(h).view(h // merge, merge, 1, 1).expand(-1, -1, w // merge, merge)
    cols = torch.arange(w).view(1, 1, w // merge, merge).expand(h // merge, merge, -1, -1)
    # [h/m, m, w/m, m] -> [h/m, w/m, m, m]: patches of one merge block are consecutive rows.
    rows = rows.permute(0, 2, 1, 3).reshape(-1)
    cols = cols.permute(0, 2, 1, 3).reshape(-1)
    return torch.stack([rows, cols], dim=1)


def _axis_taps(index: torch.Tensor, size: int, side: int) -> tuple[torch.Tensor, torch.Tensor]:
    # align_corners bilinear: target 0..size-1 maps linearly onto source 0..side-1.
    src = index.to(torch.float32) * (side - 1) / max(size - 1, 1)
    floor = torch.floor(src)
    offsets = torch.arange(2)
    taps = (floor.long()[:, None] + offsets).clamp(0, side - 1)
    weights = (1 - (src[:, None] - floor[:, None] - offsets).abs()).clamp(min=0)
    return taps, weights


@_CACHE
def frame_interpolation(h: int, w: int, merge: int, side: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Taps [h*w, 4] (int64, into the flat side x side table) and weights [h*w, 4] (float32)
    that resample the learned position table bilinearly (align_corners) to an h x w frame,
    rows in merge-block order."""
    pos = frame_positions(h, w, merge)
    h_taps, h_weights = _axis_taps(pos[:, 0], h, side)
    w_taps, w_weights = _axis_taps(pos[:, 1], w, side)
    taps = (h_taps[:, :, None] * side + w_taps[:, None, :]).reshape(-1, 4)
    weights = (h_weights[:, :, None] * w_weights[:, None, :]).reshape(-1, 4)
    return taps, weights


@_CACHE
def frame_windows(h: int, w: int, merge: int, window: int) -> tuple[torch.Tensor, tuple[int, ...]]:
    """Window attention order of one frame (Qwen2.5-VL).

    Returns the merge-block permutation (int64 [h*w/merge**2]) that lays windows of
    `window x window` merge blocks out consecutively (row-major inside each window, edge windows
    truncated), and each window's length in patches.
    """
    hm, wm = h // merge, w // merge
    blocks = torch.arange(hm * wm).view(hm, wm)
    order: list[torch.Tensor] = []
    lengths: list[int] = []
    for r in range(0, hm, window):
        for c in range(0, wm, window):
            win = blocks[r : r + window, c : c + window].reshape(-1)
            order.append(win)
            lengths.append(win.numel() * merge * merge)
    return torch.cat(order), tuple(lengths)


@functools.lru_cache(maxsize=16)
def rope_inv_freq(head_dim: int, theta: float = 10000.0) -> torch.Tensor:
    """Axial 2-D rotary frequencies: head_dim/4 per axis, float32."""
    half = head_dim // 2
    return 1.0 / (theta ** (torch.arange(0, half, 2, dtype=torch.float32) / half))


def _send(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    if device.type == "cuda":
        # Pinned source so the copy is truly asynchronous and the forward never waits on it.
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)


@dataclass(frozen=True)
class TowerMetadata:
    """Grid-derived inputs of one forward; host-built, then moved with `to`."""

    grids: tuple[Grid, ...]
    positions: torch.Tensor  # int64 [N, 2] (row, col) per patch, in forward order
    inv_freq: torch.Tensor  # float32 [head_dim/4]
    full: VarlenBatch  # one sequence per frame
    interp_taps: torch.Tensor | None = None  # Qwen3-VL: int64 [N, 4]
    interp_weights: torch.Tensor | None = None  # Qwen3-VL: float32 [N, 4]
    windows: VarlenBatch | None = None  # Qwen2.5-VL
    window_index: torch.Tensor | None = None  # Qwen2.5-VL: merge-block permutation
    window_reverse: torch.Tensor | None = None  # its inverse, applied after the merger

    @property
    def num_patches(self) -> int:
        return self.full.total

    def to(self, device: torch.device) -> TowerMetadata:
        """The same metadata with every tensor on `device` (pinned, non-blocking for CUDA)."""

        def mv(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else _send(t, device)

        return TowerMetadata(
            grids=self.grids,
            positions=_send(self.positions, device),
            inv_freq=_send(self.inv_freq, device),
            full=self.full.to(device),
            interp_taps=mv(self.interp_taps),
            interp_weights=mv(self.interp_weights),
            windows=None if self.windows is None else self.windows.to(device),
            window_index=mv(self.window_index),
            window_reverse=mv(self.window_reverse),
        )


def _frames(grids: Sequence[Grid]) -> list[int]:
    return [h * w for t, h, w in grids for _ in range(t)]


def build_metadata(
    grids: Sequence[Grid],
    *,
    merge: int,
    head_dim: int,
    position_side: int = 0,
    window: int = 0,
) -> TowerMetadata:
    """Host metadata for patches packed in `grids` order.

    `position_side` > 0 adds Qwen3-VL's position-table interpolation; `window` > 0 (in merge
    blocks per side) adds Qwen2.5-VL's window permutation.
    """
    grids = tuple((int(t), int(h), int(w)) for t, h, w in grids)
    if not grids:
        raise ValueError("build_metadata needs at least one grid")
    return _metadata(grids, merge, head_dim, position_side, window)


# NOTE: a whole call's metadata, cached per list of grids: a service's calls repeat the same
# image sizes, and building it (cat, window order, argsort, cu_seqlens) took about a fifth of a
# small tower's call on the CPU (0.24-0.32 ms of the tiny checkpoint's 1.2-1.9 ms, measured).
@_CACHE
def _metadata(
    grids: tuple[Grid, ...], merge: int, head_dim: int, position_side: int, window: int
) -> TowerMetadata:
    positions = torch.cat([frame_positions(h, w, merge).repeat(t, 1) for t, h, w in grids])
    meta: dict[str, object] = {}
    if position_side:
        taps, weights = zip(
            *(frame_interpolation(h, w, merge, position_side) for _, h, w in grids), strict=True
        )
        meta["interp_taps"] = torch.cat([x.repeat(t, 1) for x, (t, _, _) in zip(taps, grids)])
        meta["interp_weights"] = torch.cat([x.repeat(t, 1) for x, (t, _, _) in zip(weights, grids)])
    if window:
        unit = merge * merge
        index: list[torch.Tensor] = []
        lengths: list[int] = []
        offset = 0  # in merge blocks
        for t, h, w in grids:
            order, lens = frame_windows(h, w, merge, window)
            per_frame = h * w // unit
            for _ in range(t):
                index.append(order + offset)
                lengths.extend(lens)
                offset += per_frame
        window_index = torch.cat(index)
        # NOTE: windows never cross frames, so per-frame full attention stays valid in
        # window order; rotary positions are permuted once here instead of on the device.
        patch_perm = (window_index[:, None] * unit + torch.arange(unit)).reshape(-1)
        positions = positions[patch_perm]
        meta["window_index"] = window_index
        meta["window_reverse"] = torch.argsort(window_index)
        meta["windows"] = varlen_batch(lengths)
    return TowerMetadata(
        grids=grids,
        positions=positions,
        inv_freq=rope_inv_freq(head_dim),
        full=varlen_batch(_frames(grids)),
        **meta,  # type: ignore[arg-type]
    )
