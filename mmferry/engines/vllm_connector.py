"""`MmferryECConnector`: a vLLM encoder-cache consumer that loads rows from `mmferry serve`.

    vllm serve MODEL --ec-transfer-config '{"ec_connector": "MmferryECConnector",
        "ec_connector_module_path": "mmferry.engines.vllm_connector", "ec_role": "ec_consumer",
        "ec_connector_extra_config": {"url": "http://127.0.0.1:8000"}}'

A request names each item by its mmferry hash (the uuid; vLLM keeps it verbatim as the item's
identifier) and may carry only its grid. When vLLM's scheduler meets an item it asks the
service (`/v1/cache/lookup`), which pins what it holds until it is loaded; the worker then loads
all of a step's items in one request (`/v1/cache/load`: shared-memory handles when the service
is on this host, safetensors otherwise), already `[main | ds0 | ds1 ...]` in the model's dtype,
and copies each once onto its device. An item the service lacks, or any lookup that fails
(service down or restarting), is reported absent, and vLLM encodes that item itself, so such a
request must carry pixels too. Extra config: `url`, optional `api_key` (or MMFERRY_API_KEY),
`transport` ("auto" | "shm" | "http"), `timeout_s`.

vLLM loads this module by path in its scheduler and worker processes; importing it without
vLLM installed fails with a message naming what to install.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

import torch

try:
    from vllm.distributed.ec_transfer.ec_connector.base import (
        ECConnectorBase,
        ECConnectorMetadata,
        ECConnectorRole,
    )
except ImportError as e:  # pragma: no cover - depends on the environment
    raise ImportError(
        "mmferry.engines.vllm_connector is loaded by vLLM: pip install vllm (0.32 or later)"
    ) from e

from mmferry.engines.cache_client import CacheClient, ServiceUnavailable  # noqa: E402

log = logging.getLogger("mmferry.vllm_connector")
LOOPBACK = ("127.0.0.1", "::1", "localhost")
# A load the scheduler planned must not fail for a blip: a few tries inside this many seconds.
LOAD_RETRY_S = 5.0


@dataclass
class MmferryECMetadata(ECConnectorMetadata):
    """The items a worker loads this step: identifier -> expected row count."""

    items: dict[str, int] = field(default_factory=dict)


class MmferryECConnector(ECConnectorBase):
    """Encoder-cache consumer backed by an `mmferry serve` endpoint (see the module doc)."""

    def __init__(self, vllm_config: Any, role: ECConnectorRole) -> None:
        super().__init__(vllm_config=vllm_config, role=role)
        if self.is_producer:
            raise ValueError("MmferryECConnector is a consumer: use ec_role 'ec_consumer'")
        extra = vllm_config.ec_transfer_config.ec_connector_extra_config or {}
        url = extra.get("url")
        if not url:
            raise ValueError("MmferryECConnector needs ec_connector_extra_config.url")
        transport = extra.get("transport", "auto")
        if transport not in ("auto", "shm", "http"):
            raise ValueError(f"transport must be auto, shm or http, got {transport!r}")
        local = urlsplit(url).hostname in LOOPBACK
        shm = transport == "shm" or (transport == "auto" and local)
        api_key = extra.get("api_key") or os.environ.get("MMFERRY_API_KEY")
        self._client = CacheClient(url, api_key, float(extra.get("timeout_s", 30.0)), shm)
        self._dtype = vllm_config.model_config.dtype
        # Scheduler: identifiers the service said it holds (pinned there), not yet planned.
        self._present: dict[str, float] = {}
        self._to_load: dict[str, int] = {}
        self._ttl_s = float(extra.get("pin_ttl_s", 60.0))

    # -- scheduler side -------------------------------------------------------------------

    def has_cache_item(self, identifier: str) -> bool:
        now = time.monotonic()
        seen = self._present.get(identifier)
        # NOTE: answered from memory while the service's pin surely holds (half its TTL), so a
        # request waiting for KV space does not ask again on every scheduler pass.
        if seen is not None and now - seen < self._ttl_s / 2:
            return True
        try:
            (present,) = self._client.lookup([identifier])
        except ServiceUnavailable as e:
            log.warning("mmferry service unavailable, vLLM encodes %s itself: %s", identifier, e)
            present = False
        if present:
            self._present[identifier] = now
        else:
            self._present.pop(identifier, None)
        return present

    def update_state_after_alloc(self, request: Any, index: int) -> None:
        identifier = request.mm_features[index].identifier
        if identifier in self._present:
            self._to_load[identifier] = request.get_num_encoder_embeds(index)

    def build_connector_meta(self, scheduler_output: Any) -> MmferryECMetadata:
        meta = MmferryECMetadata(dict(self._to_load))
        for identifier in self._to_load:
            self._present.pop(identifier, None)  # the load takes the pin
        self._to_load.clear()
        return meta

    # -- worker side ----------------------------------------------------------------------

    def _device(self) -> torch.device:
        from vllm.platforms import current_platform

        if current_platform.is_cuda_alike():
            return torch.device(current_platform.device_type, current_platform.current_device())
        return torch.device(current_platform.device_type)

    def start_load_caches(self, encoder_cache: dict[str, torch.Tensor], **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, MmferryECMetadata)
        need = [h for h in meta.items if h not in encoder_cache]
        if not need:
            return
        rows = self._load(need)
        device = self._device()
        for h in need:
            src = rows[h]
            if src.shape[0] != meta.items[h]:
                raise ValueError(
                    f"mmferry service rows for {h} have {src.shape[0]} tokens, vLLM planned "
                    f"{meta.items[h]} (the uuid names other content)"
                )
            # The one copy: out of the shared-memory view (or parsed bytes) onto the device,
            # already in the model dtype; the view, and with it the lease, dies here.
            dst = torch.empty(src.shape, dtype=self._dtype, device=device)
            dst.copy_(src, non_blocking=device.type == "cuda")
            encoder_cache[h] = dst

    def _load(self, hashes: list[str]) -> dict[str, torch.Tensor]:
        deadline = time.monotonic() + LOAD_RETRY_S
        while True:
            try:
                return self._client.load(hashes, self._dtype)
            except ServiceUnavailable as e:
                if time.monotonic() > deadline:
                    # NOTE: vLLM has planned these items as loaded, and the request carries no
                    # way back to encoding them here: fail loudly rather than feed wrong rows.
                    raise RuntimeError(
                        f"mmferry service lost pinned items {hashes} between lookup and load: {e}"
                    ) from None
                time.sleep(0.2)

    def save_caches(self, encoder_cache: dict[str, torch.Tensor], mm_hash: str, **kw) -> None:
        return None  # a consumer: the service is the producer

    def shutdown(self) -> None:
        self._client.close()
