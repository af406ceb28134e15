"""MkDocs hook: the pages generated from the code at build time, so they cannot drift.

- `<!-- cli-reference -->` becomes every `mmferry` command's `--help`, from the argparse
  parsers `mmferry.cli.build_parser()` builds (the same objects `mmferry` runs).
- `<!-- include-benchmarks -->` becomes BENCHMARKS.md (one file, read on GitHub and here), its
  links into docs/ rewritten to be relative to the benchmarks page.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def cli_reference() -> str:
    from mmferry.cli import build_parser

    # argparse wraps help text to $COLUMNS; a fixed width keeps the page the same everywhere.
    os.environ["COLUMNS"] = "100"
    parser, parsers, _ = build_parser()
    out = ["## `mmferry`", "", "```text", parser.format_help().rstrip(), "```", ""]
    for name, p in parsers.items():
        out += [f"## `mmferry {name}`", "", "```text", p.format_help().rstrip(), "```", ""]
    return "\n".join(out)


def benchmarks() -> str:
    text = (ROOT / "BENCHMARKS.md").read_text()
    text = text.split("\n", 1)[1]  # the page has its own title
    text = re.sub(r"\]\(docs/benchmarks/", "](", text)
    return re.sub(r"\]\(docs/", "](../", text)


def on_page_markdown(markdown: str, page, config, files) -> str:  # noqa: ARG001
    if "<!-- cli-reference -->" in markdown:
        markdown = markdown.replace("<!-- cli-reference -->", cli_reference())
    if "<!-- include-benchmarks -->" in markdown:
        markdown = markdown.replace("<!-- include-benchmarks -->", benchmarks())
    return markdown


API_PACKAGES = (
    "mmferry",
    "mmferry.chat",
    "mmferry.transport",
    "mmferry.encoder",
    "mmferry.feed",
    "mmferry.models",
    "mmferry.proxy",
    "mmferry.testing",
)


def api_reference() -> str:
    """One mkdocstrings entry per public name, from each package's `_EXPORTS` / `__all__`."""
    import importlib

    out: list[str] = []
    for package in API_PACKAGES:
        module = importlib.import_module(package)
        exports = getattr(module, "_EXPORTS", None) or {}
        out += [f"## `{package}`", ""]
        for name in module.__all__:
            if name == "__version__":
                continue
            home = exports.get(name) or getattr(getattr(module, name), "__module__", package)
            out += [f"::: {home}.{name}", "    options:", "      show_root_full_path: false", ""]
    return "\n".join(out)


_markdown_hook = on_page_markdown


def on_page_markdown(markdown: str, page, config, files) -> str:  # noqa: F811
    markdown = _markdown_hook(markdown, page, config, files)
    if "<!-- api-reference -->" in markdown:
        markdown = markdown.replace("<!-- api-reference -->", api_reference())
    return markdown


def _nav_pages(nav) -> set[str]:
    pages: set[str] = set()
    for entry in nav or []:
        if isinstance(entry, str):
            pages.add(entry)
        elif isinstance(entry, dict):
            for value in entry.values():
                pages |= _nav_pages(value) if isinstance(value, list) else {value}
    return pages


def on_config(config):
    """Notes other work drops in docs/incoming/ and that no page took in yet are listed under
    "Incoming notes", so none is orphaned (strict mode refuses a page outside the nav)."""
    incoming = sorted((Path(config["docs_dir"]) / "incoming").glob("*.md"))
    listed = _nav_pages(config["nav"])
    left = [f"incoming/{p.name}" for p in incoming if f"incoming/{p.name}" not in listed]
    if left:
        config["nav"].append({"Incoming notes": left})
    return config
