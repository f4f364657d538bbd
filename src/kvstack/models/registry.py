"""Architecture name -> model family. A family module registers itself on import."""

from __future__ import annotations

from kvstack.errors import UnsupportedModelError
from kvstack.models.base import ModelFamily

_FAMILIES: dict[str, ModelFamily] = {}


def register(family: ModelFamily) -> ModelFamily:
    for name in family.architectures:
        _FAMILIES[name] = family
    return family


def family_of(architecture: str) -> ModelFamily:
    """The family that runs `architecture`; UnsupportedModelError naming the known ones."""
    if architecture not in _FAMILIES:
        known = ", ".join(sorted(_FAMILIES))
        raise UnsupportedModelError(
            f"architecture {architecture!r} is not supported; supported: {known}"
        )
    return _FAMILIES[architecture]
