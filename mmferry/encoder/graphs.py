"""Padded batches at fixed token budgets, and CUDA graphs captured once per budget.

`BudgetRunner` pads a batch's patch embeddings and metadata to the smallest budget that holds
them (`budgets.py`), runs the tower body on the padded batch and keeps only the real rows. With
`capture=False` the padded body runs eagerly (on any device: the CPU tests prove the padding
exact). With `capture=True` (CUDA) each budget's body is captured in a CUDA graph the first time
a batch needs it, once per (budget, dtype, device), and replayed: one launch for the whole tower
body instead of one per kernel, which is what a small batch is bound by.

Graph inputs are static buffers: the patch embeddings, positions, learned-position taps,
cu_seqlens of a fixed length per budget (zero-length tails), Qwen2.5-VL's window order. The
patch embedding itself (one matmul per input kind, shapes varying with the mix of kinds) runs
eagerly and writes its rows into the buffer.

Attention inside a graph: flash-attn's varlen kernel when the encoder was built with it, else
SDPA with a block-diagonal mask (`sdpa_block_diagonal`), whose N x N mask and work are why
budgets past `SDPA_GRAPH_MAX` run eagerly with SDPA. All graphs share one memory pool; the
bytes each capture took are recorded (`memory`) and a capture that would pass `memory_limit`
is released and its budget runs eagerly from then on.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
from collections.abc import Callable, Sequence

import torch
from torch import nn

from mmferry.encoder.attention import (
    AttentionFn,
    VarlenBatch,
    flash_varlen,
    sdpa_block_diagonal,
    sdpa_varlen,
)
from mmferry.encoder.budgets import budget_for, check_budgets, pad_metadata
from mmferry.encoder.metadata import TowerMetadata

log = logging.getLogger(__name__)

# SDPA's block-diagonal mask is budget**2 elements and its work budget**2 per head: past 8k
# patches (a 64 MiB mask) the exact eager call is cheaper than the launches a graph saves.
SDPA_GRAPH_MAX = 1 << 13
# Default bound on the memory all captured graphs (their pool and static buffers) may hold.
GRAPH_MEMORY_LIMIT = 8 << 30

Result = tuple[torch.Tensor, list[torch.Tensor]]


@dataclasses.dataclass
class _Graph:
    graph: torch.cuda.CUDAGraph
    x: torch.Tensor  # [budget, hidden]
    meta: TowerMetadata  # static device buffers
    out: Result
    nbytes: int


def _copy_batch(dst: VarlenBatch | None, src: VarlenBatch | None) -> None:
    if dst is not None and src is not None:
        dst.cu_seqlens.copy_(src.cu_seqlens, non_blocking=True)


class BudgetRunner:
    """Runs a tower body on batches padded to token budgets, eagerly or as CUDA graphs."""

    def __init__(
        self,
        tower: nn.Module,
        budgets: Sequence[int],
        *,
        unit: int,
        attention: str,
        capture: bool,
        memory_limit: int = GRAPH_MEMORY_LIMIT,
    ) -> None:
        self.tower = tower
        self.unit = unit
        self.budgets = check_budgets(budgets, unit)
        self.capture = capture
        self.memory_limit = memory_limit
        if attention == "flash_attn":
            self.attend: AttentionFn = flash_varlen
        else:
            self.attend = sdpa_block_diagonal
            if capture:
                self.budgets = tuple(b for b in self.budgets if b <= SDPA_GRAPH_MAX)
        self._graphs: dict[tuple[int, torch.dtype, torch.device], _Graph] = {}
        self._refused: set[int] = set()  # budgets whose capture passed the memory limit
        self._pool = None
        self._lock = threading.Lock()

    @property
    def largest(self) -> int:
        return self.budgets[-1] if self.budgets else 0

    def memory(self) -> dict[int, int]:
        """Bytes each captured budget's graph took (pool growth plus its static buffers)."""
        return {key[0]: g.nbytes for key, g in self._graphs.items()}

    def budget(self, patches: int) -> int | None:
        """The budget this many patches run at, or None: eagerly without padding."""
        b = budget_for(patches, self.budgets)
        return None if b in self._refused else b

    def __call__(
        self,
        embed: Callable[[], torch.Tensor],
        meta: TowerMetadata,
        budget: int,
    ) -> Result:
        """`embed()` gives the batch's [N, hidden] patch embeddings; `meta` is its host
        metadata. Returns the real merged rows and deepstack rows only."""
        n = meta.num_patches
        keep = n // self.unit
        padded = pad_metadata(meta, budget, self.unit)
        if not self.capture:
            x = embed()
            x = torch.cat([x, x.new_zeros((budget - n, x.shape[1]))])
            attend = self.attend
            if attend is sdpa_block_diagonal and budget > SDPA_GRAPH_MAX:
                attend = sdpa_varlen  # no graph to keep shapes static for: skip the N^2 mask
            merged, deep = self.tower.body(x, padded.to(x.device), attend)
            return merged[:keep], [d[:keep] for d in deep]
        with self._lock:
            x = embed()
            g = self._graph(budget, x.dtype, x.device, padded)
            if g is None:
                merged, deep = self.tower.body(x, meta.to(x.device), _eager_attend(self))
                return merged, deep
            self._fill(g, x, padded)
            g.graph.replay()
            merged, deep = g.out
            # The graph's outputs are overwritten by the next replay: the caller gets its own.
            return merged[:keep].clone(), [d[:keep].clone() for d in deep]

    # -- capture ---------------------------------------------------------------------------

    def _fill(self, g: _Graph, x: torch.Tensor, padded: TowerMetadata) -> None:
        n = x.shape[0]
        g.x[:n].copy_(x)
        g.x[n:].zero_()
        m, src = g.meta, padded
        for name in (
            "positions",
            "interp_taps",
            "interp_weights",
            "window_index",
            "window_reverse",
        ):
            dst, s = getattr(m, name), getattr(src, name)
            if dst is not None:
                dst.copy_(s.pin_memory(), non_blocking=True)
        _copy_batch(m.full, src.full)
        _copy_batch(m.windows, src.windows)

    def _graph(
        self, budget: int, dtype: torch.dtype, device: torch.device, padded: TowerMetadata
    ) -> _Graph | None:
        key = (budget, dtype, device)
        if key in self._graphs:
            return self._graphs[key]
        if budget in self._refused:
            return None
        torch.cuda.synchronize(device)
        before = torch.cuda.memory_reserved(device)
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        meta = padded.to(device)
        x = torch.zeros((budget, self.tower.cfg.hidden_size), dtype=dtype, device=device)
        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):  # warm-up: lazy kernel loads and workspaces, not captured
            self.tower.body(x.clone(), meta, self.attend)
        torch.cuda.current_stream(device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        # thread_local: the service's other threads (staging copies, shared-memory readers)
        # keep using CUDA while this one captures; only this thread's calls are checked.
        with torch.cuda.graph(graph, pool=self._pool, capture_error_mode="thread_local"):
            out = self.tower.body(x, meta, self.attend)
        torch.cuda.synchronize(device)
        nbytes = torch.cuda.memory_reserved(device) - before
        used = sum(g.nbytes for g in self._graphs.values())
        if used + nbytes > self.memory_limit:
            log.warning(
                "CUDA graph for %d patches needs %.0f MiB beyond the %.0f MiB held; over the "
                "limit of %.0f MiB, so that budget runs eagerly",
                budget, nbytes / 2**20, used / 2**20, self.memory_limit / 2**20,
            )  # fmt: skip
            self._refused.add(budget)
            del graph, out, meta, x
            torch.cuda.empty_cache()
            return None
        g = _Graph(graph, x, meta, out, nbytes)
        self._graphs[key] = g
        log.info("captured the tower for %d patches (%s): %.0f MiB", budget, dtype, nbytes / 2**20)
        return g


def _eager_attend(runner: BudgetRunner) -> AttentionFn:
    return flash_varlen if runner.attend is flash_varlen else sdpa_varlen
