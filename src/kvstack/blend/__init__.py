"""Reuse of document KV in any order (RAG): a chunk cache keyed by content, not position, and
selective recompute (CacheBlend-style blending) of the reused tokens that matter most.

Pure-Python values (`Chunk`, `BlendParams`) import nothing heavy; the rest is torch.
"""

from kvstack.blend.params import BlendError, BlendParams, Chunk

__all__ = ["BlendError", "BlendParams", "Chunk"]
