"""Stages ask the family's spec; only `mmferry/models/` may name a family in a comparison."""

from __future__ import annotations

import re
from pathlib import Path

from mmferry.models import all_specs

PACKAGE = Path(__file__).resolve().parents[2] / "mmferry"

# `family ==`, `model_type in`, `.family !=`, `model_type.startswith(` ...
ATTRIBUTE_TEST = re.compile(r"\b(family|model_type)\b\s*(==|!=|\bnot in\b|\bin\b|\.startswith)")


def _names() -> set[str]:
    names = set()
    for spec in all_specs():
        names |= {spec.model_type, spec.family, spec.preset_name}
    return names


def _literal_comparisons(line: str, names: set[str]) -> list[str]:
    found = []
    for name in names:
        quoted = re.escape(f'"{name}"') + "|" + re.escape(f"'{name}'")
        if re.search(rf"(==|!=|\bin\b)\s*[\(\[{{]?[^#]*({quoted})", line) or re.search(
            rf"({quoted})\s*(==|!=|\bin\b)", line
        ):
            found.append(name)
    return found


def test_no_stage_branches_on_a_family_name():
    names = _names()
    offenders = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if "models" in path.relative_to(PACKAGE).parts:
            continue
        for n, line in enumerate(path.read_text().splitlines(), 1):
            code = line.split("#", 1)[0]
            if ATTRIBUTE_TEST.search(code) or _literal_comparisons(code, names):
                offenders.append(f"{path.relative_to(PACKAGE.parent)}:{n}: {line.strip()}")
    assert not offenders, "family-name branches outside mmferry/models/:\n" + "\n".join(offenders)


def test_the_check_catches_a_branch():
    names = _names()
    assert ATTRIBUTE_TEST.search('if cfg.family == "qwen3_vl":')
    assert ATTRIBUTE_TEST.search("if model_type.startswith(prefix):")
    assert _literal_comparisons('if "qwen2_5_vl" in kinds:', names)
    assert _literal_comparisons('ok = name in ("qwen3-vl", "x")', names)
    assert not _literal_comparisons('proc = Processor.for_model("qwen3-vl")', names)
