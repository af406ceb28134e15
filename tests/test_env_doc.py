"""docs/structure.md names every environment variable `env.py` reads, and no other."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).parents[1]


def _names(text: str) -> set[str]:
    return set(re.findall(r"\b(MMFERRY_[A-Z_]+|WORLD_SIZE|LOCAL_RANK|RANK)\b", text))


def test_structure_doc_lists_every_variable_env_reads() -> None:
    code = (ROOT / "mmferry" / "env.py").read_text()
    read = {
        m.replace("{PREFIX}", "MMFERRY_")
        for m in re.findall(r'f?"(\{PREFIX\}[A-Z_]+|[A-Z_]{4,})"', code)
    }
    read.discard("MMFERRY_")
    doc = (ROOT / "docs" / "structure.md").read_text()
    line = next(ln for ln in doc.split("\n- ") if ln.startswith("`env.py`"))
    assert read, "no variable found in env.py"
    assert _names(line) == read
