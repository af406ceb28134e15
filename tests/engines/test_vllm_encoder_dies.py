"""An encoder that dies between vLLM's lookup and its load does not fail the step.

A real vLLM with `MmferryECConnector` (`rows_at_lookup`) and a real `mmferry serve` process,
reached through a relay that passes the cache protocol on and SIGKILLs the service right after
it has answered one route. Killed after the lookup (present, pinned), the rows cannot be had:
vLLM encodes the items from the request's pixels and answers what the plain engine answers.
Killed after the rows went out, vLLM uses the rows the scheduler took at the lookup. Either way
the engine keeps serving. Without `rows_at_lookup` the first case fails the step and stops the
engine: vLLM 0.32 has planned the load and gives a consumer no way back.
"""

from __future__ import annotations

import httpx
import pytest

from mmferry.engines.cache_client import CALLER_HEADER
from mmferry.testing.ports import free_port
from tests.engines.cases import cases, pixel_request
from tests.engines.conftest import start_engines
from tests.engines.lying_service import Answer, LyingService
from tests.engines.service import Service
from tests.engines.test_vllm_connector import encode

pytestmark = pytest.mark.slow
FAMILY = "qwen3_vl"  # deepstack: rows wider than the LM's hidden size
LOGPROB_ATOL = 1e-4


@pytest.fixture(scope="module")
def relayed_engine(models, tmp_path_factory):
    with LyingService() as relay:
        config = {
            "ec_connector": "MmferryECConnector",
            "ec_connector_module_path": "mmferry.engines.vllm_connector",
            "ec_role": "ec_consumer",
            "ec_connector_extra_config": {
                "url": relay.url,
                # NOTE: rows over HTTP, through the relay: a shared-memory handle would name
                # the service's own segment, which the relay cannot stand in for.
                "transport": "http",
                "rows_at_lookup": True,
                "timeout_s": 5.0,
                # A lookup answered late reads as absent: nothing would be killed in between.
                "lookup_timeout_s": 5.0,
            },
        }
        started = start_engines(
            {FAMILY: models[FAMILY]}, tmp_path_factory, "vllm-dies", ec_transfer_config=config
        )
        try:
            yield relay, started[FAMILY]
        finally:
            for e in started.values():
                e.stop()


def relay_to(relay: LyingService, service: Service, kill_after: str) -> None:
    """Lookups and loads passed on to `service`, which is SIGKILLed once it has answered
    `kill_after`; a service that is gone answers 503, as a proxy in front of it would."""

    def route(name: str):
        def respond(body: dict) -> Answer:
            try:
                r = httpx.post(
                    f"{service.url}/v1/cache/{name}",
                    json=body,
                    headers={CALLER_HEADER: "relay"},
                    timeout=30,
                )
            except httpx.HTTPError:
                return Answer(503, b'{"error": "the service is gone"}')
            if name == kill_after and service.proc.poll() is None:
                service.proc.kill()
                service.proc.wait(timeout=30)
            kind = r.headers.get("content-type", "application/json")
            return Answer(r.status_code, r.content, kind)

        return respond

    relay.answer("lookup", route("lookup"))
    relay.answer("load", route("load"))


@pytest.mark.parametrize("kill_after", ["lookup", "load"])
def test_an_encoder_killed_between_lookup_and_load_fails_no_step(
    kill_after, models, engines, relayed_engine
):
    relay, engine = relayed_engine
    m = models[FAMILY]
    case = cases(m.proc.config.factor)["images"]
    (want,) = engines[FAMILY].generate([pixel_request(case)])
    service = Service(m.path, free_port()).start()
    try:
        facts = encode(service, case.media)
        ids = [f["hash"] for f in facts]
        relay_to(relay, service, kill_after)
        got = engine.generate([pixel_request(case, ids)])
    finally:
        service.stop()
    assert not isinstance(got, dict), (got, "".join(engine.lines[-30:]))
    (res,) = got
    assert res.tokens == want.tokens
    assert res.max_logprob_diff(want) <= LOGPROB_ATOL
    asked = {r for r, _, body in relay.seen if body and set(body["hashes"]) & set(ids)}
    assert asked == {"lookup", "load"}  # the lookup said present; the load came after it
    assert service.proc.returncode == -9  # killed where the test said, not stopped after
    # The engine keeps serving: the same images again, from their pixels.
    (res,) = engine.generate([pixel_request(case, [f"after-{kill_after}-{i}" for i in ids])])
    assert res.tokens == want.tokens
