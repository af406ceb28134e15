"""Entries: the rows come back bit for bit, and anything but the asked-for rows is refused."""

from __future__ import annotations

import pytest
import torch

from mmferry.store.entry import (
    EntryError,
    ModelIdentity,
    entry_key,
    entry_parts,
    read_entry,
)

MODEL = ModelIdentity("Qwen3-VL-2B", "0" * 32)
OTHER = ModelIdentity("Qwen3-VL-2B", "1" * 32)


def _rows(dtype: torch.dtype, deepstack: int = 3, n: int = 7, d: int = 16):
    g = torch.Generator().manual_seed(0)
    embeds = torch.randn(n, d, generator=g).to(dtype)
    return embeds, tuple(torch.randn(n, d, generator=g).to(dtype) for _ in range(deepstack))


def _bytes(parts) -> bytes:
    return b"".join(bytes(memoryview(p)) for p in parts)


def _read(data, key, *, model=MODEL, dtype=torch.float32, n=7, d=16, deepstack=3):
    return read_entry(
        data, key=key, model=model, dtype=dtype, num_tokens=n, hidden=d, deepstack=deepstack
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("deepstack", [0, 3])
def test_round_trip_is_bit_exact(dtype, deepstack):
    embeds, ds = _rows(dtype, deepstack)
    key = entry_key("ab" * 16, MODEL, dtype)
    data = _bytes(entry_parts(key, MODEL, embeds, ds))
    got, got_ds = _read(data, key, dtype=dtype, deepstack=deepstack)
    assert torch.equal(got.view(torch.uint8), embeds.view(torch.uint8))
    assert len(got_ds) == deepstack
    for a, b in zip(got_ds, ds):
        assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))
    # A uint8 tensor (what a store read fills) is read in place, without a copy.
    buf = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    got, _ = _read(buf, key, dtype=dtype, deepstack=deepstack)
    assert got.untyped_storage().data_ptr() == buf.untyped_storage().data_ptr()


def test_key_holds_model_dtype_and_layout_version():
    h = "cd" * 16
    keys = {
        entry_key(h, MODEL, torch.float32),
        entry_key(h, OTHER, torch.float32),
        entry_key(h, MODEL, torch.bfloat16),
        entry_key("ef" * 16, MODEL, torch.float32),
    }
    assert len(keys) == 4
    assert entry_key(h, MODEL, torch.float32).startswith("mmferry/v1/")
    # A checkpoint path's separators never reach the key.
    assert (
        "/" not in entry_key(h, ModelIdentity("a/b c", "2" * 32), torch.float32)[11:].split("/")[0]
    )


def test_refusals():
    embeds, ds = _rows(torch.float32)
    key = entry_key("ab" * 16, MODEL, torch.float32)
    good = _bytes(entry_parts(key, MODEL, embeds, ds))
    foreign = _bytes(entry_parts(key, OTHER, embeds, ds))
    with pytest.raises(EntryError, match="model"):
        _read(foreign, key)  # another model's rows under this key
    with pytest.raises(EntryError, match="key"):
        _read(good, entry_key("ff" * 16, MODEL, torch.float32))  # another item's entry
    with pytest.raises(EntryError, match="shape"):
        _read(good, key, n=8)  # the item has another token count
    with pytest.raises(EntryError, match="deepstack"):
        _read(good, key, deepstack=2)
    with pytest.raises(EntryError, match="dtype"):
        _read(good, key, dtype=torch.bfloat16)
    with pytest.raises(EntryError, match="bytes of rows"):
        _read(good[:-4], key)  # truncated
    with pytest.raises(EntryError, match="bytes of rows"):
        _read(good + b"\0" * 64, key)  # too long
    with pytest.raises(EntryError, match="not an mmferry entry"):
        _read(b"\0" * len(good), key)
    with pytest.raises(EntryError, match="not an mmferry entry"):
        _read(good.replace(b"MMFE\x01", b"MMFE\x02", 1), key)  # another layout version
    with pytest.raises(EntryError, match="prefix"):
        _read(good[:5], key)
    with pytest.raises(EntryError, match="header"):
        _read(good[:40], key)  # the header runs past the end
    broken = bytearray(good)
    broken[12] = ord("!")  # the JSON header itself
    with pytest.raises(EntryError, match="JSON"):
        _read(bytes(broken), key)


def test_model_identity_tells_weights_apart():
    a, b = torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)
    torch.manual_seed(0)
    ia = ModelIdentity.of("m", a)
    assert ModelIdentity.of("m", a) == ia
    assert ModelIdentity.of("m", b) != ia
    with torch.no_grad():
        b.load_state_dict(a.state_dict())
    assert ModelIdentity.of("m", b) == ia
    with torch.no_grad():
        b.bias[0] += 1e-6
    assert ModelIdentity.of("m", b) != ia


def test_checkpoint_identity_is_its_vision_weights(tmp_path):
    """The identity an engine computes from the checkpoint folder: the same for a copy sharded
    differently, another for other vision weights, blind to language-model weights."""
    from mmferry.testing import save_tiny_checkpoint

    folder, _ = save_tiny_checkpoint("qwen2_5_vl", tmp_path / "ckpt")
    ident = ModelIdentity.of_checkpoint(folder)
    assert ident.name == "ckpt" and len(ident.weights) == 32
    assert ModelIdentity.of_checkpoint(folder) == ident
    resharded, _ = save_tiny_checkpoint("qwen2_5_vl", tmp_path / "ckpt2", max_shard_size="200KB")
    assert len(list(resharded.glob("*.safetensors"))) > 1
    assert ModelIdentity.of_checkpoint(resharded).weights == ident.weights
    from safetensors.torch import load_file, save_file

    (path,) = folder.glob("*.safetensors")
    state = load_file(path)
    lm = next(k for k in state if "visual" not in k)
    state[lm] = state[lm] + 1
    save_file(state, path, metadata={"format": "pt"})
    assert ModelIdentity.of_checkpoint(folder).weights == ident.weights
    vis = next(k for k in state if "visual" in k and state[k].is_floating_point())
    state[vis] = state[vis] + 1e-3
    save_file(state, path, metadata={"format": "pt"})
    assert ModelIdentity.of_checkpoint(folder).weights != ident.weights


@pytest.mark.parametrize("family", ["gemma3", "glm4v"])
def test_generic_checkpoint_identity_is_its_vision_weights(tmp_path, family):
    """A checkpoint without a native spec: the generic encoder's vision tensors as stored, so the
    same values saved in another dtype give the same identity; another vision weight gives
    another, a language-model weight none."""
    from safetensors.torch import load_file, save_file

    from mmferry.testing.families import save_family_checkpoint

    folder = save_family_checkpoint(family, tmp_path / "ckpt")
    (path,) = folder.glob("*.safetensors")
    # bfloat16 values saved as bfloat16, then the very same values as float32.
    state = {
        k: v.to(torch.bfloat16) if v.is_floating_point() else v for k, v in load_file(path).items()
    }
    save_file(state, path, metadata={"format": "pt"})
    ident = ModelIdentity.of_checkpoint(folder)
    assert ident.name == "ckpt" and len(ident.weights) == 32
    assert ModelIdentity.of_checkpoint(folder, "auto") == ident
    assert ModelIdentity.of_checkpoint(folder, "generic") == ident
    wide = {k: v.float() if v.is_floating_point() else v for k, v in state.items()}
    save_file(wide, path, metadata={"format": "pt"})
    assert ModelIdentity.of_checkpoint(folder) == ident
    lm = next(k for k in wide if "language_model" in k)
    wide[lm] = wide[lm] + 1
    save_file(wide, path, metadata={"format": "pt"})
    assert ModelIdentity.of_checkpoint(folder) == ident
    vis = next(k for k in wide if ("vision" in k or "visual" in k) and k.endswith("weight"))
    wide[vis] = wide[vis].clone()
    wide[vis].view(-1)[0] += 1e-3
    save_file(wide, path, metadata={"format": "pt"})
    assert ModelIdentity.of_checkpoint(folder) != ident


def test_generic_and_native_identities_of_one_checkpoint_differ(tmp_path):
    """A Qwen checkpoint read through the generic family (`--family generic`) is keyed apart
    from the native one: the two paths' rows differ in float rounding."""
    from mmferry.testing import save_tiny_checkpoint

    folder, _ = save_tiny_checkpoint("qwen2_5_vl", tmp_path / "ckpt")
    native = ModelIdentity.of_checkpoint(folder)
    assert ModelIdentity.of_checkpoint(folder, "auto") == native
    generic = ModelIdentity.of_checkpoint(folder, "generic")
    assert generic.name == native.name and generic.weights != native.weights
    assert ModelIdentity.of_checkpoint(folder, "generic") == generic
