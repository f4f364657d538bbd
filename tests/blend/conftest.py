"""Blending fixtures: a 4-layer tiny random model (the check layer needs layers after it)."""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers.tiny_models import make_tiny_hf_folder


@pytest.fixture(scope="session")
def tiny4(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_hf_folder(tmp_path_factory.mktemp("blend"), "gqa", num_hidden_layers=4,
                               max_position_embeddings=512)
