"""`mmferry serve --store` on the generic family: two services on a tiny GLM-4.1V / Gemma 3
checkpoint share one Mooncake Store; what the first encodes the second answers from the store
without running its tower, byte for byte the first's rows and transformers' own
`get_image_features`; an engine's reader finds them by the identity it computes from the
folder. A Qwen checkpoint served through the generic family and natively keys its rows apart."""

from __future__ import annotations

import io

import pytest
import torch
import transformers
from PIL import Image

from mmferry.server.client import EncoderClient, image_part
from mmferry.store.engine import StoreReader, identity_for
from mmferry.store.entry import ModelIdentity
from mmferry.testing.families import save_family_checkpoint
from tests.engines.tiny_vlm import build_checkpoint, image
from tests.models.test_generic import hf_processor, hf_rows
from tests.server.test_generic_serve import png
from tests.store import cluster
from tests.store.test_shared_serve import identity, metric, same_bytes, wait_for

pytestmark = pytest.mark.slow
# Measured max |service - transformers| was 0.0 (the same kernels, one image per call).
ATOL = 1e-5


def encode(server: cluster.Service, pixels) -> object:
    with EncoderClient(server.url) as c:
        (item,) = c.encode([image_part(png(pixels))])
    return item


def transformers_rows(folder, pixels) -> torch.Tensor:
    """transformers' own rows for the PNG the services are sent (decoded by PIL)."""
    model = transformers.AutoModelForImageTextToText.from_pretrained(folder).eval()
    hf = hf_processor(folder)
    img = Image.open(io.BytesIO(png(pixels))).convert("RGB")
    return hf_rows(model, hf(text=[hf.image_token], images=[img], return_tensors="pt"))


@pytest.fixture(scope="module", params=["glm4v", "gemma3"])
def generic_pool(request, store_cluster, tmp_path_factory):
    folder = save_family_checkpoint(request.param, tmp_path_factory.mktemp(request.param))
    servers = []
    try:
        for _ in range(2):
            servers.append(
                cluster.start_service(["--model", str(folder), "--store", store_cluster.url])
            )
        yield folder, servers
    finally:
        for s in servers:
            s.stop()


def test_second_generic_encoder_takes_the_first_ones_rows(generic_pool, store_cluster):
    folder, (e1, e2) = generic_pool
    # The identity both print is the one an engine's connector computes from the folder.
    assert identity(e1) == identity(e2) == identity_for(str(folder))
    assert identity(e1) == ModelIdentity.of_checkpoint(folder, "generic")
    pixels = image(56, 84, 0)
    first = encode(e1, pixels)
    assert first.deepstack == ()
    wait_for(lambda: metric(e1, "mmferry_store_published") >= 1, "encoder 1's publication")
    encoded = metric(e2, "mmferry_encoded_items")
    second = encode(e2, pixels)
    assert metric(e2, "mmferry_encoded_items") == encoded  # its tower never ran
    assert metric(e2, "mmferry_store_hits") == 1
    assert metric(e2, "mmferry_store_refused") == 0
    assert second.hash == first.hash and second.deepstack == ()
    assert same_bytes(second.embeds, first.embeds)
    want = transformers_rows(folder, pixels)
    assert second.embeds.shape == want.shape
    assert float((second.embeds - want).abs().max()) <= ATOL
    # An engine's reader (vLLM's connector, `transport: mooncake`) finds the rows by the
    # identity it computes from the folder: `[tokens, hidden]`, no deepstack columns.
    n, d = first.embeds.shape
    reader = StoreReader(
        store_cluster.url, identity_for(str(folder)), dtype=torch.float32, hidden=d, deepstack=0
    )
    try:
        assert reader.ready(30), "the reader did not connect"
        assert reader.lookup_pins([first.hash]) == [reader.lease_s]
        rows = reader.load({first.hash: n}, torch.device("cpu"), torch.float32)
        assert same_bytes(rows[first.hash], first.embeds)
    finally:
        reader.close()
    # A new image is a miss on encoder 2, encoded there.
    encode(e2, image(84, 56, 1))
    assert metric(e2, "mmferry_encoded_items") == encoded + 1
    assert metric(e2, "mmferry_store_misses") >= 1


def test_generic_and_native_services_never_read_each_others_rows(store_cluster, tmp_path):
    """One Qwen2.5-VL folder served with `--family generic` and natively, one store: each keys
    its rows by its own identity, so the same image is encoded by each (a miss on both), and
    neither ever takes the other's entry."""
    folder = build_checkpoint("qwen2_5_vl", tmp_path / "qwen")
    base = ["--model", str(folder), "--store", store_cluster.url]
    generic = cluster.start_service([*base, "--family", "generic"])
    native = None
    try:
        native = cluster.start_service(base)
        assert identity(generic) != identity(native)
        assert identity(generic) == identity_for(str(folder), "generic")
        assert identity(native) == identity_for(str(folder))
        pixels = image(56, 84, 3)
        g = encode(generic, pixels)
        wait_for(lambda: metric(generic, "mmferry_store_published") >= 1, "a publication")
        n = encode(native, pixels)
        wait_for(lambda: metric(native, "mmferry_store_published") >= 1, "a publication")
        assert g.embeds.shape == n.embeds.shape
        for server in (generic, native):
            assert metric(server, "mmferry_encoded_items") == 1
            assert metric(server, "mmferry_store_hits") == 0
            assert metric(server, "mmferry_store_refused") == 0
        # Each service's second ask of the image comes from its own cache, and another
        # service of its family takes the entry from the store: the entries are there.
        again = cluster.start_service([*base, "--family", "generic"])
        try:
            assert same_bytes(encode(again, pixels).embeds, g.embeds)
            assert metric(again, "mmferry_store_hits") == 1
            assert metric(again, "mmferry_encoded_items") == 0
        finally:
            again.stop()
    finally:
        generic.stop()
        if native is not None:
            native.stop()
