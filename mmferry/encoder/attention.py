"""Variable-length (packed) attention for the vision towers, behind a tiny backend registry.

Sequences (frames, or Qwen2.5-VL windows) are packed back to back in one [N, heads, head_dim]
tensor. Their lengths are host ints, so every split decision is made on the host; the tensors
that say which row belongs to which sequence are derived on the device from `cu_seqlens`, never
read back:
- "sdpa": PyTorch's scaled_dot_product_attention on CPU and GPU, ONE call for the whole batch.
  Sequences of one length are one zero-copy view [count, length]; mixed lengths are gathered
  into [sequences, longest] with a key mask. When that padding would cost more than
  `PAD_COST_LIMIT` times the exact work (one long frame beside many short ones), each *run* of
  equal lengths is one call instead; the encoder orders items so equal frame sizes sit together.
- "flash_attn": flash-attn's varlen kernel (GPU only), imported when first chosen.
- `sdpa_block_diagonal`: one SDPA call over all N rows with a block-diagonal mask; static shapes
  whatever the lengths, so a CUDA graph captured once serves every batch of its token budget.
  Its cost is N^2, which is why budgets that use it are bounded (`graphs.py`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from types import MappingProxyType

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class VarlenBatch:
    """Packed sequence lengths: host runs plus device cu_seqlens for kernels that take them."""

    # (first row, count, length): `count` back-to-back sequences of `length` rows each.
    runs: tuple[tuple[int, int, int], ...]
    cu_seqlens: torch.Tensor  # int32 [num_sequences + 1]
    max_seqlen: int
    total: int

    @property
    def count(self) -> int:
        """Sequences, zero-length ones (padding slots of a captured budget) included."""
        return self.cu_seqlens.shape[0] - 1

    def to(self, device: torch.device) -> VarlenBatch:
        cu = self.cu_seqlens
        if device.type == "cuda":
            cu = cu.pin_memory().to(device, non_blocking=True)
        else:
            cu = cu.to(device)
        return VarlenBatch(self.runs, cu, self.max_seqlen, self.total)


def varlen_batch(lengths: Sequence[int], max_seqlen: int | None = None) -> VarlenBatch:
    """Group packed sequence `lengths` (host ints) into runs of equal length; `max_seqlen`
    overrides the longest length (a captured graph bakes in an upper bound)."""
    runs: list[tuple[int, int, int]] = []
    start = 0
    for n in lengths:
        if n <= 0:
            continue
        if runs and runs[-1][2] == n:
            s, c, _ = runs[-1]
            runs[-1] = (s, c + 1, n)
        else:
            runs.append((start, 1, n))
        start += n
    cu = torch.tensor([0, *lengths], dtype=torch.int64).cumsum(0).to(torch.int32)
    longest = max(lengths, default=0) if max_seqlen is None else max_seqlen
    return VarlenBatch(tuple(runs), cu, longest, start)


AttentionFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, VarlenBatch], torch.Tensor]


def _sdpa_run(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, run: tuple[int, int, int]):
    start, count, length = run
    end = start + count * length
    # [rows, H, D] -> [count, length, H, D] -> [count, H, length, D]; views, no copy.
    qs, ks, vs = (x[start:end].unflatten(0, (count, length)).transpose(1, 2) for x in (q, k, v))
    # [count, H, length, D] -> [count, length, H, D]
    return F.scaled_dot_product_attention(qs, ks, vs).transpose(1, 2)


# Padding a mixed batch to [sequences, longest] is one call, but its work is count * longest**2
# against sum(length**2) for the exact runs; past this ratio the runs win.
PAD_COST_LIMIT = 2.0


def sequence_ids(cu_seqlens: torch.Tensor, total: int) -> torch.Tensor:
    """The sequence of each of `total` packed rows, int64 [total], computed on cu's device."""
    rows = torch.arange(total, device=cu_seqlens.device, dtype=cu_seqlens.dtype)
    return torch.searchsorted(cu_seqlens[1:], rows, right=True)


def _padded_call(q, k, v, batch: VarlenBatch) -> torch.Tensor:
    """One SDPA call over [sequences, longest] with a key mask; rows gathered on the device."""
    n, h, d = q.shape
    s, length = batch.count, batch.max_seqlen
    cu = batch.cu_seqlens.long()
    starts, lens = cu[:-1], cu[1:] - cu[:-1]
    j = torch.arange(length, device=q.device)
    valid = j < lens[:, None]  # [S, L]
    # Slots past a sequence's end read row 0; the mask hides them as keys and no real row
    # reads them back as queries.
    src = torch.where(valid, starts[:, None] + j, 0).flatten()
    qs, ks, vs = (x.index_select(0, src).view(s, length, h, d).transpose(1, 2) for x in (q, k, v))
    out = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=valid[:, None, None, :])
    # Back to packed order: row r is slot (seq r, r - start) of the padded output.
    seq = sequence_ids(batch.cu_seqlens, n)
    slot = seq * length + (torch.arange(n, device=q.device) - starts[seq])
    return out.transpose(1, 2).reshape(s * length, h * d).index_select(0, slot)


def sdpa_varlen(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, batch: VarlenBatch
) -> torch.Tensor:
    """Packed attention in one SDPA call (see the module docstring); q, k, v [N, H, D] ->
    [N, H*D]."""
    n, h, d = q.shape
    if len(batch.runs) == 1:
        return _sdpa_run(q, k, v, batch.runs[0]).reshape(n, h * d)
    exact = sum(count * length**2 for _, count, length in batch.runs)
    if batch.count * batch.max_seqlen**2 <= PAD_COST_LIMIT * exact:
        return _padded_call(q, k, v, batch)
    return sdpa_runs(q, k, v, batch)


def sdpa_runs(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, batch: VarlenBatch
) -> torch.Tensor:
    """Packed attention with one SDPA call per run of equal lengths."""
    n, h, d = q.shape
    out = q.new_empty((n, h, d))
    for run in batch.runs:
        start, count, length = run
        out[start : start + count * length].view(count, length, h, d).copy_(_sdpa_run(q, k, v, run))
    return out.view(n, h * d)


def sdpa_block_diagonal(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, batch: VarlenBatch
) -> torch.Tensor:
    """One SDPA call over all rows, each row seeing only its own sequence: static shapes for
    any lengths (graph capture). q, k, v [N, H, D] -> [N, H*D]."""
    n, h, d = q.shape
    seq = sequence_ids(batch.cu_seqlens, n)
    mask = seq[:, None] == seq[None, :]  # [N, N]
    qs, ks, vs = (x.transpose(0, 1)[None] for x in (q, k, v))  # [1, H, N, D]
    out = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask[None, None])
    return out[0].transpose(0, 1).reshape(n, h * d)


@functools.lru_cache(maxsize=1)
def _flash_varlen_func() -> Callable:
    try:
        from flash_attn import flash_attn_varlen_func
    except ImportError as e:
        raise ValueError(
            "attention='flash_attn' needs the flash-attn package on a CUDA machine "
            "(pip install flash-attn); use attention='sdpa' otherwise"
        ) from e
    return flash_attn_varlen_func


def flash_varlen(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, batch: VarlenBatch
) -> torch.Tensor:
    """Packed attention with flash-attn's varlen kernel; q, k, v [N, H, D] -> [N, H*D]."""
    n, h, d = q.shape
    out = _flash_varlen_func()(
        q, k, v, batch.cu_seqlens, batch.cu_seqlens, batch.max_seqlen, batch.max_seqlen
    )
    return out.reshape(n, h * d)


ATTENTION_BACKENDS: MappingProxyType[str, AttentionFn] = MappingProxyType(
    {"sdpa": sdpa_varlen, "flash_attn": flash_varlen}
)


def get_attention(name: str, device: torch.device) -> AttentionFn:
    """The backend called `name`, checked against `device`; a clear error if unusable."""
    if name not in ATTENTION_BACKENDS:
        raise ValueError(
            f"unknown attention backend {name!r}; choose one of {', '.join(ATTENTION_BACKENDS)}"
        )
    if name == "flash_attn":
        if device.type != "cuda":
            raise ValueError(f"attention='flash_attn' runs on CUDA only, not on {device}")
        _flash_varlen_func()
    return ATTENTION_BACKENDS[name]
