"""The library pages' API lists (docs/library/) and each package's `__all__` agree, both ways."""

from __future__ import annotations

import importlib
import re
from pathlib import Path

import pytest

import mmferry as mf

LIBRARY = Path(__file__).resolve().parent.parent / "docs" / "library"
# A group's first line: **Group** (`mmferry.sub`) — `name`, `name`, ...  (package optional)
GROUP = re.compile(r"^\*\*[^*]+\*\*(?: \(`(mmferry(?:\.\w+)*)`\))? — (.+)$", re.M)
PACKAGES = [
    "mmferry",
    "mmferry.transport",
    "mmferry.encoder",
    "mmferry.feed",
    "mmferry.models",
    "mmferry.testing",
    "mmferry.chat",
    "mmferry.proxy",
]


def readme_lists() -> dict[str, set[str]]:
    api = "\n".join(p.read_text() for p in sorted(LIBRARY.glob("*.md")))
    lists: dict[str, set[str]] = {}
    for package, names in GROUP.findall(api):
        lists.setdefault(package or "mmferry", set()).update(re.findall(r"`(\w+)`", names))
    return lists


@pytest.mark.parametrize("package", PACKAGES)
def test_readme_lists_every_exported_name_and_nothing_else(package):
    exported = set(importlib.import_module(package).__all__) - {"__version__"}
    listed = readme_lists().get(package, set())
    assert exported - listed == set(), f"exported by {package} but not in docs/library"
    assert listed - exported == set(), f"in docs/library under {package} but not exported"


@pytest.mark.parametrize(
    "package, name",
    [(p, n) for p in PACKAGES for n in importlib.import_module(p).__all__ if n != "__version__"],
)
def test_every_public_name_resolves(package, name):
    module = importlib.import_module(package)
    exports = getattr(module, "_EXPORTS", None)
    obj = getattr(module, name)
    if exports is not None:
        assert obj is getattr(importlib.import_module(exports[name]), name)


def test_unknown_name_is_an_attribute_error():
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        mf.nope  # noqa: B018
