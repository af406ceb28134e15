"""`mmferry encode INPUTS... --out FILE`: images and videos -> one safetensors file, atomically.

Inputs are files, folders (searched recursively for known image and video suffixes) and
globs. An input that fails (unreadable, refused, or its encode fails) is named on one line and
skipped; the others are written. The output appears only complete: it is written beside its
final name, synced and renamed; an error or an interrupt (SIGINT, SIGTERM) before the rename
leaves nothing and an existing file as it was; an interrupt after it stops the command (130)
once the folder is synced, the output complete. --out is checked before any work.
Exit status: 0 all encoded; 1 some inputs failed, the rest written; 2 nothing written: no
inputs, all failed, the model cannot be built, or --out unusable (a folder, not writable);
3 nothing written: the write failed (no space, I/O error); 130 interrupted (nothing written,
or the output complete when the signal came after the rename: the message says which).
"""

from __future__ import annotations

import argparse
import glob
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TextIO

from mmferry.commands import UsageError, positive_int, short
from mmferry.commands.interrupts import raised_interrupts
from mmferry.commands.model_args import add_model_args, build
from mmferry.commands.outfile import OutputError, check_target, write_atomic
from mmferry.progress import terminal_bar

IMAGE_SUFFIXES = frozenset([".jpg", ".jpeg", ".png", ".webp", ".bmp", ".gif", ".tif", ".tiff"])
VIDEO_SUFFIXES = frozenset([".mp4", ".mkv", ".webm", ".mov", ".avi", ".m4v"])
SUFFIXES = IMAGE_SUFFIXES | VIDEO_SUFFIXES
# Inputs preprocessed per batch call, then encoded: enough to keep every thread busy (largest
# first inside a chunk), few enough that the progress bar moves and memory holds one chunk.
CHUNK = 32


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("inputs", nargs="+", help="image and video files, folders or globs")
    p.add_argument(
        "--out",
        required=True,
        type=Path,
        help="the safetensors file to write (missing folders are created)",
    )
    add_model_args(p)
    p.add_argument(
        "--layout",
        choices=["compact-u8", "hf"],
        help="the rows the tower is fed: compact-u8 (uint8, normalised inside the tower) or hf "
        "(transformers' float32 rows); default: compact-u8, hf for the generic family (the "
        "only one it carries)",
    )
    p.add_argument(
        "--batch-patches", type=int, default=16384, help="patch budget of one encoder call"
    )
    p.add_argument(
        "--threads",
        type=positive_int,
        help="preprocessing threads: inputs run in parallel, large ones split their own work "
        "(default: MMFERRY_PREPROCESS_THREADS, else this machine's cores)",
    )


def expand_inputs(inputs: list[str]) -> tuple[list[Path], list[tuple[str, str]]]:
    """(files in order, without repeats), and (input, why) for inputs that name nothing."""
    files: list[Path] = []
    missing: list[tuple[str, str]] = []
    for raw in inputs:
        try:
            found, why = _expand(Path(raw), raw)
        except OSError as e:  # a name too long, a loop of links, a folder not readable
            found, why = [], e.strerror or str(e)
        if not found:
            missing.append((short(raw), why))
        files += found
    seen: set[Path] = set()
    unique = [f for f in files if not (f.resolve() in seen or seen.add(f.resolve()))]
    return unique, missing


def _expand(path: Path, raw: str) -> tuple[list[Path], str]:
    """The files one input names, and why there are none."""
    if path.is_dir():
        found = sorted(p for p in path.rglob("*") if p.is_file() and p.suffix.lower() in SUFFIXES)
        return found, "the folder has no images or videos (" + " ".join(sorted(SUFFIXES)) + ")"
    if path.is_file():
        return [path], ""
    if glob.has_magic(raw):
        found = sorted(Path(p) for p in glob.glob(raw, recursive=True) if Path(p).is_file())
        return found, "matches nothing"
    return [], "no such file or folder"


class Progress:
    """tqdm's bar on stderr while inputs are encoded (items, items/s, tokens/s), only when
    stderr is a terminal: a pipe or a log gets nothing, so the lines around it are the whole
    output there."""

    def __init__(self, total: int, stream: TextIO | None = None) -> None:
        self.stream = sys.stderr if stream is None else stream  # the one in place now
        self.t0 = time.perf_counter()
        self.tokens = 0
        self.bar = terminal_bar(total, "item", self.stream)

    def update(self, items: int, tokens: int) -> None:
        self.tokens += tokens
        if self.bar is not None:
            dt = max(time.perf_counter() - self.t0, 1e-9)
            self.bar.set_postfix_str(f"{self.tokens / dt:.0f} tokens/s", refresh=False)
            self.bar.update(items)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def _batches(items: list, budget: int) -> Iterator[list]:
    batch: list = []
    patches = 0
    for entry in items:
        n = entry[1].num_patches
        if batch and patches + n > budget:
            yield batch
            batch, patches = [], 0
        batch.append(entry)
        patches += n
    if batch:
        yield batch


def run(args: argparse.Namespace) -> int:
    """Encode every input; write one safetensors file; say what failed."""
    written: list[Path] = []
    with raised_interrupts():
        try:
            return _run(args, written)
        except KeyboardInterrupt:
            if written:  # the signal came after the rename: the output is complete
                print(f"mmferry encode: interrupted; {written[0]} was written", file=sys.stderr)
            else:
                print("mmferry encode: interrupted; nothing written", file=sys.stderr)
            return 130


def _why(e: Exception) -> str:
    """One line for a failure; the type too where it is not a refusal or a file error."""
    plain = isinstance(e, (ValueError, ImportError, OSError, UsageError))
    text = str(e) if plain else f"{type(e).__name__}: {e}"
    return " ".join(text.split())


def _run(args: argparse.Namespace, written: list[Path]) -> int:
    from mmferry.server.encoded import write

    try:
        check_target(args.out)
    except OutputError as e:
        print(f"mmferry encode: {e}; nothing written", file=sys.stderr)
        return 2
    files, failed = expand_inputs(args.inputs)
    if not files:
        for src, why in failed:
            print(f"  {src}: {why}", file=sys.stderr)
        print("mmferry encode: no inputs to encode; nothing written", file=sys.stderr)
        return 2
    try:
        proc, enc = build(args)
    except Exception as e:  # noqa: BLE001 - a bad --model/--device: one line, not a traceback
        print(
            f"mmferry encode: cannot build the model: {_why(e)}; nothing written", file=sys.stderr
        )
        return 2
    layout = args.layout or proc.layouts[0]
    if layout not in proc.layouts:
        print(
            f"mmferry encode: --layout {layout}: this checkpoint is read through the "
            f"{proc.family} family, which carries {', '.join(proc.layouts)}; nothing written",
            file=sys.stderr,
        )
        return 2
    print(f"mmferry encode: {len(files)} inputs with {enc!r}", file=sys.stderr, flush=True)
    t0 = time.perf_counter()
    bar = Progress(len(files))
    encoded: list = []
    done: dict[str, object] = {}  # encoder output by item hash: a repeat is encoded once
    # Chunk by chunk: only one chunk's pixel rows are held at a time, however many inputs.
    for start in range(0, len(files), CHUNK):
        prepared = _prepare(proc, files[start : start + CHUNK], layout, args.threads, failed, bar)
        encoded += _encode_all(enc, prepared, max(args.batch_patches, 1), failed, bar, done)
    bar.close()
    for src, why in failed:
        print(f"  FAILED {src}: {why}", file=sys.stderr)
    if not encoded:
        print(f"mmferry encode: all {len(failed)} inputs failed; nothing written", file=sys.stderr)
        return 2
    try:
        write_atomic(args.out, lambda f: write(encoded, f), written)
    except OutputError as e:
        print(f"mmferry encode: {e}; nothing written", file=sys.stderr)
        return 2 if e.user else 3
    except Exception as e:  # noqa: BLE001 - the file is removed; say why on one line
        print(
            f"mmferry encode: cannot write {args.out}: {_why(e)}; nothing written", file=sys.stderr
        )
        return 3
    tokens = sum(e.num_tokens for e in encoded)
    dt = time.perf_counter() - t0
    print(
        f"mmferry encode: wrote {len(encoded)} items ({tokens} tokens) to {args.out} in "
        f"{dt:.1f} s; {len(failed)} failed",
        file=sys.stderr,
    )
    return 1 if failed else 0


def _prepare(
    proc, files: list[Path], layout: str, threads: int | None, failed: list, bar: Progress
) -> list:
    """(path, item) for each input that preprocesses, in parallel; (path, why) in `failed` for
    the rest."""
    from mmferry.preprocess.batch import ImagePart, ItemError, VideoPart

    parts = [
        VideoPart(str(p)) if p.suffix.lower() in VIDEO_SUFFIXES else ImagePart(str(p))
        for p in files
    ]
    prepared = []
    for path, item in zip(files, proc.items(parts, layout=layout, threads=threads, partial=True)):
        if isinstance(item, ItemError):
            # NOTE: any failure of one input (not only a refusal) skips that input.
            failed.append((short(path), _why(item.error)))
            bar.update(1, 0)
        else:
            prepared.append((path, item))
    return prepared


def _encode_all(enc, prepared: list, budget: int, failed: list, bar: Progress, done: dict) -> list:
    """The `EncodedItem`s of the prepared inputs, in order; (path, why) in `failed` for those
    whose encode fails. `done` holds the outputs met so far, by item hash."""
    from mmferry.server.encoded import EncodedItem

    encoded: list[EncodedItem] = []
    for batch in _batches(prepared, budget):
        # Repeats (same hash) are encoded once.
        todo = {it.hash: it for _, it in batch if it.hash not in done}
        done.update(zip(todo, _encode_each(enc, list(todo.values()))))
        for path, it in batch:
            out = done[it.hash]
            try:
                if isinstance(out, Exception):
                    raise out
                encoded.append(EncodedItem.of(it, out, source=str(path)))
            except Exception as e:  # noqa: BLE001 - its encode failed, or gave the wrong rows
                failed.append((short(path), _why(e)))
        bar.update(len(batch), sum(it.num_tokens for _, it in batch))
    return encoded


def _encode_each(enc, items: list) -> list:
    """The encoder's outputs for `items`, an Exception in place of each item that fails."""
    if not items:
        return []
    try:
        return list(enc(items))
    except Exception as e:  # noqa: BLE001
        if len(items) == 1:
            return [e]
    # One bad item must not cost its batch: each is encoded alone, and only failures skipped.
    return [out for it in items for out in _encode_each(enc, [it])]
