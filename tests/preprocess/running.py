"""Threads that actually run inside preprocessing jobs at once, measured from the jobs."""

from __future__ import annotations

import threading

import blake3
import torch

from mmferry.preprocess.threads import run_split


class RunningThreads:
    """Threads computing inside jobs at once, each counted with torch's intra-op count on it
    (the threads one of its ops runs on): what actually runs, not the shares handed out."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.now = self.peak = 0
        self.data = bytes(1 << 20)

    def job(self, share: int, hold: threading.Event, hold_s: float) -> int:
        """A job that splits its work over its `share` threads, as an image's gather does,
        each computing until `hold` is set or `hold_s` passed."""

        def work(_start: int, _stop: int) -> None:
            n = torch.get_num_threads()
            with self.lock:
                self.now += n
                self.peak = max(self.peak, self.now)
            try:
                blake3.blake3(self.data).digest()  # releases the GIL: a thread really running
                hold.wait(hold_s)
                blake3.blake3(self.data).digest()
            finally:
                with self.lock:
                    self.now -= n

        run_split(share, share, work)
        return share
