"""`PinnedStaging`: a bounded, reusable pinned host ring for host->device feature copies.

Pageable host memory cannot be read by an asynchronous DMA, so rows pass through pinned
chunks. Two (or more) chunks alternate: the host fills one while the previous one is being
copied; a CUDA event per chunk guards its reuse until the copy reading it has completed.

Host waits: a call that stages more chunks than the ring holds must wait, on the host, for the
copy that last read a chunk before refilling it. That wait is counted (`host_waits`); calls
that fit in the ring, pinned sources and device sources never wait.

Sources read by copies in flight (shared-memory views, whose leases they hold) are kept by a
retiring thread until the event after those copies has fired, then dropped at once: leases end
when the copy completes, not at the next call, and survive the staging object itself.
"""

from __future__ import annotations

import atexit
import functools
import queue
import threading
import weakref
from collections.abc import Sequence

import torch


class PinnedStaging:
    """Pinned chunks plus a device scratch chunk, for one CUDA device; not thread-safe."""

    def __init__(
        self, device: torch.device | str, *, chunk_bytes: int = 8 << 20, num_chunks: int = 2
    ) -> None:
        if chunk_bytes <= 0 or num_chunks < 2:
            raise ValueError("chunk_bytes must be > 0 and num_chunks >= 2 (double buffering)")
        self.device = torch.device(device)
        self.chunk_bytes = chunk_bytes
        self.num_chunks = num_chunks
        self._host = torch.empty(num_chunks * chunk_bytes, dtype=torch.uint8, pin_memory=True)
        self._events: list[torch.cuda.Event | None] = [None] * num_chunks
        self._next = 0
        self._scratch: torch.Tensor | None = None
        self._scratch_event: torch.cuda.Event | None = None
        self.host_waits = 0  # chunk refills that found their previous copy still running
        # (event, sources) of copies in flight, retired by a thread that holds the sources
        # until the event fires. NOTE: the thread holds the queue, not this object, so an
        # evicted or dropped staging object still keeps every in-flight source alive.
        self._retiring: queue.Queue = queue.Queue()
        self._retirer: threading.Thread | None = None

    @property
    def pending(self) -> int:
        """Batches of sources still held for copies that have not completed."""
        return self._retiring.unfinished_tasks

    def _chunk(self) -> tuple[int, torch.Tensor]:
        i = self._next
        self._next = (i + 1) % self.num_chunks
        event = self._events[i]
        if event is not None and not event.query():
            # NOTE: the one host wait (see the module docstring): only for the copy that last
            # read this chunk, issued num_chunks chunks ago, and counted.
            self.host_waits += 1
            event.synchronize()
        return i, self._host[i * self.chunk_bytes : (i + 1) * self.chunk_bytes]

    def _mark(self, i: int, stream: torch.cuda.Stream) -> None:
        event = torch.cuda.Event()
        event.record(stream)
        self._events[i] = event

    def _device_scratch(self, stream: torch.cuda.Stream) -> torch.Tensor:
        if self._scratch is None:
            self._scratch = torch.empty(self.chunk_bytes, dtype=torch.uint8, device=self.device)
        elif self._scratch_event is not None:
            stream.wait_event(self._scratch_event)  # device-side ordering, no host wait
        return self._scratch

    def _hold(self, event: torch.cuda.Event, keep: tuple[torch.Tensor, ...]) -> None:
        if self._retirer is None:
            self._retirer = threading.Thread(
                target=_retire, args=(self._retiring,), name="mmferry-staging-retire", daemon=True
            )
            _RETIRERS[self._retirer] = self._retiring
            self._retirer.start()
            weakref.finalize(self, self._retiring.put, None)  # the thread drains, then exits
        self._retiring.put((event, keep))

    def drain(self) -> None:
        """Wait until every copy issued through this object completed and its sources dropped."""
        self._retiring.join()

    def copy_rows(self, out: torch.Tensor, features: Sequence[torch.Tensor]) -> None:
        """Copy `features` row-wise into `out` (a CUDA tensor), casting on the way."""
        stream = torch.cuda.current_stream(out.device)
        keep: list[torch.Tensor] = []
        used_scratch = False
        used_chunks = False
        o = 0
        for f in features:
            n = f.shape[0]
            dst = out[o : o + n]
            o += n
            if n == 0:
                continue
            if f.device.type == "cuda":
                # Device to device: one kernel moves and casts.
                dst.copy_(f, non_blocking=True)
                continue
            direct = f.is_contiguous() and f.is_pinned()
            if direct and f.dtype == out.dtype:
                dst.copy_(f, non_blocking=True)  # DMA straight from pinned (or shm-pinned) rows
                keep.append(f)
            elif f.element_size() >= out.element_size():
                self._host_cast(dst, f, stream)
                used_chunks = True
            else:
                self._device_cast(dst, f, stream, direct)
                used_scratch = True
                used_chunks |= not direct
                if direct:
                    keep.append(f)
        event = torch.cuda.Event()
        event.record(stream)
        if used_scratch:
            self._scratch_event = event
            keep.append(self._scratch)  # device scratch read by kernels still queued
        if used_chunks:
            keep.append(self._host)  # pinned chunks read by DMAs still queued
        if keep:
            self._hold(event, tuple(keep))

    def _rows_per_chunk(self, f: torch.Tensor, dtype: torch.dtype) -> int:
        row_bytes = max(1, f[0].numel()) * dtype.itemsize
        return self.chunk_bytes // row_bytes

    def _host_cast(self, dst: torch.Tensor, f: torch.Tensor, stream: torch.cuda.Stream) -> None:
        # Narrowing (or same-size) cast: done on the host while filling the pinned chunk, so
        # only output-dtype bytes cross PCIe and the device needs no temporary.
        k = self._rows_per_chunk(f, dst.dtype)
        if k == 0:
            dst.copy_(f)  # a single row larger than a chunk: let torch stage it
            return
        for r in range(0, f.shape[0], k):
            rows = f[r : r + k]
            i, chunk = self._chunk()
            stage = chunk[: rows.numel() * dst.element_size()].view(dst.dtype).view(rows.shape)
            stage.copy_(rows)  # fused host-side cast into pinned memory
            dst[r : r + k].copy_(stage, non_blocking=True)
            self._mark(i, stream)

    def _device_cast(
        self, dst: torch.Tensor, f: torch.Tensor, stream: torch.cuda.Stream, direct: bool
    ) -> None:
        # Widening cast (e.g. compact uint8 -> bf16): ship the narrow source bytes, cast on the
        # device through one bounded scratch chunk reused in stream order.
        k = self._rows_per_chunk(f, f.dtype)
        if k == 0:
            dst.copy_(f)
            return
        scratch = self._device_scratch(stream)
        for r in range(0, f.shape[0], k):
            rows = f[r : r + k]
            dev = scratch[: rows.numel() * f.element_size()].view(f.dtype).view(rows.shape)
            if direct:
                dev.copy_(rows, non_blocking=True)
            else:
                i, chunk = self._chunk()
                stage = chunk[: rows.numel() * f.element_size()].view(f.dtype).view(rows.shape)
                stage.copy_(rows)
                dev.copy_(stage, non_blocking=True)
                self._mark(i, stream)
            dst[r : r + k].copy_(dev)  # the cast kernel


# Running retirers and their queues, stopped before the interpreter finalizes.
_RETIRERS: dict[threading.Thread, queue.Queue] = {}


@atexit.register
def _stop_retirers() -> None:
    # NOTE: a retirer still alive while the interpreter finalizes ends inside torch's thread
    # teardown and aborts the process ("terminate called without an active exception", seen on
    # CUDA); each one finishes its copies and exits first.
    for thread, pending in list(_RETIRERS.items()):
        pending.put(None)
        thread.join(timeout=60)


def _retire(pending: queue.Queue) -> None:
    while True:
        item = pending.get()
        if item is None:
            pending.task_done()
            _RETIRERS.pop(threading.current_thread(), None)
            return
        event, keep = item
        # Off the caller's thread (the GIL is released while it waits): sources are dropped,
        # and their leases end, as soon as the copies reading them have completed.
        event.synchronize()
        del item, keep
        pending.task_done()


@functools.lru_cache(maxsize=16)
def _staging(device: str, thread: int) -> PinnedStaging:
    return PinnedStaging(device)


def staging_for(device: torch.device) -> PinnedStaging:
    """The calling thread's default staging pool for `device`."""
    return _staging(str(device), threading.get_ident())
