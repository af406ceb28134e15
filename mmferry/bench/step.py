"""One prefill step for a batch: mmferry's `prefill_step` vs a device-mask / masked_scatter step.

Workload (seeded, fixed): 32 Qwen3-VL requests with 1-3 images of mixed sizes each and a video
in every other request (4 temporal patches, timestamp text per frame), LLM hidden 2048 in
bfloat16, 3 deepstack levels. Chunked prefill: each step takes up to 2048 tokens, filled from
the requests in order, so steps cut through images and videos.

Step overhead is everything but the encoder and the LLM: both sides get the same encoder
outputs (the cache is filled before timing) and the same text embedding table.
- baseline, the shape of transformers' and SGLang's path: ids to the device, a boolean mask
  of the placeholder ids built there (`isin`), each request's rows sliced by host offsets,
  `masked_scatter` into the embeddings, and one dense zero `[tokens, H]` buffer per deepstack
  level filled by boolean-mask assignment; token types by comparisons on the device.
- mmferry: `prefill_step` with host-built indices, `index_copy_`, and deepstack rows for the
  vision tokens only.
Outputs are checked equal before timing. Peak memory is the most bytes live at once during a
step, counted per storage by a dispatch mode (CPU has no allocator statistics).

Encoder time saved: 32 requests, 2 images each, half the image slots repeating an earlier
image (half of those repeats in the other layout), through a small real tower: every
occurrence encoded (baseline) vs `prefill_step` deduplicating by hash.

Run: python -m mmferry.bench.step [--quick] [--json PATH]
"""

from __future__ import annotations

import random
from collections.abc import Callable

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from mmferry.bench.harness import Figure, Report, check_equal, compare, main_for
from mmferry.config import TokenIds, VisionConfig
from mmferry.embed.cache import EncoderCache
from mmferry.embed.step import StepOutput, StepRequest, prefill_step
from mmferry.encoder.model import VisionEncoder, VisionOutput
from mmferry.items import MultimodalItem
from mmferry.models import preset
from mmferry.prompt.expand import ExpandedPrompt, expand_prompt

TOK = TokenIds(image=1001, video=1002, vision_start=1003, vision_end=1004)
CFG = preset("qwen3-vl").replace(tokens=TOK)
VOCAB, HIDDEN, LEVELS, CHUNK, REQUESTS = 1024, 2048, 3, 2048, 32
DTYPE = torch.bfloat16


class _Digits:
    """Timestamp text as one small id per character (the step, not tokenising, is measured)."""

    def encode(self, text: str) -> list[int]:
        return [ord(c) % 100 for c in text]


def _item(modality: str, grid: tuple[int, int, int], key: str, **kw) -> MultimodalItem:
    t, h, w = grid
    feature = torch.zeros(t * h * w, 1).expand(-1, 8)  # metadata only: outputs are given
    return MultimodalItem(modality, feature, grid, "hf", key, **kw)


def _requests(seed: int = 0) -> list[tuple[ExpandedPrompt, list[MultimodalItem]]]:
    rng = random.Random(seed)
    out = []
    for r in range(REQUESTS):
        items = []
        for k in range(rng.randint(1, 3)):
            grid = (1, 2 * rng.randint(4, 14), 2 * rng.randint(4, 14))
            items.append(_item("image", grid, f"img-{r}-{k}"))
        if r % 2 == 0:
            grid = (4, 2 * rng.randint(4, 8), 2 * rng.randint(4, 8))
            ts = tuple(0.5 + 2 * k for k in range(4))
            items.append(_item("video", grid, f"vid-{r}", timestamps=ts))
        ids: list[int] = [rng.randrange(100, 1000) for _ in range(rng.randint(50, 400))]
        for it in items:
            pad = TOK.image if it.modality == "image" else TOK.video
            ids += [TOK.vision_start, pad, TOK.vision_end]
            ids += [rng.randrange(100, 1000) for _ in range(rng.randint(5, 30))]
        out.append((expand_prompt(ids, items, CFG, tokenizer=_Digits()), items))
    return out


def _schedule(batch) -> list[list[tuple[int, int, int]]]:
    """Chunked prefill: steps of up to CHUNK tokens, (request, start, end), requests in order."""
    steps, cur, room = [], [], CHUNK
    for r, (prompt, _) in enumerate(batch):
        start, n = 0, len(prompt.input_ids)
        while start < n:
            take = min(room, n - start)
            cur.append((r, start, start + take))
            start += take
            room -= take
            if room == 0:
                steps.append(cur)
                cur, room = [], CHUNK
    if cur:
        steps.append(cur)
    return steps


def _outputs(batch, seed: int = 1) -> dict[str, VisionOutput]:
    g = torch.Generator().manual_seed(seed)
    outs = {}
    for _, items in batch:
        for it in items:
            rows = [torch.randn(it.num_tokens, HIDDEN, generator=g) for _ in range(1 + LEVELS)]
            rows = [r.to(DTYPE) for r in rows]
            outs[it.hash] = VisionOutput(rows[0], tuple(rows[1:]))
    return outs


def baseline_step(batch, step, outputs, table) -> tuple[torch.Tensor, ...]:
    """Device mask, masked_scatter, dense deepstack buffers (the peers' shape of this step)."""
    ids = torch.cat([torch.tensor(batch[r][0].input_ids[s:e]) for r, s, e in step])
    embeds = table[ids]
    pads = torch.tensor([TOK.image, TOK.video])
    mask = torch.isin(ids, pads)  # built on the device from the ids
    rows, deep = [], [[] for _ in range(LEVELS)]
    for r, s, e in step:
        prompt, items = batch[r]
        # Host offsets say which rows of each overlapping item fall in [s, e).
        for it, spans in zip(items, prompt.offsets):
            lo = sum(max(0, min(b, s) - a) for a, b in spans)
            hi = sum(max(0, min(b, e) - a) for a, b in spans)
            if lo < hi:
                out = outputs[it.hash]
                rows.append(out.embeds[lo:hi])
                for lvl in range(LEVELS):
                    deep[lvl].append(out.deepstack[lvl][lo:hi])
    embeds = embeds.masked_scatter(mask[:, None], torch.cat(rows))
    dense = []
    for lvl in range(LEVELS):
        buf = torch.zeros(len(ids), HIDDEN, dtype=DTYPE)
        buf[mask] = torch.cat(deep[lvl])
        dense.append(buf)
    positions = torch.cat([batch[r][0].positions[:, s:e] for r, s, e in step], 1)
    types = (ids == TOK.image).int() + 2 * (ids == TOK.video).int()
    return embeds, positions, mask, types, *dense


def mmferry_step(batch, step, cache, table) -> StepOutput:
    reqs = [StepRequest(batch[r][0], batch[r][1], s, e) for r, s, e in step]
    return prefill_step(reqs, embed_tokens=table, cache=cache)


class PeakBytes(TorchDispatchMode):
    """The most bytes of new storages live at once while active (CPU has no allocator stats)."""

    def __init__(self) -> None:
        super().__init__()
        self.live: dict[int, tuple[StorageWeakRef, int]] = {}
        self.now = self.peak = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        seen = {
            t.untyped_storage().data_ptr()
            for t in tree_flatten((args, kwargs or {}))[0]
            if isinstance(t, torch.Tensor)
        }
        out = func(*args, **(kwargs or {}))
        for key, (ref, n) in list(self.live.items()):
            if ref.expired():
                del self.live[key]
                self.now -= n
        for t in tree_flatten(out)[0]:
            if not isinstance(t, torch.Tensor):
                continue
            st = t.untyped_storage()
            key = st.data_ptr()
            if key in seen or key in self.live or st.nbytes() == 0:
                continue
            self.live[key] = (StorageWeakRef(st), st.nbytes())
            self.now += st.nbytes()
        self.peak = max(self.peak, self.now)
        return out


def _peak(fn: Callable[[], object]) -> int:
    with PeakBytes() as mode:
        out = fn()
        del out
    return mode.peak


def _check(batch, steps, outputs, cache, table) -> tuple[int, int]:
    """Both sides agree on every step; returns (vision tokens, tokens) of the largest step."""
    worst = (0, 0)
    for step in steps:
        emb, pos, mask, types, *dense = baseline_step(batch, step, outputs, table)
        got = mmferry_step(batch, step, cache, table)
        check_equal("inputs_embeds", got.inputs_embeds, emb)
        check_equal("positions", got.positions, pos)
        check_equal("vision mask", got.vision_mask, mask)
        check_equal("token types", got.mm_token_type_ids, types)
        idx = got.vision_index
        for ours, ref in zip(got.deepstack, dense):
            check_equal("deepstack rows", ours, ref[idx])
            rest = ref.clone()
            rest[idx] = 0
            check_equal("dense buffer holds nothing else", rest, torch.zeros_like(rest))
        worst = max(worst, (len(idx), len(pos[0])))
    return worst


def _bench_overhead(report: Report, rounds: int) -> None:
    batch = _requests()
    steps = _schedule(batch)
    outputs = _outputs(batch)
    cache = EncoderCache(1 << 34)
    for _, items in batch:
        for it in items:
            cache.put(it.hash, outputs[it.hash])
    table = torch.randn(VOCAB, HIDDEN).to(DTYPE)
    n_tokens = sum(len(p.input_ids) for p, _ in batch)
    n_vision = sum(b - a for p, _ in batch for spans in p.offsets for a, b in spans)
    v, n = _check(batch, steps, outputs, cache, table)
    label = (
        f"{REQUESTS} requests, {n_tokens} tokens ({n_vision} vision), {len(steps)} steps of "
        f"<={CHUNK}, H={HIDDEN} bf16, {LEVELS} deepstack levels"
    )
    report.add(
        compare(
            f"step overhead, whole prefill ({label})",
            {
                "mask + masked_scatter + dense": lambda: [
                    baseline_step(batch, s, outputs, table) for s in steps
                ],
                "mmferry": lambda: [mmferry_step(batch, s, cache, table) for s in steps],
            },
            rounds=rounds,
        )
    )
    big = max(steps, key=lambda s: sum(e - b for _, b, e in s))
    base_peak = _peak(lambda: baseline_step(batch, big, outputs, table))
    ours_peak = _peak(lambda: mmferry_step(batch, big, cache, table))
    report.add(
        Figure.of_values(
            f"peak bytes live during one {n}-token step ({v} vision tokens)",
            "mask + masked_scatter + dense",
            base_peak,
            ours_peak,
            unit="MiB",
        )
    )
    dense = LEVELS * n * HIDDEN * 2
    rows = LEVELS * v * HIDDEN * 2
    report.add(
        Figure.of_values(
            f"deepstack held for the LLM, one {n}-token step ({v} vision tokens)",
            "dense [tokens, H] buffers",
            dense,
            rows,
            unit="MiB",
            note="mmferry: rows for the vision tokens only",
        )
    )


TOWER = VisionConfig(
    family="qwen3_vl",
    depth=4,
    hidden_size=256,
    intermediate_size=1024,
    num_heads=4,
    out_hidden_size=256,
    hidden_act="gelu_pytorch_tanh",
    patch_size=16,
    num_position_embeddings=2304,
    deepstack_visual_indexes=(1, 2, 3),
)


def _bench_repeats(report: Report, rounds: int) -> None:
    rng = random.Random(2)
    enc = VisionEncoder.random(config=TOWER, seed=0)
    g = torch.Generator().manual_seed(3)
    distinct = []
    for k in range(REQUESTS):
        h, w = 2 * rng.randint(4, 9), 2 * rng.randint(4, 9)
        feat = torch.randint(0, 256, (h * w, 3 * 16 * 16), generator=g, dtype=torch.uint8)
        distinct.append(MultimodalItem("image", feat, (1, h, w), "compact-u8", f"{k:032x}"))

    def as_hf(it: MultimodalItem) -> MultimodalItem:
        # The same pixels in the hf layout (mean = std = 0.5, two temporal copies): same hash.
        n = it.feature.shape[0]
        x = it.feature.view(n, 3, 1, 256).expand(n, 3, 2, 256).reshape(n, -1) / 127.5 - 1
        return MultimodalItem("image", x, it.grid_thw, "hf", it.hash)

    batch = []
    for r in range(REQUESTS):
        first = distinct[r]
        again = distinct[rng.randrange(r + 1)]  # half the slots repeat an earlier image
        items = [first, as_hf(again) if r % 2 else again]
        ids = [5, TOK.vision_start, TOK.image, TOK.vision_end] * 2 + [6]
        batch.append((expand_prompt(ids, items, CFG), items))
    occurrences = [it for _, items in batch for it in items]
    table = torch.randn(VOCAB, TOWER.out_hidden_size)
    reqs = [StepRequest(p, items, 0, len(p.input_ids)) for p, items in batch]

    def ours() -> StepOutput:
        return prefill_step(reqs, embed_tokens=table, encoder=enc, cache=EncoderCache(1 << 30))

    ref = enc(occurrences)
    got = ours()
    check_equal(
        "deduplicated rows",
        got.inputs_embeds[got.vision_index],
        torch.cat([o.embeds for o in ref]),
        atol=1e-4,
    )
    report.add(
        compare(
            f"encoder, {len(occurrences)} image slots, {got.encoded} distinct (half repeat, "
            "some across layouts), a small real tower",
            {"encode every occurrence": lambda: enc(occurrences), "mmferry": ours},
            rounds=rounds,
            note="mmferry includes its whole step",
        )
    )


def run(report: Report, quick: bool) -> None:
    """Step overhead and peak memory against the device-mask step; encoder time with repeats."""
    rounds = 5 if quick else 7
    with torch.inference_mode():
        report.section("prefill step overhead")
        _bench_overhead(report, rounds)
        report.section("encoder with repeated images")
        _bench_repeats(report, rounds)


def main(argv: list[str] | None = None) -> int:
    return main_for(run, argv, __doc__.splitlines()[0])


if __name__ == "__main__":
    raise SystemExit(main())
