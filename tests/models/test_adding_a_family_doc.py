"""docs/adding-a-family.md names every `ModelSpec` field, and its required list is enough."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

from mmferry.models import ModelSpec, spec_for

DOC = Path(__file__).parents[2] / "docs" / "adding-a-family.md"


def _section(text: str, start: str, end: str) -> set[str]:
    body = text[text.index(start) : text.index(end)]
    return set(re.findall(r"`([a-z_]+)`", body))


def test_doc_lists_every_field_and_required_ones_build_a_spec() -> None:
    text = DOC.read_text()
    required = _section(text, "Required fields (no default)", "Fields with a default")
    optional = _section(text, "Fields with a default", "`SPECS`")
    fields = {f.name: f for f in dataclasses.fields(ModelSpec)}
    no_default = {
        n
        for n, f in fields.items()
        if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
    }
    assert no_default <= required, f"the doc's required list misses {no_default - required}"
    assert set(fields) <= required | optional, f"undocumented: {set(fields) - required - optional}"
    # A spec built from the doc's required list alone (values from an existing family) works.
    source = spec_for("qwen2.5-vl")
    spec = ModelSpec(**{n: getattr(source, n) for n in required & set(fields)})
    assert spec.vision_from_hf({}).family == source.family
