"""The documentation: the site builds with every warning an error, and its commands run.

Every fenced `bash` / `sh` / `python` block in README.md and docs/ (a block a reader would run)
is preceded by a marker comment, the line just before its fence:

- `<!-- docs-test: run -->`: run here, as written. Python blocks run in this interpreter, each
  page's blocks in one namespace in page order (a later block may use an earlier one's names),
  from a scratch folder. Shell blocks run with `bash -eu` from a scratch folder in which `.venv`
  is this checkout's environment, so `.venv/bin/mmferry` works as in a clone.
- `<!-- docs-test: skip: REASON -->`: not run here; REASON says why (a GPU, a real checkpoint,
  a second host) and, where one exists, which test runs the same thing on a tiny checkpoint.

A block without a marker fails `test_every_runnable_block_is_marked`, so a new command cannot
land in the docs untested by oversight. Blocks of other languages (`text`, `json`, none) are
output and illustrations, not commands.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
RUNNABLE = {"bash", "sh", "shell", "python", "py"}
FENCE = re.compile(
    r"^(?P<indent> *)```(?P<lang>[\w+-]*)[^\n]*\n(?P<body>.*?)^(?P=indent)```", re.M | re.S
)
MARK = re.compile(r"<!-- docs-test: (run|skip: (.+?)) -->\s*$")


@dataclass(frozen=True)
class Block:
    page: str
    line: int
    lang: str
    body: str
    mark: str | None  # "run", "skip", or None (unmarked)
    reason: str


def pages() -> list[Path]:
    docs = [p for p in sorted((ROOT / "docs").rglob("*.md")) if "_hooks" not in p.parts]
    return [ROOT / "README.md", *docs]


def blocks(path: Path) -> list[Block]:
    text = path.read_text()
    out = []
    for m in FENCE.finditer(text):
        lang = m["lang"].lower()
        if lang not in RUNNABLE:
            continue
        line = text.count("\n", 0, m.start()) + 1
        before = text[: m.start()].rstrip("\n").rsplit("\n", 1)[-1].strip()
        mark = MARK.search(before)
        body = "\n".join(ln[len(m["indent"]) :] for ln in m["body"].split("\n"))
        kind = None if mark is None else mark[1].split(":")[0]
        reason = "" if mark is None or mark[2] is None else mark[2].strip()
        out.append(Block(str(path.relative_to(ROOT)), line, lang, body, kind, reason))
    return out


ALL = [b for p in pages() for b in blocks(p)]


def test_the_docs_have_runnable_blocks():
    assert sum(b.mark == "run" for b in ALL) >= 5, "the docs run (almost) nothing"


def test_every_runnable_block_is_marked():
    unmarked = [f"{b.page}:{b.line}" for b in ALL if b.mark is None]
    assert not unmarked, f"mark these blocks `docs-test: run` or `skip: REASON`: {unmarked}"
    vague = [f"{b.page}:{b.line}" for b in ALL if b.mark == "skip" and len(b.reason.split()) < 4]
    assert not vague, f"a skip says why in a few words: {vague}"


def _scratch(tmp_path: Path) -> Path:
    (tmp_path / ".venv").symlink_to(ROOT / ".venv")
    return tmp_path


RUN_PAGES = sorted({b.page for b in ALL if b.mark == "run"})


@pytest.mark.slow
@pytest.mark.parametrize("page", RUN_PAGES)
def test_page_blocks_run(page, tmp_path, monkeypatch):
    """Every `run` block of the page runs, in order, and exits 0."""
    work = _scratch(tmp_path)
    monkeypatch.chdir(work)
    scope: dict = {"__name__": "__docs__"}
    env = {**os.environ, "PYTHONPATH": str(ROOT), "COLUMNS": "100"}
    for b in (b for b in ALL if b.page == page and b.mark == "run"):
        where = f"{b.page}:{b.line}"
        if b.lang in {"python", "py"}:
            exec(compile(b.body, where, "exec"), scope)
        else:
            r = subprocess.run(
                ["bash", "-eu", "-o", "pipefail", "-c", b.body],
                cwd=work,
                env=env,
                capture_output=True,
                text=True,
                timeout=600,
            )
            assert r.returncode == 0, f"{where} exited {r.returncode}:\n{r.stdout}\n{r.stderr}"


@pytest.mark.slow
def test_the_site_builds_strict(tmp_path):
    """`mkdocs build --strict`: any warning (a broken link or anchor, a page out of the nav,
    a docstring mkdocstrings cannot read) fails; the CLI and API pages are generated."""
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    r = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "-d", str(tmp_path / "site")],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert r.returncode == 0, r.stderr[-4000:]
    cli = (tmp_path / "site" / "reference" / "cli" / "index.html").read_text()
    for option in ("--limit-request-bytes", "--encoder-timeout", "--out"):
        assert option in cli, f"{option} missing from the generated CLI page"
    api = (tmp_path / "site" / "reference" / "api" / "index.html").read_text()
    assert "merge_vision_embeddings" in api and "prefill_step" in api


def test_operations_names_every_limit_and_timeout():
    """docs/operations/index.md names every `--limit-*` and `--*-timeout` option of `mmferry
    serve` and `mmferry proxy`, read from the parsers, so a new one cannot go unexplained."""
    from mmferry.cli import build_parser

    page = (ROOT / "docs" / "operations" / "index.md").read_text()
    _, parsers, _ = build_parser()
    options = {
        opt
        for name in ("serve", "proxy")
        for action in parsers[name]._actions
        if action.help != "==SUPPRESS=="
        for opt in action.option_strings
        if opt.startswith("--limit-") or opt.endswith("-timeout")
    }
    assert len(options) >= 8, options
    missing = sorted(o for o in options if f"`{o}`" not in page)
    assert not missing, f"docs/operations/index.md does not name {missing}"
