"""Work assignment for the data-parallel vision encoder: which rank encodes which frames.

Cost model (estimated FLOPs of one vision block, normalised so one patch's linear work is 1):
- Linear in patches: per patch and layer, qkv + proj are 4*d^2 multiply-adds and the MLP
  2*d*I (fc1/fc2: Qwen2-VL, Qwen3-VL) or 3*d*I (gated: Qwen2.5-VL), d = hidden, I = intermediate
  (the spec's `mlp_matmuls`).
- Quadratic per attention sequence: QK^T and AV are 2*L^2*d multiply-adds for a sequence of L
  patches. Every Qwen-VL tower attends within one frame (transformers builds
  `cu_seqlens = cumsum(repeat_interleave(h*w, t))`), so L = h*w and an item of t frames has t
  sequences. Relative to the linear term this gives `quadratic = 2*d / (4*d^2 + k*d*I)` per L^2.
- Windowed towers (the spec's `windowed`, Qwen2.5-VL) attend fully only in
  `fullatt_block_indexes`; their windowed layers (windows of
  (window_size/patch)^2 patches) are charged as linear work at the window length.
Patch embedding and the mergers are linear in patches and small; they are left out. Attention
kernels run below matmul efficiency, so the quadratic term is, if anything, an underestimate.

Balancing: whole items (largest cost first) go to the least-loaded rank (ties to the lowest rank),
then frame-splittable videos fill the remaining gaps frame by frame; each rank's frames of one
video form one contiguous range. Splitting is
exact because attention, rotary positions and position-embedding interpolation are per frame.
Everything is pure host arithmetic, so every rank computes the same assignment on its own.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from dataclasses import dataclass

from mmferry.config import VisionConfig
from mmferry.models import spec_for


@dataclass(frozen=True)
class CostModel:
    """Estimated encode cost of `t` frames of `h*w` patches: t*(linear*h*w + quadratic*(h*w)^2)."""

    linear: float = 1.0
    quadratic: float = 0.0

    def frame_cost(self, h: int, w: int) -> float:
        n = h * w
        return self.linear * n + self.quadratic * n * n

    def item_cost(self, grid: tuple[int, int, int]) -> float:
        t, h, w = grid
        return t * self.frame_cost(h, w)

    @classmethod
    def patches(cls) -> CostModel:
        """Patch count only: what SGLang and vLLM balance."""
        return cls(linear=1.0, quadratic=0.0)

    @classmethod
    def for_config(cls, cfg: VisionConfig) -> CostModel:
        """FLOP-derived constants for one tower (see the module docstring)."""
        d, inter = cfg.hidden_size, cfg.intermediate_size
        spec = spec_for(cfg.family)
        per_patch = 4 * d * d + spec.mlp_matmuls * d * inter
        quad = 2 * d / per_patch
        if not spec.windowed or not cfg.window_size:
            return cls(linear=1.0, quadratic=quad)
        full = len(cfg.fullatt_block_indexes) / cfg.depth
        window_patches = (cfg.window_size // cfg.patch_size) ** 2
        return cls(linear=1.0 + (1.0 - full) * quad * window_patches, quadratic=full * quad)


@dataclass(frozen=True)
class Shard:
    """Frames [frame_start, frame_stop) of item `item`, encoded by `rank` as one sub-item."""

    item: int
    frame_start: int
    frame_stop: int
    rank: int


@dataclass(frozen=True)
class Assignment:
    """Who encodes what; `shards[r]` in the order rank r encodes (and packs) them."""

    world_size: int
    grids: tuple[tuple[int, int, int], ...]
    merge_size: int
    shards: tuple[tuple[Shard, ...], ...]
    loads: tuple[float, ...]

    def shard_rows(self, s: Shard) -> int:
        """Output rows (merged tokens) of one shard."""
        _, h, w = self.grids[s.item]
        return (s.frame_stop - s.frame_start) * h * w // (self.merge_size**2)

    @property
    def rows(self) -> tuple[int, ...]:
        """Output rows each rank produces."""
        return tuple(sum(self.shard_rows(s) for s in rank) for rank in self.shards)

    @property
    def counts(self) -> tuple[int, ...]:
        return tuple(len(rank) for rank in self.shards)

    @property
    def order(self) -> tuple[int, ...]:
        """Item index of every shard, rank by rank (the peers' `order`)."""
        return tuple(s.item for rank in self.shards for s in rank)

    @property
    def imbalance(self) -> float:
        """max rank load / mean rank load (1.0 is perfect; 1.0 for no work)."""
        total = sum(self.loads)
        return max(self.loads) * self.world_size / total if total else 1.0

    def pieces(self) -> list[list[tuple[int, int, int]]]:
        """Per item, in frame order: (rank, first row in that rank's output, rows)."""
        out: list[list[tuple[int, int, int, int]]] = [[] for _ in self.grids]
        for r, rank in enumerate(self.shards):
            offset = 0
            for s in rank:
                n = self.shard_rows(s)
                out[s.item].append((s.frame_start, r, offset, n))
                offset += n
        return [[p[1:] for p in sorted(item)] for item in out]


def _least_loaded(loads: list[float]) -> int:
    # min() returns the first minimum: ties go to the lowest rank.
    return min(range(len(loads)), key=loads.__getitem__)


def assign_work(
    grids: Sequence[tuple[int, int, int]],
    world_size: int,
    *,
    merge_size: int,
    split_frames: bool = True,
    cost_model: CostModel | None = None,
) -> Assignment:
    """Balance items (and, for videos, contiguous frame ranges) over `world_size` ranks."""
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    if merge_size < 1:
        raise ValueError(f"merge_size must be >= 1, got {merge_size}")
    grids = tuple(tuple(int(x) for x in g) for g in grids)
    for i, g in enumerate(grids):
        if len(g) != 3 or min(g) < 1 or g[1] % merge_size or g[2] % merge_size:
            raise ValueError(
                f"grid {i} = {g} is not a positive (t, h, w) with h, w multiples of {merge_size}"
            )
    model = cost_model or CostModel.patches()
    costs = [model.item_cost(g) for g in grids]
    shards: list[list[Shard]] = [[] for _ in range(world_size)]
    loads = [0.0] * world_size

    def place(item: int, a: int, b: int, r: int) -> None:
        shards[r].append(Shard(item, a, b, r))
        loads[r] += model.frame_cost(grids[item][1], grids[item][2]) * (b - a)

    splittable = [split_frames and world_size > 1 and g[0] > 1 for g in grids]
    by_cost = sorted(range(len(grids)), key=lambda i: (-costs[i], i))
    # Whole items first, largest first, each to the least-loaded rank (LPT).
    for i in by_cost:
        if not splittable[i]:
            place(i, 0, grids[i][0], _least_loaded(loads))
    # Then each video, largest first, fills the gaps frame by frame (a frame to the
    # least-loaded rank, ties to the lowest); each rank's frames become one contiguous range.
    for i in by_cost:
        if not splittable[i]:
            continue
        t, h, w = grids[i]
        per_frame = model.frame_cost(h, w)
        heap = [(load, r) for r, load in enumerate(loads)]
        heapq.heapify(heap)
        frames = [0] * world_size
        for _ in range(t):
            load, r = heapq.heappop(heap)
            frames[r] += 1
            heapq.heappush(heap, (load + per_frame, r))
        a = 0
        for r, k in enumerate(frames):
            if k:
                place(i, a, a + k, r)
                a += k
    return Assignment(
        world_size=world_size,
        grids=grids,
        merge_size=merge_size,
        shards=tuple(tuple(s) for s in shards),
        loads=tuple(loads),
    )
