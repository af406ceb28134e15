"""materialize_features: order, values, dtype, one allocation, no sync (meta), errors."""

from __future__ import annotations

import gc

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from mmferry.feed.materialize import materialize_features
from mmferry.transport.private import clear_cuda_error
from mmferry.transport.shm import ShmArena, open_shared

CUDA = torch.cuda.is_available()
ALLOCATING = {"empty.memory_format", "empty_strided.default", "new_empty.default"}


class OpLog(TorchDispatchMode):
    """Records every aten op and the bytes of every storage an op creates."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []
        self.new_bytes = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        ins = {
            a.untyped_storage().data_ptr()
            for a in torch.utils._pytree.tree_leaves((args, kwargs))
            if isinstance(a, torch.Tensor) and a.device.type != "meta"
        }
        out = func(*args, **kwargs)
        self.ops.append(func.__name__ if hasattr(func, "__name__") else str(func))
        for t in torch.utils._pytree.tree_leaves(out):
            if (
                isinstance(t, torch.Tensor)
                and t.device.type != "meta"
                and t.untyped_storage().data_ptr() not in ins
            ):
                self.new_bytes += t.untyped_storage().nbytes()
        return out


def _wait(cond, timeout: float = 10.0) -> bool:
    import time

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return True
        gc.collect()
        time.sleep(0.01)
    return cond()


def _ref(features, dtype):
    # Independent statement of the result: concatenate in float64, then cast once.
    return torch.cat([f.to(torch.float64) for f in features]).to(dtype)


def test_cpu_fp32_to_bf16_equals_cat():
    g = torch.Generator().manual_seed(0)
    xs = [torch.randn(2, 3, generator=g), torch.randn(3, 3, generator=g)]
    out = materialize_features(xs, device="cpu", dtype=torch.bfloat16)
    assert out.shape == (5, 3) and out.dtype == torch.bfloat16 and out.is_contiguous()
    assert torch.equal(out, torch.cat(xs).to(torch.bfloat16))


def test_mixed_sources_keep_order_values_and_inputs():
    g = torch.Generator().manual_seed(1)
    pageable = torch.randn(4, 6, generator=g)
    half = torch.randn(3, 6, generator=g).to(torch.float16)
    bf = torch.randn(2, 6, generator=g).to(torch.bfloat16)
    u8 = torch.randint(0, 256, (5, 6), generator=g, dtype=torch.uint8)
    strided = torch.randn(6, 3, generator=g).t()  # non-contiguous [3, 6]
    with ShmArena(1 << 20) as arena:
        shm_view = open_shared(arena.put(torch.randn(3, 6, generator=g)))
        feats = [pageable, half, shm_view, bf, u8, strided]
        if CUDA:
            feats.append(torch.randn(2, 6, generator=g).pin_memory())
        before = [f.clone() for f in feats]
        for dtype in (torch.float32, torch.bfloat16, torch.float16):
            out = materialize_features(feats, device="cpu", dtype=dtype)
            assert out.shape == (sum(f.shape[0] for f in feats), 6)
            assert torch.equal(out, _ref(feats, dtype))
        for f, b in zip(feats, before, strict=True):
            assert torch.equal(f, b)
        del shm_view, feats, f
        gc.collect()
        assert arena.reclaim() == 1


def test_uint8_stays_uint8_and_widens_exactly():
    u8 = [
        torch.arange(12, dtype=torch.uint8).view(4, 3),
        torch.full((1, 3), 255, dtype=torch.uint8),
    ]
    out = materialize_features(u8, device="cpu", dtype=torch.uint8)
    assert out.dtype == torch.uint8 and torch.equal(out, torch.cat(u8))
    wide = materialize_features(u8, device="cpu", dtype=torch.float32)
    assert wide[-1, 0].item() == 255.0 and torch.equal(wide, torch.cat(u8).float())


def test_exactly_one_allocation_and_no_temporaries():
    xs = [torch.randn(64, 32) for _ in range(5)] + [torch.randint(0, 9, (7, 32), dtype=torch.uint8)]
    log = OpLog()
    with log:
        out = materialize_features(xs, device="cpu", dtype=torch.bfloat16)
    allocs = [op for op in log.ops if op in ALLOCATING]
    assert allocs == ["empty.memory_format"], log.ops
    assert not {"cat.default", "_to_copy.default", "clone.default"} & set(log.ops)
    assert log.new_bytes == out.untyped_storage().nbytes() == out.numel() * 2


def test_single_ready_input_is_returned_without_copy():
    x = torch.randn(4, 5, dtype=torch.bfloat16)
    log = OpLog()
    with log:
        assert materialize_features([x], device="cpu", dtype=torch.bfloat16) is x
    assert log.ops == []
    # Not ready (wrong dtype / not contiguous): a new tensor, input untouched.
    y = materialize_features([x], device="cpu", dtype=torch.float32)
    assert y.data_ptr() != x.data_ptr() and torch.equal(y, x.float())
    t = torch.randn(5, 4, dtype=torch.bfloat16).t()
    z = materialize_features([t], device="cpu", dtype=torch.bfloat16)
    assert z.is_contiguous() and torch.equal(z, t)


def test_meta_target_runs_every_source_kind():
    # A data-dependent host sync (.item(), .tolist(), nonzero) cannot run on meta: this proves
    # the path has none.
    feats = [
        torch.randn(2, 3),
        torch.randn(1, 3, dtype=torch.bfloat16),
        torch.randint(0, 255, (4, 3), dtype=torch.uint8),
        torch.empty(0, 3),
        torch.empty(2, 3, device="meta"),
    ]
    out = materialize_features(feats, device="meta", dtype=torch.bfloat16)
    assert out.device.type == "meta" and out.shape == (9, 3) and out.dtype == torch.bfloat16


def test_lossy_integer_casts_are_refused_and_exact_ones_pass():
    wide = torch.tensor([[300], [-1]], dtype=torch.int64)
    with pytest.raises(ValueError, match="wrap values"):
        materialize_features([wide], device="cpu", dtype=torch.uint8)  # 300 would become 44
    for src, dst in (
        (torch.int8, torch.uint8),
        (torch.uint8, torch.int8),
        (torch.int32, torch.int16),
    ):
        with pytest.raises(ValueError, match=f"{src}.*lossy integer casts"):
            materialize_features([torch.zeros(1, 2, dtype=src)], device="cpu", dtype=dst)
    with pytest.raises(ValueError, match="wrap"):
        materialize_features([torch.ones(1, 2, dtype=torch.uint8)], device="cpu", dtype=torch.bool)
    # Exact casts: widening integers, bool -> int, any int -> float.
    u8 = torch.tensor([[0, 255]], dtype=torch.uint8)
    assert torch.equal(materialize_features([u8], device="cpu", dtype=torch.int16), u8.short())
    flags = torch.tensor([[True, False]])
    assert materialize_features([flags], device="cpu", dtype=torch.uint8).tolist() == [[1, 0]]
    assert materialize_features([wide], device="cpu", dtype=torch.float64).tolist() == [
        [300.0],
        [-1.0],
    ]


@pytest.mark.parametrize(
    ("features", "dtype", "match"),
    [
        ([], torch.float32, "at least one"),
        ([torch.tensor(1.0)], torch.float32, "0-dim"),
        ([torch.zeros(2, 3), torch.zeros(1, 4)], torch.float32, "trailing shape"),
        ([torch.zeros(2, 3)], torch.uint8, "truncate"),
        ([torch.zeros(2, 3), [[1.0, 2.0, 3.0]]], torch.float32, "not a torch.Tensor"),
        (torch.zeros(2, 3), torch.float32, "sequence of tensors"),
        ([torch.zeros(2, 3)], "float32", "torch.dtype"),
    ],
)
def test_bad_input_raises_clear_value_error(features, dtype, match):
    with pytest.raises(ValueError, match=match):
        materialize_features(features, device="cpu", dtype=dtype)


# --- CUDA paths (pinned staging, direct DMA, device-side widening) ----------------------------


@pytest.mark.skipif(not CUDA, reason="needs CUDA")
def test_cuda_mixed_sources_no_sync_and_small_chunks():
    from mmferry.feed.pinned import PinnedStaging

    g = torch.Generator().manual_seed(2)
    staging = PinnedStaging("cuda", chunk_bytes=4096, num_chunks=2)  # forces many chunks
    feats = [
        torch.randn(300, 24, generator=g),  # pageable fp32 -> host cast
        torch.randn(100, 24, generator=g).pin_memory(),  # pinned fp32 -> host cast
        torch.randn(50, 24, generator=g).to(torch.bfloat16).pin_memory(),  # direct DMA
        torch.randint(0, 256, (200, 24), generator=g, dtype=torch.uint8),  # device widening
        torch.randint(0, 256, (90, 24), generator=g, dtype=torch.uint8).pin_memory(),
        torch.randn(40, 24, generator=g).cuda(),  # a CPU generator draws on the CPU
        torch.randn(30, 24, generator=g).to(torch.bfloat16).cuda(),
    ]
    before = [f.clone() for f in feats]
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        out = materialize_features(feats, device="cuda", dtype=torch.bfloat16, staging=staging)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    staging.drain()
    ref = _ref([f.cpu() for f in feats], torch.bfloat16)
    assert out.device.type == "cuda" and torch.equal(out.cpu(), ref)
    for f, b in zip(feats, before, strict=True):
        assert torch.equal(f.cpu(), b.cpu())


@pytest.mark.skipif(not CUDA, reason="needs CUDA")
def test_cuda_one_output_sized_allocation():
    xs = [torch.randn(256, 512) for _ in range(4)]
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    out = materialize_features(xs, device="cuda", dtype=torch.bfloat16)
    torch.cuda.synchronize()
    out_bytes = out.numel() * 2
    assert torch.cuda.max_memory_allocated() - base <= out_bytes * 1.05
    assert torch.equal(out.cpu(), torch.cat(xs).to(torch.bfloat16))


def _busy_stream(cycles: int = 1 << 30) -> None:
    # Queue a kernel that spins for `cycles` GPU clocks (about half a second) on the current
    # stream, so copies issued after it cannot have completed when the test looks.
    torch.cuda._sleep(cycles)


@pytest.mark.skipif(not CUDA, reason="needs CUDA")
def test_cuda_pinned_shm_view_lease_held_until_copy_done_then_released_without_another_call():
    from mmferry.feed.pinned import PinnedStaging

    staging = PinnedStaging("cuda")
    with ShmArena(64 << 20) as arena:
        src = torch.randn(4096, 1024).to(torch.bfloat16)
        view = open_shared(arena.put(src), pin=True)
        assert view.is_pinned()
        _busy_stream()
        out = materialize_features([view], device="cuda", dtype=torch.bfloat16, staging=staging)
        del view
        gc.collect()
        assert staging.pending == 1 and arena.reclaim() == 0  # the DMA may still read the slot
        torch.cuda.synchronize()
        # No further staging call: the lease ends because the copy completed.
        assert _wait(lambda: arena.reclaim() == 1)
        assert staging.pending == 0 and torch.equal(out.cpu(), src)


@pytest.mark.skipif(not CUDA, reason="needs CUDA")
def test_cuda_dropped_staging_keeps_in_flight_sources_alive():
    from mmferry.feed.pinned import PinnedStaging

    staging = PinnedStaging("cuda")
    with ShmArena(64 << 20) as arena:
        src = torch.randn(2048, 1024).to(torch.bfloat16)
        view = open_shared(arena.put(src), pin=True)
        _busy_stream()
        out = materialize_features([view], device="cuda", dtype=torch.bfloat16, staging=staging)
        del view, staging  # as when the per-thread cache evicts it
        gc.collect()
        assert arena.reclaim() == 0
        torch.cuda.synchronize()
        assert _wait(lambda: arena.reclaim() == 1)
        assert torch.equal(out.cpu(), src)


@pytest.mark.skipif(not CUDA, reason="needs CUDA")
def test_cuda_host_waits_are_counted_only_when_a_call_outgrows_the_ring():
    from mmferry.feed.pinned import PinnedStaging

    staging = PinnedStaging("cuda", chunk_bytes=64 << 10, num_chunks=2)
    fits = [torch.randn(100, 64)]  # 25.6 KB as bf16: one chunk
    _busy_stream()
    materialize_features(fits, device="cuda", dtype=torch.bfloat16, staging=staging)
    assert staging.host_waits == 0
    torch.cuda.synchronize()
    big = [torch.randn(4000, 64)]  # 512 KB as bf16: 8 chunks through a ring of 2
    _busy_stream()
    out = materialize_features(big, device="cuda", dtype=torch.bfloat16, staging=staging)
    assert staging.host_waits >= 1  # refilled a chunk whose copy was queued behind the kernel
    torch.cuda.synchronize()
    assert torch.equal(out.cpu(), big[0].to(torch.bfloat16))


def _private_mappings(segment: str) -> list[str]:
    with open("/proc/self/maps") as f:
        lines = [line.split() for line in f]
    return [
        " ".join(p) for p in lines if len(p) > 5 and p[5] == "/dev/shm" + segment and p[1][3] == "p"
    ]


@pytest.mark.skipif(not CUDA, reason="needs CUDA")
def test_cuda_registration_ends_with_the_mapping():
    with ShmArena(8 << 20) as arena:
        h = arena.put(torch.randn(1024, 256))
        assert h.offset == arena._data_offset  # the first slot starts the registered mapping
        view = open_shared(h, pin=True)
        assert view.is_pinned()
        ptr = view.data_ptr()
        assert _private_mappings(h.segment)  # the view's own copy-on-write mapping
        del view
        gc.collect()
        # NOTE: the producer's and the attachment's shared mappings of the segment stay; the
        # view's private one must be gone.
        assert not _private_mappings(h.segment)
        # Unregistering again must fail: a registration left behind would still succeed here.
        assert int(torch.cuda.cudart().cudaHostUnregister(ptr)) != 0
        clear_cuda_error()  # else torch raises the refusal from a later test's first launch
