"""A vLLM encoder-cache consumer with `MmferryECConnector`, fed by a real `mmferry serve`.

Requests carry only each item's grid (and Qwen3-VL video timestamps) and its mmferry hash (the
uuid); vLLM neither preprocesses nor encodes them, and still generates what it generates from
the pixels (images) or from the same rows handed over inline (an image and a video). A hash
the service lacks, or a service that is down, makes vLLM encode the item itself; nothing hangs.
The consumer runs vLLM's engine core in its own process (vLLM's default), so the connector is
imported there by module path, as in a deployment.
"""

from __future__ import annotations

import io
import json

import httpx
import pytest
from PIL import Image

from mmferry.engines.vllm import to_vllm, to_vllm_refs
from mmferry.server.client import EncoderClient, image_part, video_part
from mmferry.testing.ports import free_port
from tests.engines.cases import cases, pixel_request
from tests.engines.conftest import start_engines
from tests.engines.service import Service
from tests.engines.tiny_vlm import VIDEO_FPS, image

pytestmark = pytest.mark.slow
LOGPROB_ATOL = 1e-4
CASES = ("images", "same_twice")


def png(pixels) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, format="PNG")
    return buf.getvalue()


def mp4(frames, fps: float) -> bytes:
    """The clip as a small MPEG-4 file (lossy: the comparison is of the service's own rows)."""
    import av

    buf = io.BytesIO()
    with av.open(buf, "w", format="mp4") as out:
        stream = out.add_stream("mpeg4", rate=int(fps))
        stream.width, stream.height = frames.shape[2], frames.shape[1]
        stream.pix_fmt = "yuv420p"
        for f in frames:
            out.mux(stream.encode(av.VideoFrame.from_ndarray(f, format="rgb24")))
        out.mux(stream.encode())
    return buf.getvalue()


def parts(media: list) -> list[dict]:
    return [
        image_part(png(p)) if kind == "image" else video_part(mp4(p, VIDEO_FPS), "video/mp4")
        for kind, p in media
    ]


def encode(service: Service, media: list) -> list[dict]:
    """The router's step: the service encodes and pins; only the facts come back."""
    body = {"content": parts(media)}
    try:
        r = httpx.post(f"{service.url}/v1/cache/encode", json=body, timeout=120)
    except httpx.HTTPError as e:
        alive = service.proc is not None and service.proc.poll() is None
        raise AssertionError(f"{e}; service alive: {alive}\n{''.join(service.lines)}") from e
    r.raise_for_status()
    return r.json()["items"]


@pytest.fixture(scope="module")
def services(models):
    started = {f: Service(m.path, free_port()).start() for f, m in models.items()}
    yield started
    for s in started.values():
        s.stop()


@pytest.fixture(scope="module")
def consumers(models, services, tmp_path_factory):
    def config(family):
        return {
            "ec_connector": "MmferryECConnector",
            "ec_connector_module_path": "mmferry.engines.vllm_connector",
            "ec_role": "ec_consumer",
            "ec_connector_extra_config": {"url": services[family].url},
        }

    started = {}
    try:
        for family in models:
            started.update(
                start_engines(
                    {family: models[family]},
                    tmp_path_factory,
                    "vllm-consumer",
                    in_process=False,
                    ec_transfer_config=config(family),
                )
            )
        yield started
    finally:
        for e in started.values():
            e.stop()


@pytest.mark.parametrize("family", ["qwen2_5_vl", "qwen3_vl"])
def test_consumer_loads_from_mmferry_serve(family, models, engines, services, consumers):
    m, service = models[family], services[family]
    all_cases = cases(m.proc.config.factor)
    fresh = image(2 * m.proc.config.factor, 2 * m.proc.config.factor, 5)
    fresh_case = type(all_cases["images"])(
        "fresh", "hello <|vision_start|><|image_pad|><|vision_end|> what ?", [("image", fresh)]
    )
    baseline = engines[family].generate(
        [pixel_request(all_cases[c]) for c in CASES] + [pixel_request(fresh_case)]
    )
    assert not isinstance(baseline, dict), baseline
    want = dict(zip([*CASES, "fresh"], baseline))

    # 1. Grid and hash only: the rows come from the service through the connector.
    reqs = []
    for c in CASES:
        facts = encode(service, all_cases[c].media)
        reqs.append(to_vllm_refs(facts).prompt(all_cases[c].text))
    # An image and a video (an MPEG-4 file the service decodes): the same rows handed over
    # inline by to_vllm are the reference, since vLLM's pixel path is not fed the file.
    mixed = all_cases["image_video"]
    facts = encode(service, mixed.media)
    reqs.append(to_vllm_refs(facts).prompt(mixed.text))
    with EncoderClient(service.url) as client:
        rows = client.encode(parts(mixed.media))
    inline = to_vllm(rows, timestamps=[f["timestamps"] for f in facts], uuids=["x0", "x1"])
    (ref,) = engines[family].generate([inline.prompt(mixed.text)])
    want["image_video"] = ref
    got = consumers[family].generate(reqs)
    assert not isinstance(got, dict), got
    for c, res in zip([*CASES, "image_video"], got):
        assert len(res.tokens) == 16, c
        assert res.tokens == want[c].tokens, c
        assert res.max_logprob_diff(want[c]) <= LOGPROB_ATOL, c
    health = httpx.get(f"{service.url}/health").json()
    assert health["status"] == "ok"

    # 2. Hashes the service never saw, pixels attached: vLLM encodes them itself.
    case = all_cases["images"]
    absent = pixel_request(case, [f"absent-{i}" for i in range(len(case.media))])
    (res,) = consumers[family].generate([absent])
    assert res.tokens == want["images"].tokens

    # 3. The service is down: lookups fail, vLLM encodes, nothing hangs; after a restart
    # (same port, empty cache) a grid-only request is served again.
    service.stop()
    down = pixel_request(case, [f"down-{i}" for i in range(len(case.media))])
    (res,) = consumers[family].generate([down])
    assert res.tokens == want["images"].tokens
    service.start()
    facts = encode(service, fresh_case.media)
    (res,) = consumers[family].generate([to_vllm_refs(facts).prompt(fresh_case.text)])
    assert res.tokens == want["fresh"].tokens
    assert res.max_logprob_diff(want["fresh"]) <= LOGPROB_ATOL
    print(json.dumps({"family": family, "fresh_hash": facts[0]["hash"]}))
