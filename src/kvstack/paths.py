"""Where kvstack keeps what it derives once and reuses (tokenizers, compiled kernels, ...)."""

from __future__ import annotations

import os
from pathlib import Path


def cache_root() -> Path:
    """$KVSTACK_CACHE_DIR, else ~/.cache/kvstack."""
    return Path(os.environ.get("KVSTACK_CACHE_DIR") or Path.home() / ".cache" / "kvstack")
