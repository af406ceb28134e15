"""`mmferry encode INPUTS... --out FILE`: images and videos -> one safetensors file, atomically.

Inputs are files, folders (searched recursively for known image and video suffixes) and
globs. A bad input is reported and skipped; the good ones are written. The output appears only
complete: it is written to a temporary file beside it and renamed; an error or an interrupt
(SIGINT, SIGTERM) removes the temporary file.
Exit status: 0 all encoded, 1 some inputs failed (the rest written), 2 nothing written.
"""

from __future__ import annotations

import argparse
import glob
import os
import signal
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from mmferry.commands.model_args import add_model_args, build

IMAGE_SUFFIXES = frozenset([".jpg", ".jpeg", ".png", ".webp", ".bmp", ".gif", ".tif", ".tiff"])
VIDEO_SUFFIXES = frozenset([".mp4", ".mkv", ".webm", ".mov", ".avi", ".m4v"])


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("inputs", nargs="+", help="image and video files, folders or globs")
    p.add_argument("--out", required=True, type=Path, help="the safetensors file to write")
    add_model_args(p)
    p.add_argument("--layout", default="compact-u8", choices=["compact-u8", "hf"])
    p.add_argument(
        "--batch-patches", type=int, default=16384, help="patch budget of one encoder call"
    )


def expand_inputs(inputs: list[str]) -> tuple[list[Path], list[tuple[str, str]]]:
    """(files in order, without repeats), and (input, why) for inputs that name nothing."""
    files: list[Path] = []
    missing: list[tuple[str, str]] = []
    for raw in inputs:
        path = Path(raw)
        if path.is_dir():
            found = sorted(
                p
                for p in path.rglob("*")
                if p.is_file() and p.suffix.lower() in IMAGE_SUFFIXES | VIDEO_SUFFIXES
            )
        elif path.is_file():
            found = [path]
        elif glob.has_magic(raw):
            found = sorted(Path(p) for p in glob.glob(raw, recursive=True) if Path(p).is_file())
        else:
            found = []
        if not found:
            missing.append((raw, "no such file" if not glob.has_magic(raw) else "matches nothing"))
        files += found
    seen: set[Path] = set()
    unique = [f for f in files if not (f.resolve() in seen or seen.add(f.resolve()))]
    return unique, missing


class Progress:
    """A one-line progress bar on a terminal (items/s, tokens/s); silent otherwise."""

    def __init__(self, total: int, stream=sys.stderr) -> None:
        self.total = total
        self.stream = stream
        self.tty = stream.isatty()
        self.t0 = time.perf_counter()
        self.done = self.tokens = 0

    def update(self, items: int, tokens: int) -> None:
        self.done += items
        self.tokens += tokens
        if self.tty:
            dt = max(time.perf_counter() - self.t0, 1e-9)
            width = 24
            fill = width * self.done // max(self.total, 1)
            self.stream.write(
                f"\r[{'#' * fill}{'.' * (width - fill)}] {self.done}/{self.total} "
                f"{self.done / dt:.1f} items/s {self.tokens / dt:.0f} tokens/s"
            )
            self.stream.flush()

    def close(self) -> None:
        if self.tty:
            self.stream.write("\n")


@contextmanager
def sigterm_interrupts() -> Iterator[None]:
    """Turn SIGTERM into KeyboardInterrupt, so cleanup runs as it does for Ctrl-C."""

    def raise_interrupt(signum: int, frame: object) -> None:
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, raise_interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


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
    with sigterm_interrupts():
        try:
            return _run(args)
        except KeyboardInterrupt:
            print("mmferry encode: interrupted; nothing written", file=sys.stderr)
            return 130


def _run(args: argparse.Namespace) -> int:
    from mmferry.server.encoded import EncodedItem, save_file

    files, failed = expand_inputs(args.inputs)
    if not files:
        for src, why in failed:
            print(f"  {src}: {why}", file=sys.stderr)
        print("mmferry encode: no inputs to encode; nothing written", file=sys.stderr)
        return 2
    proc, enc = build(args)
    print(f"mmferry encode: {len(files)} inputs with {enc!r}", file=sys.stderr, flush=True)
    t0 = time.perf_counter()
    bar = Progress(len(files))
    prepared = []
    for path in files:
        try:
            if path.suffix.lower() in VIDEO_SUFFIXES:
                item = proc.video(str(path), layout=args.layout)
            else:
                item = proc.image(str(path), layout=args.layout)
        except (ValueError, ImportError) as e:
            failed.append((str(path), str(e)))
            bar.update(1, 0)
            continue
        prepared.append((path, item))
    done: dict[str, object] = {}
    encoded: list[EncodedItem] = []
    for batch in _batches(prepared, max(args.batch_patches, 1)):
        # Repeats (same hash) are encoded once.
        todo = {it.hash: it for _, it in batch if it.hash not in done}
        for key, out in zip(todo, enc(list(todo.values()))):
            done[key] = out
        for path, it in batch:
            encoded.append(EncodedItem.of(it, done[it.hash], source=str(path)))
        bar.update(len(batch), sum(it.num_tokens for _, it in batch))
    bar.close()
    for src, why in failed:
        print(f"  FAILED {src}: {why}", file=sys.stderr)
    if not encoded:
        print(f"mmferry encode: all {len(failed)} inputs failed; nothing written", file=sys.stderr)
        return 2
    _write_atomic(encoded, args.out, save_file)
    tokens = sum(e.num_tokens for e in encoded)
    dt = time.perf_counter() - t0
    print(
        f"mmferry encode: wrote {len(encoded)} items ({tokens} tokens) to {args.out} in "
        f"{dt:.1f} s; {len(failed)} failed",
        file=sys.stderr,
    )
    return 1 if failed else 0


def _write_atomic(items: list, out: Path, save) -> None:
    out = out.resolve()
    out.parent.mkdir(parents=True, exist_ok=True)
    # Same folder as the target, so the rename is atomic (one filesystem).
    fd, tmp = tempfile.mkstemp(prefix=f".{out.name}.", suffix=".tmp", dir=out.parent)
    os.close(fd)
    umask = os.umask(0)
    os.umask(umask)
    try:
        os.chmod(tmp, 0o666 & ~umask)  # mkstemp makes it private; the output is an ordinary file
        save(items, tmp)
        os.replace(tmp, out)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
