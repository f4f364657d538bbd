"""A sequence's embedding from the served model: the mean over its tokens of the final hidden
state (after the final norm), L2-normalized.

The model runs over the one sequence as a single causal prefill with no KV cache
(`kv_storage=None`, no slot mapping): nothing is written into the block pool and no block is
allocated, so a request's cached K/V can neither be read nor overwritten, and nothing is left to
free. Decoder-only models see each token only with what precedes it, so the mean over every
position is the usual pooling for them (e.g. sentence-transformers' `mean` mode).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

from kvstack.layers.attention import AttentionMetadata, PrefillSpan
from kvstack.models.base import CausalLM


def embed(model: CausalLM, token_ids: Sequence[int]) -> torch.Tensor:
    """token_ids (at least one, at most the context) -> float32 [hidden], unit L2 norm."""
    num_tokens = len(token_ids)
    meta = AttentionMetadata(
        slot_mapping=None, decode_rows=None, decode_slots=None, decode_mask=None,
        prefills=[PrefillSpan(0, num_tokens, num_tokens, None)],
        use_kernels=model.use_kernels,
    )
    ids = torch.tensor(list(token_ids), dtype=torch.int64)
    hidden = model.forward(ids, torch.arange(num_tokens), meta, None)  # [T, hidden]
    return F.normalize(hidden.float().mean(dim=0), dim=0)
