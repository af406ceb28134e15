"""`EncoderPool`: a request's items to the encoders their keys route to, one call per encoder,
failing over to each item's next choices.

The items routed to one encoder go to it in one `/v1/cache/encode` call (one round trip, one
batch in its tower), and in embeds mode their rows come back in one load. In connector mode with
`--encode-ahead` the call asks for the answer ahead of the rows (`"wait": false`): the encoder
answers once the items are preprocessed and encodes behind the answer, while the engine reads
the request; the engine's connector waits for the rows, and an encode that fails there fails
the engine's request before its output, which the proxy then sends again with pixels (items
that cannot go as pixels wait for their rows). An encoder that
refuses the connection, times out (or answers 408), is overloaded (429) or answers 5xx is
marked down and the call's items go to their next choices; it is not probed again before the
Retry-After it answered has passed. A background task probes down encoders' `/health` (with
the router's backoff) and brings them back. An encoder's own refusal of an item (any other 4xx
naming a part: bad media, too large) is the client's answer; a refusal of the call itself (its
body or item count over the encoder's limits) sends the call's items one by one. An answer
that is not the protocol's (answers.py: malformed, lying facts, rows that do not fit) fails
that encoder for the call's items, as a 5xx does, without marking it down. When no encoder can
serve an item, or the one that encoded it does not hold it for the engine, the item goes to the
engine as pixels (`None`).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import time
from collections.abc import Collection
from typing import Any

from mmferry.config import ProcessorConfig
from mmferry.proxy.ahead import PROCESSOR, processor_config, same_item
from mmferry.proxy.answers import BadEncoderAnswer, encode_facts, loaded_rows
from mmferry.proxy.config import ProxyConfig
from mmferry.proxy.http import transport_errors
from mmferry.proxy.media import (
    Encoded,
    Media,
    as_pixels,
    client_error,
    names_a_part,
    origin_failed,
)
from mmferry.proxy.metrics import ProxyMetrics
from mmferry.proxy.whole_calls import WholeCalls
from mmferry.routing import Router
from mmferry.server.bodies import dump_json
from mmferry.server.limits import RequestError

log = logging.getLogger("mmferry.proxy")
ENCODE = "/v1/cache/encode"


def retry_after_s(value: str | None) -> float:
    """A Retry-After header's delay in seconds; 0 when absent or not a number of seconds (an
    HTTP date is not worth a clock comparison here: the probe's backoff applies)."""
    try:
        seconds = float(value) if value is not None else 0.0
    except ValueError:
        return 0.0
    return seconds if math.isfinite(seconds) and seconds > 0 else 0.0


class _Failed(Exception):
    """An encoder could not serve a call (the reason is a metric label)."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason = reason


class _Split(Exception):
    """An encoder refused a call of several items as a whole (its size, its item count)."""


# An item whose call failed: its next choice takes it.
_NEXT = object()


async def gather_or_cancel(calls: Any) -> list[Any]:
    """The calls' results in order; the first exception cancels the others and is raised."""
    tasks = [asyncio.ensure_future(c) for c in calls]
    try:
        return list(await asyncio.gather(*tasks))
    except BaseException:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise


class EncoderPool:
    """The encoders behind one proxy, their router, and the probes of those that are down."""

    def __init__(self, config: ProxyConfig, metrics: ProxyMetrics) -> None:
        self.config = config
        self.metrics = metrics
        self.router = Router(config.encoder_urls, epsilon=config.epsilon)
        key = config.encoder_api_key
        # NOTE: every call gets one deadline for all of it (`_post`), not one a read: an
        # encoder that sends its answer a byte at a time cannot hold the request past
        # `encoder_timeout_s`, and the call sets one timer, not one a read.
        self.http = WholeCalls(
            connect_timeout_s=config.connect_timeout_s,
            headers={"Authorization": f"Bearer {key}"} if key else {},
        )
        self._transport_errors = transport_errors()
        self._prober: asyncio.Task | None = None
        # --name-ahead: each encoder's processor settings (None: a generic-family encoder),
        # and the settings the proxy names items by once every encoder has answered alike.
        self._settings: dict[str, ProcessorConfig | None] = {}
        self._naming: ProcessorConfig | None = None
        self._learner: asyncio.Task | None = None

    async def start(self) -> None:
        self._prober = asyncio.ensure_future(self._probe_loop())
        if self.config.name_ahead and self.config.mode == "connector":
            self._learner = asyncio.ensure_future(self._learn_settings())

    async def close(self) -> None:
        for task in (self._prober, self._learner):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        await self.http.aclose()

    def naming(self) -> ProcessorConfig | None:
        """The settings the proxy names items by ahead of their encode; None until every
        encoder has said what it names them by, or when they differ (or one is generic)."""
        return self._naming

    async def _learn_settings(self) -> None:
        """Asks each encoder its processor settings until all have answered. An encoder
        without the route (an older one) or with an answer that is not the protocol's names no
        items ahead: None, as a generic-family one."""
        warned: set[str] = set()
        while len(self._settings) < len(self.router.urls):
            for url in self.router.urls:
                if url in self._settings:
                    continue
                try:
                    async with asyncio.timeout(self.config.encoder_timeout_s):
                        r = await self.http.call("GET", url + PROCESSOR)
                except self._transport_errors:
                    continue  # down: asked again
                if r.status_code == 200:
                    try:
                        self._settings[url] = processor_config(json.loads(r.content))
                    except ValueError as e:
                        log.warning("encoder %s: %s answered %s", url, PROCESSOR, e)
                        self._settings[url] = None
                elif r.status_code in (404, 405):
                    self._settings[url] = None
                elif url not in warned:  # 401, 503 while it starts: asked again
                    warned.add(url)
                    log.warning("encoder %s: %s answered %d", url, PROCESSOR, r.status_code)
            if len(self._settings) < len(self.router.urls):
                await asyncio.sleep(1.0)
        kinds = set(self._settings.values())
        if len(kinds) == 1 and None not in kinds:
            self._naming = kinds.pop()
            log.info("the proxy names images ahead of their encode (--name-ahead)")
        else:
            log.warning(
                "--name-ahead is off: the encoders name items by different settings, or one "
                "serves its model through the generic family"
            )

    def place(self, media: list[Media]) -> list[str] | None:
        """The encoder each item goes to, counted in the router until `encode_named` ends;
        None when an item has no encoder up."""
        urls: list[str] = []
        for m in media:
            url = self.router.route(m.key)
            if url is None:
                for taken in urls:
                    self.router.release(taken)
                return None
            self.router.acquire(url)  # counted before the next item is routed
            urls.append(url)
        return urls

    def rank(self, media: Media, url: str) -> int:
        """`url`'s place among the item's choices (what the engine's connector is told)."""
        return self.router.choices(media.key).index(url)

    async def encode_named(
        self, media: list[Media], urls: list[str], named: list[Encoded]
    ) -> list[Encoded | None]:
        """The items encoded on the encoders `place` chose, under the names the proxy gave
        them: each encoder's answers (None where it failed: the caller sends the request the
        usual way). RequestError when an encoder refused an item itself."""
        calls: dict[str, list[int]] = {}
        for i, url in enumerate(urls):
            calls.setdefault(url, []).append(i)
        results = await gather_or_cancel(
            self._call(url, [media[i] for i in idx], False, [named[i].facts for i in idx])
            for url, idx in calls.items()
        )
        done: list[Encoded | None] = [None] * len(media)
        for idx, result in zip(calls.values(), results):
            for i, answer in zip(idx, result):
                done[i] = None if answer is _NEXT else answer
        self.metrics.named_ahead.labels("held").inc(sum(map(same_item, named, done)))
        return done

    def _down(self, url: str, hold_s: float = 0.0) -> None:
        self.router.mark_down(url, hold_s=hold_s)
        self.metrics.encoder_up.labels(url).set(0)

    def _up(self, url: str) -> None:
        if not self.router.is_up(url):
            log.warning("encoder %s is up again", url)
        self.router.mark_up(url)
        self.metrics.encoder_up.labels(url).set(1)

    async def _post(self, url: str, route: str, body: dict[str, Any], media: list[Media]) -> Any:
        """The encoder's 200 response; RequestError for its refusal of an item (a 4xx but
        408 and 429, or a 502/504 saying a client's URL failed at its origin); _Split for its
        refusal of a call of several items as a whole; _Failed when the encoder could not
        serve (marked down, except for a 401 or an answer not the protocol's)."""
        t0 = time.perf_counter()
        limit_s = self.config.encoder_timeout_s
        try:
            async with asyncio.timeout(limit_s):
                r = await self.http.call("POST", url + route, dump_json(body), json=True)
        except self._transport_errors as e:
            self._down(url)
            if type(e) is TimeoutError:  # the call's own deadline (a connect's is ConnectTimeout)
                raise _Failed("timeout", f"no whole answer within {limit_s:g} s") from None
            raise _Failed(type(e).__name__, str(e)) from None
        finally:
            self.metrics.encoder_seconds.labels(url).observe(time.perf_counter() - t0)
        if r.status_code == 200:
            return r
        if origin_failed(r.status_code, r.text):
            # A client's URL failed at its origin: the client's failure, which every encoder
            # would meet alike. Not sent to the engine instead: vLLM would fetch the URL
            # itself, and follow the redirect the encoder refused.
            raise client_error(r.status_code, r.text, media)
        if r.status_code >= 500 or r.status_code in (408, 429):
            # The encoder's fault, its timeout (408) or its overload (429, 503), never the
            # client's: the items' next choices take them, and this encoder is left alone
            # until its probe, and for as long as it asked (Retry-After).
            self._down(url, hold_s=retry_after_s(r.headers.get("retry-after")))
            raise _Failed(f"http_{r.status_code}", r.text[:200])
        if r.status_code == 401:
            # The proxy's key toward the encoders is wrong: the operator's fault, not the
            # client's; the next choice may still take it.
            raise _Failed("unauthorized", "the encoder refused the proxy's key")
        # NOTE: the encode route refuses items with 413 or 422, never 404 or 405: those say the
        # URL is no mmferry encoder (a wrong port, an older service), not that the item is bad.
        no_route = route == ENCODE and r.status_code in (404, 405)
        if no_route or not 400 <= r.status_code < 500:
            # Not the protocol's (a redirect, a 204): no refusal of the item to pass on.
            raise _Failed("bad_answer", f"status {r.status_code}: {r.text[:200]}")
        if len(media) > 1 and r.status_code in (413, 422) and not names_a_part(r.text):
            # The call's size or item count over this encoder's limits, not an item's fault.
            raise _Split(r.text[:200])
        raise client_error(r.status_code, r.text, media)

    async def encode(
        self, media: list[Media], exclude: Collection[str] = ()
    ) -> list[Encoded | None]:
        """Each item encoded and held by an encoder (with its rows in embeds mode), or None:
        send its pixels. The items routed to one encoder go to it in one call; those of a call
        that failed go to their next choices. RequestError when an encoder refused an item
        itself (the first refusal cancels the other calls). `exclude`: encoders not to ask (a
        second encode's: those that held the items when the engine could not find them there),
        whose caller counts the items it sends as pixels."""
        # Connector mode: answers ahead of the rows, when the whole request could follow as
        # pixels (the engine's failure of an encode that failed behind its answer is caught by
        # sending it again with pixels); otherwise each call waits for its rows, and a failing
        # encoder passes its items to their next choices.
        early = self.config.mode == "connector" and self.config.encode_ahead and as_pixels(media)
        done: list[Encoded | None] = [None] * len(media)
        first = not exclude  # counts its items left to the engine itself
        tried = [list(exclude) for _ in media]
        pending = list(range(len(media)))
        while pending:
            calls: dict[str, list[int]] = {}
            for i in pending:
                url = self.router.route(media[i].key, exclude=tried[i])
                if url is None:
                    if first:
                        self.metrics.items_fallback.labels("no_encoder").inc()
                    continue
                tried[i].append(url)
                self.router.acquire(url)  # counted before the next item is routed
                calls.setdefault(url, []).append(i)
            results = await gather_or_cancel(
                self._call(url, [media[i] for i in idx], early) for url, idx in calls.items()
            )
            pending = []
            for idx, result in zip(calls.values(), results):
                for i, answer in zip(idx, result):
                    if answer is _NEXT:
                        pending.append(i)
                    else:
                        done[i] = answer
                        if answer is None and first:
                            self.metrics.items_fallback.labels("not_held").inc()
        return done

    async def _call(
        self, url: str, media: list[Media], early: bool, named: list[dict] | None = None
    ) -> list[Any]:
        """One call's answers per item: Encoded, None (its pixels) or _NEXT (its next choice);
        the router's count of the items routed to `url` ends with it. `named`: the facts the
        proxy named the items by (`encode_named`)."""
        try:
            return await self._attempt(url, media, early, named)
        finally:
            for _ in media:
                self.router.release(url)

    async def _attempt(
        self, url: str, media: list[Media], early: bool, named: list[dict] | None
    ) -> list[Any]:
        try:
            return await self._encode_on(url, media, early, named)
        except _Split:
            one_by_one = await gather_or_cancel(
                self._attempt(url, [m], early, None if named is None else [named[k]])
                for k, m in enumerate(media)
            )
            return [answer for (answer,) in one_by_one]
        except _Failed as e:
            self.metrics.encoder_failures.labels(url, e.reason).inc()
            log.warning("encoder %s failed (%s); trying the items' next choices", url, e)
            return [_NEXT] * len(media)

    async def _encode_on(
        self, url: str, media: list[Media], early: bool, named: list[dict] | None = None
    ) -> list[Encoded | None]:
        body: dict[str, Any] = {"content": [m.raw for m in media]}
        if named is not None:
            # The names the engine already has: pending there from the moment the encoder
            # reads this, held only if its own facts are these.
            body["announced"] = [{"hash": f["hash"], "grid_thw": f["grid_thw"]} for f in named]
        if early:
            # The answer comes once the items are preprocessed; the engine reads the request
            # while the tower runs, and its connector waits for the rows (pending lookups).
            body["wait"] = False
        r = await self._post(url, ENCODE, body, media)
        try:
            facts = encode_facts(r.content, [m.modality for m in media])
        except BadEncoderAnswer as e:
            raise _Failed("bad_answer", str(e)) from None
        self.metrics.items_routed.labels(url).inc(len(media))
        answers = [Encoded(f, url=url) if f["held"] else None for f in facts]
        if self.config.mode == "connector":
            return answers
        for m, f in zip(media, facts):
            if f["held"] and f["pixels"]:
                # NOTE: refused, not sent as pixels for vLLM to encode itself: the deployment
                # asked for the encoders' rows, and would get vLLM's own without a word.
                raise RequestError(
                    501,
                    "not_supported",
                    f"{m.part.where}: the encoders serve this model through mmferry's generic "
                    "family, whose rows vLLM (0.32) takes through its encoder-cache connector "
                    "only, not as embeddings: run mmferry proxy --mode connector, with vLLM's "
                    "MmferryECConnector",
                )
        # Embeds mode: the rows come through the proxy; the load releases the pins.
        held = [(k, a) for k, a in enumerate(answers) if a is not None]
        if held:
            for (k, _), rows in zip(held, await self._load(url, [a.facts for _, a in held], media)):
                answers[k] = None if rows is None else Encoded(facts[k], rows, url=url)
        return answers

    async def _load(self, url: str, facts: list[dict], media: list[Media]) -> list[Any]:
        """The rows of the held items `facts` in one load: None for an item the encoder lost
        since its encode (its pixels go to the engine)."""
        body = {"hashes": list(dict.fromkeys(f["hash"] for f in facts)), "dtype": self.config.dtype}
        try:
            r = await self._post(url, "/v1/cache/load", body, media)
        except RequestError as e:  # 404: evicted since the encode; the engine encodes it
            if len(body["hashes"]) > 1:
                # One lost item fails the whole load: the others are loaded alone.
                return [(await self._load(url, [f], media))[0] for f in facts]
            log.warning("encoder %s lost %s before its load: %s", url, body["hashes"], e.message)
            return [None] * len(facts)
        try:
            return loaded_rows(r.content, facts, self.config.dtype)
        except BadEncoderAnswer as e:
            raise _Failed("bad_answer", str(e)) from None

    async def _probe(self, url: str) -> None:
        # One deadline for the whole probe: an encoder trickling its /health answer neither
        # passes it nor holds the round of probes (and so the other down encoders' next ones).
        try:
            async with asyncio.timeout(self.config.connect_timeout_s):
                r = await self.http.call("GET", url + "/health")
            ok = r.status_code == 200
        except self._transport_errors:  # TimeoutError among them
            ok = False
        if ok:
            self._up(url)
        else:
            self._down(url)

    async def _probe_loop(self) -> None:
        while True:
            due = self.router.due()
            if due:
                await asyncio.gather(*(self._probe(u) for u in due))
            await asyncio.sleep(self.config.probe_interval_s)

    def health(self) -> dict[str, str]:
        """Each encoder: "up" or "down"."""
        return {u: "up" if self.router.is_up(u) else "down" for u in self.router.urls}
