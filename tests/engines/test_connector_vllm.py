"""The real vLLM with `MmferryECConnector` pointed at a lying service (`lying_service.py`).

Every malformed or late lookup answer reads as "absent": vLLM encodes the items itself and
answers exactly what the plain engine answers for the same pixels, and keeps serving. A
service telling the truth in a roundabout way (shared-memory handles whose segment is gone,
then the rows over HTTP) feeds vLLM the rows it sends, and vLLM uses them: the other image's
rows change the answer. A service sending rows that do not fit fails the load naming the item
instead of putting them into vLLM's encoder cache (the last test: the engine stops there).
"""

from __future__ import annotations

import time

import pytest
import torch

from mmferry.engines.rows import packed_rows
from mmferry.engines.vllm import to_vllm_refs
from mmferry.transport.shm import ShmArena
from tests.engines.cases import cases, items, pixel_request
from tests.engines.conftest import start_engines
from tests.engines.lying_service import (
    BAD_LOOKUPS,
    Answer,
    LyingService,
    handle_json,
    js,
    present,
    rows,
)

pytestmark = pytest.mark.slow
FAMILY = "qwen3_vl"  # deepstack: rows wider than the LM's hidden size
LOGPROB_ATOL = 1e-4
CALLER = "x-mmferry-caller"  # the protocol's header, as the lying service records it
QUIET_S = 1.1  # longer than the connector stays quiet after a failed lookup


@pytest.fixture(scope="module")
def lying_engine(models, tmp_path_factory):
    with LyingService() as lying:
        config = {
            "ec_connector": "MmferryECConnector",
            "ec_connector_module_path": "mmferry.engines.vllm_connector",
            "ec_role": "ec_consumer",
            "ec_connector_extra_config": {
                "url": lying.url,
                "lookup_timeout_s": 0.5,
                "timeout_s": 5.0,
            },
        }
        started = start_engines(
            {FAMILY: models[FAMILY]},
            tmp_path_factory,
            "vllm-lying",
            ec_transfer_config=config,
        )
        try:
            yield lying, started[FAMILY]
        finally:
            for e in started.values():
                e.stop()


@pytest.fixture(scope="module")
def baseline(models, engines):
    """The plain engine's answer for the two-image case, from the pixels."""
    case = cases(models[FAMILY].proc.config.factor)["images"]
    (want,) = engines[FAMILY].generate([pixel_request(case)])
    return case, want


def absent(body: dict) -> Answer:
    """The protocol's answer: no asked hash held."""
    n = len(body["hashes"])
    return js({"present": [False] * n, "pinned_s": [0.0] * n})


def lookups_of(lying: LyingService, ids: list[str]) -> list[dict]:
    return [h for h, body in lying.calls("lookup") if body and set(body["hashes"]) & set(ids)]


def test_vllm_serves_through_every_bad_lookup_answer(lying_engine, baseline):
    lying, engine = lying_engine
    case, want = baseline
    for form, answer in BAD_LOOKUPS.items():
        lying.answer("lookup", answer)
        ids = [f"{form}-{i}" for i in range(len(case.media))]
        got = engine.generate([pixel_request(case, ids)])
        assert not isinstance(got, dict), (form, got, "".join(engine.lines[-30:]))
        (res,) = got
        assert res.tokens == want.tokens, form
        assert res.max_logprob_diff(want) <= LOGPROB_ATOL, form
        assert lookups_of(lying, ids), f"{form}: the connector never asked"
        time.sleep(QUIET_S + (4.0 if form in ("late", "trickled") else 0.0))
    callers = {h.get(CALLER) for h, _ in lying.calls("lookup")}
    assert len(callers) == 1 and None not in callers  # one random id for the connector


def test_vllm_uses_the_rows_it_loads_after_shared_memory_fails(lying_engine, baseline, models):
    """Lookups say present; the shared-memory answer names a segment already gone, so the
    worker asks again for safetensors, checks them and hands them to vLLM. The rows the
    service sends are what vLLM uses: mmferry's rows give the plain engine's answer, and the
    two images' rows swapped (same token counts) give another."""
    lying, engine = lying_engine
    case, want = baseline
    m = models[FAMILY]
    outs = m.enc([m.proc.image(pixels) for _, pixels in case.media])
    item_rows = [packed_rows(o.embeds, o.deepstack, torch.float32).contiguous() for o in outs]
    arena = ShmArena(1 << 20)
    gone = {"x": handle_json(arena.put(item_rows[0]))}
    arena.close()
    answers: dict[str, torch.Tensor] = {}

    def load(body: dict) -> Answer:
        if body.get("response") == "shm":
            return js({"items": {h: gone["x"] for h in body["hashes"]}})
        return rows({h: answers[h] for h in body["hashes"]})

    lying.answer("lookup", present(60.0))
    lying.answer("load", load)
    for tag, order, same in (("right", (0, 1), True), ("swapped", (1, 0), False)):
        ids = [f"loaded-{tag}-{i}" for i in range(len(case.media))]
        answers.update({ids[k]: item_rows[j] for k, j in enumerate(order)})
        got = engine.generate([pixel_request(case, ids)])
        assert not isinstance(got, dict), (tag, got, "".join(engine.lines[-30:]))
        (res,) = got
        assert (res.tokens == want.tokens) is same, tag
        if same:
            assert res.max_logprob_diff(want) <= LOGPROB_ATOL
        loads = [b for _, b in lying.calls("load") if set(b["hashes"]) & set(ids)]
        assert [b.get("response", "safetensors") for b in loads] == ["shm", "safetensors"]
    (lookup_caller,) = {h[CALLER] for h, _ in lying.calls("lookup")}
    load_callers = {h[CALLER] for h, _ in lying.calls("load")}
    assert load_callers == {lookup_caller}


def test_an_item_with_only_a_grid_that_no_service_holds_fails_its_request_alone(
    lying_engine, baseline, models
):
    """A request naming items by grid and hash only, which the service does not hold (evicted,
    or its encoder died after the encode): vLLM has nothing to encode them from. The request
    fails on its own, before it is scheduled, and the engine keeps serving."""
    lying, engine = lying_engine
    case, want = baseline
    lying.answer("lookup", absent)
    facts = [
        {"modality": it.modality, "hash": f"nowhere-{i}", "grid_thw": list(it.grid_thw)}
        for i, it in enumerate(items(models[FAMILY].proc, case))
    ]
    got = engine.generate([to_vllm_refs(facts).prompt(case.text)])
    assert not isinstance(got, dict), (got, "".join(engine.lines[-30:]))
    (res,) = got
    assert res.finish == "error" and res.tokens == []
    assert lookups_of(lying, ["nowhere-0", "nowhere-1"])
    # The engine is alive: the same images with pixels get the plain engine's answer.
    (res,) = engine.generate([pixel_request(case, ["after-0", "after-1"])])
    assert res.tokens == want.tokens
    assert res.max_logprob_diff(want) <= LOGPROB_ATOL


def test_rows_that_do_not_fit_fail_the_load_naming_the_item(lying_engine, baseline):
    """Runs last: vLLM gives a consumer no way back once it planned a load, so the step
    fails, naming the item, and these rows never enter vLLM's encoder cache."""
    lying, engine = lying_engine
    case, _ = baseline
    ids = ["narrow-0", "narrow-1"]
    lying.answer("lookup", present(60.0))
    lying.answer("load", lambda body: rows({h: torch.zeros(8, 48) for h in body["hashes"]}))
    got = engine.generate([pixel_request(case, ids)])
    assert isinstance(got, dict), got
    text = got["error"] + got.get("trace", "") + "".join(engine.lines)
    assert "mmferry could not load the planned items" in text
    assert "narrow-0" in text and "do not fit" in text
