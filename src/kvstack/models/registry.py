"""Architecture name -> model class. A family module registers itself on import."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from kvstack.errors import UnsupportedModelError

_REGISTRY: dict[str, type] = {}


def register(*architectures: str) -> Callable[[type], type]:
    def wrap(cls: type) -> type:
        for name in architectures:
            _REGISTRY[name] = cls
        return cls

    return wrap


def model_class(architecture: str) -> Any:
    if architecture not in _REGISTRY:
        known = ", ".join(sorted(_REGISTRY))
        raise UnsupportedModelError(
            f"architecture {architecture!r} is not supported; supported: {known}"
        )
    return _REGISTRY[architecture]


def supported_architectures() -> list[str]:
    return sorted(_REGISTRY)
