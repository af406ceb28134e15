"""Bundled sample media for demos: three small photographs and a short synthetic video."""

from __future__ import annotations

from pathlib import Path

# Package data (see pyproject's package-data); the folder is deliberately not a package.
_ASSETS = Path(__file__).resolve().parent.parent / "assets"
_IMAGES = ("astronaut.jpg", "coffee.jpg", "chelsea.jpg")
_VIDEO = "moving_pattern.mp4"


def _asset(name: str) -> Path:
    path = _ASSETS / name
    if not path.is_file():
        raise FileNotFoundError(f"bundled sample {name} is missing from {_ASSETS}")
    return path


def sample_images() -> list[Path]:
    """Paths of the bundled sample photographs (public domain / CC0, see assets/README.md)."""
    return [_asset(n) for n in _IMAGES]


def sample_video() -> Path:
    """Path of the bundled 2-second synthetic sample video."""
    return _asset(_VIDEO)
