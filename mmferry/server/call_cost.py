"""What one encoder call costs on a CPU tower: a fixed part and a part per patch, measured at start.

A CPU tower runs one call per worker, each on its own cores (batching.py). A short queue split
over idle workers ends sooner, but every call pays its fixed cost once (the tower's Python, its
kernels' set-up, the answer's split): on the tests' tiny checkpoint a call of one 224x224 image
took 1.2 ms of CPU and one of two 1.6-1.9 ms, so two calls of one cost a quarter to a half more
than one call of two, on cores the event loop, preprocessing and the engine share. A real tower
spends seconds of compute on such an image on a CPU against the same millisecond: there every
split pays. `CallCost.shares` splits as far as each further call costs at most `EXTRA` of the
compute; the service measures its encoder's two parts when it starts (`measure`).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

# The CPU a split may add, as a share of the call's compute: one more call is taken when its
# fixed cost is at most this much of the patches' own cost.
EXTRA = 0.1
# A small call (64 patches) taking this long is compute, whatever its fixed part: a tower's
# Python and set-up come to a few milliseconds at most (about 0.1 ms a layer), a tenth of it.
# Such a tower is not timed further (a real one takes seconds a call on a CPU) and splits.
HEAVY_S = 0.05


@dataclass(frozen=True)
class CallCost:
    """CPU seconds of an encoder call: `fixed_s` + `per_patch_s` * patches."""

    fixed_s: float
    per_patch_s: float

    def shares(self, patches: int, most: int) -> int:
        """Into how many calls (1 to `most`) `patches` queued patches may be split, each further
        call's fixed cost at most `EXTRA` of their compute."""
        if self.fixed_s <= 0:
            return most
        worth = 1 + int(EXTRA * self.per_patch_s * patches / self.fixed_s)
        return max(1, min(most, worth))


def measure(
    encode: Callable[[Sequence[Any]], Any],
    small: Sequence[Any],
    large: Sequence[Any],
    patches: tuple[int, int],
    *,
    rounds: int = 3,
) -> CallCost | None:
    """The two parts, from calls on `small` and `large` (items of `patches` patches in all), each
    timed `rounds` times after one untimed call, interleaved, the least CPU of each kept (a
    loaded host only adds); no fixed part where a call on `small` takes `HEAVY_S` or more; None
    when the sizes do not tell the parts apart.

    NOTE: the process's CPU, not the thread's: a worker of several intra-op threads spends its
    compute on threads of torch's own. Sizes of a few dozen patches and more: below that a
    heavy tower's matmuls run far from their speed, which a linear fit would take for a fixed
    cost. Run it before the service takes requests."""
    n_small, n_large = patches
    if n_large <= n_small:
        return None
    encode(small)
    t0 = time.process_time()
    encode(small)
    first = time.process_time() - t0
    if first >= HEAVY_S:
        return CallCost(0.0, first / n_small)
    best = [first, float("inf")]
    encode(large)
    for _ in range(rounds):
        for k, items in enumerate((small, large)):
            t0 = time.process_time()
            encode(items)
            best[k] = min(best[k], time.process_time() - t0)
    per_patch = max(0.0, (best[1] - best[0]) / (n_large - n_small))
    if per_patch == 0.0:  # a clock too coarse for this tower: nothing to weigh a split by
        return None
    return CallCost(max(0.0, best[0] - per_patch * n_small), per_patch)
