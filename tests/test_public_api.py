from __future__ import annotations

import importlib

import pytest

import mmferry as mf


@pytest.mark.parametrize("name", [n for n in mf.__all__ if n != "__version__"])
def test_every_public_name_resolves(name):
    obj = getattr(mf, name)
    assert obj is getattr(importlib.import_module(mf._EXPORTS[name]), name)


def test_unknown_name_is_an_attribute_error():
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        mf.nope  # noqa: B018
