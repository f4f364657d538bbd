"""Nearest-neighbour search over unit vectors by id (faiss), restricted to a set of ids.

Exact inner-product search (`IndexFlatIP` under an id map): the cache holds thousands of
entries, not millions, and an exact scan of them costs well under a millisecond; exactness
also means a lookup can never miss a cached answer that is over the threshold.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterable
from pathlib import Path

import numpy as np

from kvstack.semantic.embedder import INSTALL_HINT, SemanticCacheUnavailableError


class IndexFileError(Exception):
    """An index file is missing, truncated, corrupted or of another shape."""


def _faiss():  # faiss has no type stubs
    try:
        import faiss
    except ImportError as err:
        raise SemanticCacheUnavailableError(
            f"the semantic cache needs faiss-cpu; {INSTALL_HINT}"
        ) from err
    faiss.omp_set_num_threads(1)  # small scans: threads only add wake-up latency
    return faiss


class VectorIndex:
    def __init__(self, dim: int) -> None:
        self.dim = dim
        self._faiss = _faiss()
        self._index = self._faiss.IndexIDMap2(self._faiss.IndexFlatIP(dim))

    def __len__(self) -> int:
        return int(self._index.ntotal)

    def add(self, ids: Iterable[int], vectors: np.ndarray) -> None:
        """Add rows of `vectors` ([N, dim]) under `ids`; an id must not be present already."""
        ids_arr = np.fromiter(ids, dtype=np.int64)
        if len(ids_arr):
            rows = np.ascontiguousarray(vectors, dtype=np.float32).reshape(len(ids_arr), self.dim)
            self._index.add_with_ids(rows, ids_arr)

    def remove(self, ids: Iterable[int]) -> None:
        ids_arr = np.fromiter(ids, dtype=np.int64)
        if len(ids_arr):
            self._index.remove_ids(ids_arr)

    def vector(self, entry_id: int) -> np.ndarray:
        return self._index.reconstruct(entry_id)

    def ids(self) -> set[int]:
        return set(self._faiss.vector_to_array(self._index.id_map).tolist())

    def search(self, query: np.ndarray, among: Iterable[int], k: int) -> list[tuple[int, float]]:
        """Up to `k` (id, inner product) among the ids `among`, best first."""
        allowed = np.fromiter(among, dtype=np.int64)
        if not len(allowed) or k < 1:
            return []
        params = self._faiss.SearchParameters(sel=self._faiss.IDSelectorBatch(allowed))
        scores, found = self._index.search(query.reshape(1, self.dim).astype(np.float32),
                                           min(k, len(allowed)), params=params)
        return [(int(i), float(s)) for i, s in zip(found[0], scores[0], strict=True) if i >= 0]

    # -- persistence -------------------------------------------------------------------------

    def save(self, path: Path) -> str:
        """Write atomically (temp file, fsync, rename); returns the file's sha256."""
        data = self._faiss.serialize_index(self._index).tobytes()
        tmp = path.with_name(f".{path.name}.tmp")
        with tmp.open("wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        return hashlib.sha256(data).hexdigest()

    @classmethod
    def load(cls, path: Path, dim: int, sha256: str) -> VectorIndex:
        """The index saved at `path`; raises IndexFileError unless its bytes hash to `sha256`
        (checked before faiss parses anything) and it holds vectors of `dim`."""
        try:
            data = path.read_bytes()
        except OSError as err:
            raise IndexFileError(f"cannot read {path}: {err}") from err
        if hashlib.sha256(data).hexdigest() != sha256:
            raise IndexFileError(f"{path} does not match its checksum")
        index = cls(dim)
        try:
            loaded = index._faiss.deserialize_index(np.frombuffer(data, dtype=np.uint8))
        except RuntimeError as err:
            raise IndexFileError(f"faiss cannot read {path}: {err}") from err
        if loaded.d != dim or not isinstance(loaded, index._faiss.IndexIDMap2):
            raise IndexFileError(f"{path} holds another kind of index")
        index._index = loaded
        return index
