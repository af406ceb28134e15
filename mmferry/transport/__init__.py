"""transport stage of mmferry: features between processes (shared memory, a bounded device pool)."""

from __future__ import annotations

from mmferry._exports import lazy_exports

_EXPORTS: dict[str, str] = {
    "ShmArena": "mmferry.transport.shm",
    "ShmHandle": "mmferry.transport.shm",
    "ArenaFullError": "mmferry.transport.shm",
    "ShmSpaceError": "mmferry.transport.segment",
    "open_shared": "mmferry.transport.shm",
    "FeaturePool": "mmferry.transport.pool",
    "PoolHandle": "mmferry.transport.pool",
    "HostBacking": "mmferry.transport.pool",
    "CudaBacking": "mmferry.transport.pool",
    "open_feature": "mmferry.transport.pool",
    "ack": "mmferry.transport.pool",
    "settle_acks": "mmferry.transport.pool",
}

__all__ = list(_EXPORTS)
__getattr__ = lazy_exports(__name__, _EXPORTS)
