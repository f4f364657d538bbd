"""The global suffix trees: recent outputs of this engine's model, one history per tenant.

A tenant is a request's cache salt (the server derives it from the API key and the user's
cache_salt), so a draft never comes from another tenant's text: an accepted draft is a faster
step, and a faster step would tell one tenant what another wrote. The store is bounded in
outputs and in tokens over all tenants together; adding past either bound evicts the oldest
outputs first (never fails). A tenant's history is the concatenation of its outputs with a
separator between them, rebuilt lazily after a change.
"""

from __future__ import annotations

from collections import OrderedDict
from itertools import count

import numpy as np
import numpy.typing as npt

from kvstack.drafts.suffix_tree import SEPARATOR

Tenant = str | None


class _History:
    def __init__(self) -> None:
        self.outputs: OrderedDict[int, npt.NDArray[np.int32]] = OrderedDict()
        self._corpus: npt.NDArray[np.int32] | None = None

    def changed(self) -> None:
        self._corpus = None

    def corpus(self) -> npt.NDArray[np.int32]:
        if self._corpus is None:
            parts: list[npt.NDArray[np.int32]] = []
            for output in self.outputs.values():
                parts += [output, np.array([SEPARATOR], dtype=np.int32)]
            self._corpus = np.concatenate(parts) if parts else np.empty(0, dtype=np.int32)
        return self._corpus


class SuffixStore:
    """`max_outputs`, `max_tokens`: the bounds over all tenants together (0 keeps nothing)."""

    def __init__(self, max_outputs: int, max_tokens: int) -> None:
        self.max_outputs = max_outputs
        self.max_tokens = max_tokens
        self._tenants: dict[Tenant, _History] = {}
        self._order: OrderedDict[int, Tenant] = OrderedDict()  # output id -> tenant, oldest 1st
        self._ids = count()
        self.num_tokens = 0
        self.num_evicted = 0

    def add(self, tenant: Tenant, token_ids: list[int]) -> None:
        """Keep an output for its tenant's later drafts, evicting the oldest outputs to make
        room; one longer than the whole bound keeps only its last tokens."""
        if not token_ids or self.max_outputs <= 0 or self.max_tokens <= 0:
            return
        kept = np.asarray(token_ids[-self.max_tokens:], dtype=np.int32)
        while self._order and (len(self._order) >= self.max_outputs
                               or self.num_tokens + len(kept) > self.max_tokens):
            self._evict_oldest()
        output_id = next(self._ids)
        history = self._tenants.setdefault(tenant, _History())
        history.outputs[output_id] = kept
        history.changed()
        self._order[output_id] = tenant
        self.num_tokens += len(kept)

    def corpus(self, tenant: Tenant) -> npt.NDArray[np.int32] | None:
        """The tenant's outputs, separated; None when it has none."""
        history = self._tenants.get(tenant)
        return history.corpus() if history is not None else None

    def drop(self, tenant: Tenant) -> int:
        """Forget a tenant's outputs (its key was removed); how many were dropped."""
        history = self._tenants.pop(tenant, None)
        if history is None:
            return 0
        for output_id, output in history.outputs.items():
            del self._order[output_id]
            self.num_tokens -= len(output)
        return len(history.outputs)

    @property
    def num_outputs(self) -> int:
        return len(self._order)

    def check(self) -> None:
        """Integrity: the order and the tenants' outputs agree, and the bounds hold."""
        held = {i: t for t, h in self._tenants.items() for i in h.outputs}
        assert held == dict(self._order), "suffix store: order and tenants disagree"
        tokens = sum(len(o) for h in self._tenants.values() for o in h.outputs.values())
        assert tokens == self.num_tokens <= self.max_tokens
        assert self.num_outputs <= self.max_outputs
        assert all(h.outputs for h in self._tenants.values()), "an empty tenant is kept"

    def _evict_oldest(self) -> None:
        output_id, tenant = self._order.popitem(last=False)
        history = self._tenants[tenant]
        self.num_tokens -= len(history.outputs.pop(output_id))
        self.num_evicted += 1
        if history.outputs:
            history.changed()
        else:
            del self._tenants[tenant]
