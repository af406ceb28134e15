"""Variable-length (packed) attention for the vision towers, behind a tiny backend registry.

Sequences (frames, or Qwen2.5-VL windows) are packed back to back in one [N, heads, head_dim]
tensor. Their lengths are host ints, so every split decision is made on the host:
- "sdpa": PyTorch's scaled_dot_product_attention on CPU and GPU. Consecutive sequences of equal
  length form a *run* that is one batched call on a zero-copy view; the encoder orders items so
  equal frame sizes sit together. No mask, no padding, no per-sequence host round trip.
- "flash_attn": flash-attn's varlen kernel (GPU only), imported when first chosen.
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

    def to(self, device: torch.device) -> VarlenBatch:
        cu = self.cu_seqlens
        if device.type == "cuda":
            cu = cu.pin_memory().to(device, non_blocking=True)
        else:
            cu = cu.to(device)
        return VarlenBatch(self.runs, cu, self.max_seqlen, self.total)


def varlen_batch(lengths: Sequence[int]) -> VarlenBatch:
    """Group packed sequence `lengths` (host ints) into runs of equal length."""
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
    return VarlenBatch(tuple(runs), cu, max(lengths, default=0), start)


AttentionFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, VarlenBatch], torch.Tensor]


def _sdpa_run(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, run: tuple[int, int, int]):
    start, count, length = run
    end = start + count * length
    # [rows, H, D] -> [count, length, H, D] -> [count, H, length, D]; views, no copy.
    qs, ks, vs = (x[start:end].unflatten(0, (count, length)).transpose(1, 2) for x in (q, k, v))
    # [count, H, length, D] -> [count, length, H, D]
    return F.scaled_dot_product_attention(qs, ks, vs).transpose(1, 2)


def sdpa_varlen(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, batch: VarlenBatch
) -> torch.Tensor:
    """Packed attention with one SDPA call per run; q, k, v [N, H, D] -> [N, H*D]."""
    n, h, d = q.shape
    if len(batch.runs) == 1:
        return _sdpa_run(q, k, v, batch.runs[0]).reshape(n, h * d)
    out = q.new_empty((n, h, d))
    for run in batch.runs:
        start, count, length = run
        out[start : start + count * length].view(count, length, h, d).copy_(_sdpa_run(q, k, v, run))
    return out.view(n, h * d)


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
