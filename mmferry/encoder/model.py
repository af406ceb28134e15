"""`VisionEncoder`: the public face of the vision towers.

`enc(items)` takes preprocessed items of either layout on any device, packs each input kind onto
the encoder's device in one step, runs ONE tower forward for the whole batch and returns one
`VisionOutput` per item in input order (row views of the batch output, no copies).

`cuda_graphs=True` (CUDA only) pads each batch to a token budget and replays that budget's
captured graph (`graphs.py`); `token_budgets` alone pads without capture (any device).
"""

from __future__ import annotations

import operator
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from mmferry.config import VisionConfig
from mmferry.encoder.attention import get_attention
from mmferry.encoder.budgets import token_budgets as default_budgets
from mmferry.encoder.graphs import GRAPH_MEMORY_LIMIT, BudgetRunner
from mmferry.encoder.layers import INPUT_KINDS, InputKind
from mmferry.encoder.loader import assign_state, iter_vision_tensors
from mmferry.encoder.output import VisionOutput
from mmferry.feed.materialize import materialize_features
from mmferry.items import MultimodalItem
from mmferry.models import load_model_config, spec_for

if TYPE_CHECKING:
    from mmferry.encoder.generic import GenericVisionEncoder


def _random_state(tower: nn.Module, seed: int, dtype: torch.dtype, device: torch.device):
    gen = torch.Generator().manual_seed(seed)
    for key, ref in tower.state_dict().items():
        # Seeded on the CPU so every device gets the same weights for the same seed.
        noise = torch.randn(ref.shape, generator=gen, dtype=torch.float32) * 0.02
        if ref.dim() == 1 and key.endswith("weight"):
            noise += 1.0  # norm scales around one
        yield key, noise.to(device=device, dtype=dtype)


class VisionEncoder:
    """A checkpoint-compatible Qwen-VL vision tower that encodes `MultimodalItem`s."""

    # Capabilities the pipeline asks for instead of class names.
    moves_own_inputs = True
    accepted_layouts = ("hf", "compact-u8")

    def __init__(
        self,
        tower: nn.Module,
        config: VisionConfig,
        *,
        device: torch.device | str,
        dtype: torch.dtype,
        attention: str,
        mean_std: tuple[Sequence[float], Sequence[float], Sequence[float], Sequence[float]],
        random_weights: bool = False,
        cuda_graphs: bool = False,
        token_budgets: Sequence[int] | None = None,
        graph_memory_limit: int = GRAPH_MEMORY_LIMIT,
    ) -> None:
        self.tower = tower.eval()
        self.config = config
        self.device = torch.device(device)
        self.dtype = dtype
        self.attention = attention
        self.random_weights = random_weights
        self._attend = get_attention(attention, self.device)
        if cuda_graphs and self.device.type != "cuda":
            raise ValueError(f"cuda_graphs=True needs a CUDA device, not {self.device}")
        self.cuda_graphs = cuda_graphs
        self._budgets: BudgetRunner | None = None
        if cuda_graphs or token_budgets is not None:
            self._budgets = BudgetRunner(
                tower,
                default_budgets() if token_budgets is None else token_budgets,
                unit=config.spatial_merge_size**2,
                attention=attention,
                capture=cuda_graphs,
                memory_limit=graph_memory_limit,
            )
        with torch.inference_mode(False), torch.no_grad():
            tower.patch_embed.fold_compact(*mean_std)

    # -- construction ---------------------------------------------------------------------

    @classmethod
    def from_pretrained(
        cls,
        model_dir: str | Path,
        *,
        device: torch.device | str = "cpu",
        dtype: torch.dtype = torch.float32,
        attention: str = "sdpa",
        family: str | None = None,
        **options: Any,
    ) -> VisionEncoder | GenericVisionEncoder:
        """Load only the vision tower of a local checkpoint folder: mmferry's own tower for a
        family it has a spec for; else, or with `family="generic"`, the model's transformers
        vision path (`GenericVisionEncoder`). `options`: `cuda_graphs`, `token_budgets`,
        `graph_memory_limit` (see `__init__`; mmferry's own towers only)."""
        from mmferry.models.generic import uses_generic

        if uses_generic(model_dir, family):
            from mmferry.encoder.generic import GenericVisionEncoder

            if options:
                raise ValueError(f"{', '.join(options)}: not for the generic family's encoder")
            return GenericVisionEncoder.from_pretrained(
                model_dir, device=device, dtype=dtype, attention=attention
            )
        mc = load_model_config(model_dir)
        spec = spec_for(mc.model_type)
        device = torch.device(device)
        with torch.device("meta"):
            tower = spec.tower(mc.vision)
        assign_state(tower, iter_vision_tensors(model_dir, spec, device=device, dtype=dtype))
        p = mc.processor
        return cls(
            tower,
            mc.vision,
            device=device,
            dtype=dtype,
            attention=attention,
            mean_std=(p.image_mean, p.image_std, p.video_mean, p.video_std),
            **options,
        )

    @classmethod
    def random(
        cls,
        model: str = "qwen3-vl",
        *,
        seed: int = 0,
        device: torch.device | str = "cpu",
        dtype: torch.dtype = torch.float32,
        config: VisionConfig | None = None,
        attention: str = "sdpa",
        **options: Any,
    ) -> VisionEncoder:
        """A tower with the real architecture and SEEDED RANDOM weights (not a checkpoint)."""
        if config is None:
            try:
                config = spec_for(model).random_config
            except ValueError as e:
                raise ValueError(f"unknown model {model!r}: {e}") from None
        spec = spec_for(config.family)
        device = torch.device(device)
        with torch.device("meta"):
            tower = spec.tower(config)
        if device.type != "meta":
            assign_state(tower, _random_state(tower, seed, dtype, device))
        else:
            tower.to(dtype)
        p = spec.processor
        return cls(
            tower,
            config,
            device=device,
            dtype=dtype,
            attention=attention,
            mean_std=(p.image_mean, p.image_std, p.video_mean, p.video_std),
            random_weights=True,
            **options,
        )

    # -- facts ----------------------------------------------------------------------------

    @property
    def out_hidden_size(self) -> int:
        return self.config.out_hidden_size

    @property
    def num_deepstack(self) -> int:
        return len(self.config.deepstack_visual_indexes)

    def __repr__(self) -> str:
        c = self.config
        weights = "RANDOM WEIGHTS (seeded, not a checkpoint)" if self.random_weights else "loaded"
        return (
            f"VisionEncoder({c.family}, depth={c.depth}, hidden={c.hidden_size}, "
            f"out_hidden={c.out_hidden_size}, deepstack={self.num_deepstack}, "
            f"device={self.device}, dtype={self.dtype}, attention={self.attention}, "
            f"cuda_graphs={self.cuda_graphs}, {weights})"
        )

    # -- encoding -------------------------------------------------------------------------

    def _kind(self, layout: str, modality: str | None, width: int) -> InputKind:
        """The patch-embedding input kind (layout, modality) of feature rows `width` wide."""
        c = self.config
        patch = c.in_channels * c.patch_size**2
        full = patch * c.temporal_patch_size
        if layout == "hf":
            # Both modalities carry all T copies, so one weight serves them.
            kind, want = ("hf", None), full
        elif layout == "compact-u8":
            if modality is None:  # a packed tensor: the width says which
                modality = "image" if width == patch else "video"
            kind, want = (layout, modality), patch if modality == "image" else full
        else:
            raise ValueError(f"layout must be one of {self.accepted_layouts}, got {layout!r}")
        if width != want:
            raise ValueError(
                f"{layout} {modality or 'feature'} rows have {width} columns; this tower expects "
                f"{want} (C={c.in_channels}, T={c.temporal_patch_size}, P={c.patch_size})"
            )
        return kind

    def graph_memory(self) -> dict[int, int]:
        """Bytes of device memory each captured token budget's CUDA graph holds."""
        return {} if self._budgets is None else self._budgets.memory()

    def _run(self, segments, grids) -> tuple[torch.Tensor, list[torch.Tensor]]:
        host = self.tower.metadata(grids)
        budget = None if self._budgets is None else self._budgets.budget(host.num_patches)
        with torch.inference_mode():
            if budget is None:  # no budgets, or past the largest: eager, unpadded
                return self.tower(segments, host.to(self.device), self._attend)
            return self._budgets(lambda: self.tower.patch_embed(segments), host, budget)

    def _split(self, merged, deepstack, grids) -> list[VisionOutput]:
        unit = self.config.spatial_merge_size**2
        sizes = [t * h * w // unit for t, h, w in grids]
        rows = merged.split(sizes)
        taps = [d.split(sizes) for d in deepstack]
        return [VisionOutput(rows[i], tuple(tap[i] for tap in taps)) for i in range(len(sizes))]

    def __call__(self, items: Sequence[MultimodalItem]) -> list[VisionOutput]:
        """Encode items (any layout, any device) in one forward; outputs in input order."""
        if not items:
            return []
        merge = self.config.spatial_merge_size
        kinds = []
        for i, item in enumerate(items):
            if item.merge_size != merge:
                raise ValueError(f"item {i} has merge_size {item.merge_size}, tower uses {merge}")
            kinds.append(self._kind(item.layout, item.modality, item.feature.shape[1]))
        # Kinds in blocks (one patch-embed matmul each); equal frame sizes side by side so
        # attention batches them (see attention.py).
        order = sorted(
            range(len(items)),
            key=lambda i: (
                INPUT_KINDS.index(kinds[i]),
                items[i].grid_thw[1] * items[i].grid_thw[2],
            ),
        )
        segments = []
        for kind in INPUT_KINDS:
            feats = [items[i].feature for i in order if kinds[i] == kind]
            if feats:
                dtype = self.dtype if kind[0] == "hf" else torch.uint8
                segments.append(
                    (kind, materialize_features(feats, device=self.device, dtype=dtype))
                )
        grids = [items[i].grid_thw for i in order]
        outs = self._split(*self._run(segments, grids), grids)
        result: list[VisionOutput] = [outs[0]] * len(items)
        for pos, i in enumerate(order):
            result[i] = outs[pos]
        return result

    def _check_grids(self, grid_thw: Sequence[Sequence[int]]) -> list[tuple[int, int, int]]:
        """Grids as int triples, checked before anything is allocated for them."""
        merge = self.config.spatial_merge_size
        grids = []
        for i, g in enumerate(grid_thw):
            g = tuple(g)
            if len(g) != 3:
                raise ValueError(f"grid_thw[{i}] = {g} must have three entries (t, h, w)")
            try:
                # operator.index takes ints of any kind (numpy too) and refuses floats and bools.
                g = tuple(operator.index(v) for v in g if not isinstance(v, bool))
            except TypeError:
                g = ()
            if len(g) != 3:
                raise ValueError(f"grid_thw[{i}] = {tuple(grid_thw[i])} must hold integers")
            if min(g) < 1:
                raise ValueError(f"grid_thw[{i}] = {g} must be positive")
            if g[1] % merge or g[2] % merge:
                raise ValueError(
                    f"grid_thw[{i}] = {g}: h and w must be multiples of the merge size {merge}"
                )
            grids.append(g)
        return grids

    def forward_packed(
        self,
        pixel_values: torch.Tensor,
        grid_thw: torch.Tensor | Sequence[Sequence[int]],
        *,
        layout: str = "hf",
    ) -> list[VisionOutput]:
        """Encode one packed tensor of rows for `grid_thw` (pass grids on the host: a CUDA
        tensor costs one sync to read). Compact-u8 widths C*P*P / C*T*P*P mean images / videos."""
        grids = self._check_grids(grid_thw.tolist() if torch.is_tensor(grid_thw) else grid_thw)
        if not grids:
            return []
        rows = sum(t * h * w for t, h, w in grids)
        if pixel_values.dim() != 2 or pixel_values.shape[0] != rows:
            raise ValueError(
                f"pixel_values of shape {tuple(pixel_values.shape)} does not hold the "
                f"{rows} patch rows of grid_thw"
            )
        kind = self._kind(layout, None, pixel_values.shape[1])
        is_hf = kind[0] == "hf"
        if is_hf != pixel_values.is_floating_point():
            raise ValueError(
                f"{layout} pixel_values must be {'floating point' if is_hf else 'uint8'}, "
                f"got {pixel_values.dtype}"
            )
        if kind == ("compact-u8", "image") and any(t != 1 for t, _, _ in grids):
            raise ValueError("compact-u8 image rows need grid_t == 1 for every item")
        x = pixel_values.to(self.device, non_blocking=True)
        return self._split(*self._run([(kind, x)], grids), grids)
