"""What a prefill replica hands a decode replica, who holds it meanwhile, and the counters.

A handoff is a list of encoded blocks (`kv/tiers/codec.py`: header + K/V of every layer) put
in a courier's store by the prefill replica; the decode replica fetches them by reference.
The prefill replica keeps the reference under a lease until the decode side acknowledges it
(the ingress relays the `Receipt`) or the lease times out, so nothing leaks either way: once
the last reference is dropped the courier frees the bytes.
"""

from __future__ import annotations

import asyncio
import itertools
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from kvstack.sampling_params import SamplingParams

LEASE_TTL_S = 30.0  # a lease the decode side never acknowledged is freed after this
FETCH_TIMEOUT_S = 10.0  # a decode replica waits this long for the bytes, then recomputes


@dataclass(frozen=True)
class Handoff:
    """A prefill replica's result after the first token: where the blocks are."""

    lease: str
    replica: str  # the prefill replica holding the lease
    ref: Any  # the courier's reference to the encoded blocks
    num_blocks: int  # blocks handed over (a hybrid model's window groups' included)
    num_bytes: int
    num_tokens: int  # the prompt's leading tokens they cover: the hit the decode side gets


@dataclass(frozen=True)
class Receipt:
    """A decode replica's word on a handoff, before any output: what it got and how long the
    fetch took; `fault` names why it got nothing usable (late, lost, corrupt)."""

    lease: str
    num_blocks: int
    num_bytes: int
    seconds: float
    fault: str | None = None


class HandoffMiss(Exception):
    """The bytes did not arrive; `kind` keys the fallback counters."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind


class Courier(Protocol):
    """Moves a list of encoded blocks from one replica to another by reference."""

    def put(self, blocks: list[bytes]) -> Any: ...

    async def get(self, ref: Any, timeout_s: float) -> list[bytes]:
        """The blocks; raises `HandoffMiss` when they are late or gone."""
        ...


class LocalCourier:
    """Replicas in one process (tests, the in-process cluster): refs are keys of a dict,
    dropped when the prefill side's lease ends."""

    def __init__(self) -> None:
        self._objects: dict[int, list[bytes]] = {}
        self._ids = itertools.count()
        self.delay_s = 0.0  # a test's late handoff

    def put(self, blocks: list[bytes]) -> int:
        ref = next(self._ids)
        self._objects[ref] = blocks
        return ref

    def drop(self, ref: int) -> None:
        self._objects.pop(ref, None)

    async def get(self, ref: Any, timeout_s: float) -> list[bytes]:
        if self.delay_s > timeout_s:
            await asyncio.sleep(timeout_s)
            raise HandoffMiss("late", f"handoff not there within {timeout_s} s")
        await asyncio.sleep(self.delay_s)
        blocks = self._objects.get(ref)
        if blocks is None:
            raise HandoffMiss("lost", "the handoff's bytes are gone (lease ended)")
        return blocks

    def __len__(self) -> int:
        return len(self._objects)


class Leases:
    """The prefill side's handoffs not yet acknowledged: each keeps its courier reference
    alive until `release` or, past its deadline, `expire`."""

    def __init__(self, ttl_s: float = LEASE_TTL_S, on_end: Any = None) -> None:
        self.ttl_s = ttl_s
        self._on_end = on_end  # called with the ref when a lease ends (LocalCourier.drop)
        self._lock = threading.Lock()
        self._held: dict[str, tuple[Any, float]] = {}
        self._ids = itertools.count()
        self.num_released = 0
        self.num_expired = 0

    def hold(self, prefix: str, ref: Any, now: float | None = None) -> str:
        lease = f"{prefix}-{next(self._ids)}"
        with self._lock:
            self._held[lease] = (ref, (time.monotonic() if now is None else now) + self.ttl_s)
        return lease

    def release(self, lease: str) -> bool:
        with self._lock:
            entry = self._held.pop(lease, None)
            if entry is not None:
                self.num_released += 1
        if entry is not None and self._on_end is not None:
            self._on_end(entry[0])
        return entry is not None

    def expire(self, now: float | None = None) -> int:
        now = time.monotonic() if now is None else now
        with self._lock:
            gone = [k for k, (_, deadline) in self._held.items() if deadline <= now]
            refs = [self._held.pop(k)[0] for k in gone]
            self.num_expired += len(gone)
        if self._on_end is not None:
            for ref in refs:
                self._on_end(ref)
        return len(gone)

    def __len__(self) -> int:
        with self._lock:
            return len(self._held)


@dataclass
class HandoffCounters:
    """The ingress's figures for /v1/cluster `handoffs` and /metrics."""

    count: int = 0  # handoffs relayed to a decode replica
    blocks: int = 0
    bytes: int = 0
    seconds: float = 0.0  # decode-side fetch time, summed
    whole: int = 0  # requests a decode replica served alone (not handoff-safe)
    local: int = 0  # prompts short enough to prefill on a decode replica (max_local_prefill)
    fallbacks: dict[str, int] = field(default_factory=dict)  # by kind: late, lost, ...

    def add(self, handoff: Handoff, receipt: Receipt) -> None:
        self.count += 1
        self.blocks += receipt.num_blocks
        self.bytes += receipt.num_bytes
        self.seconds += receipt.seconds
        if receipt.fault is not None:
            self.fallback(receipt.fault)

    def fallback(self, kind: str) -> None:
        self.fallbacks[kind] = self.fallbacks.get(kind, 0) + 1

    def as_dict(self) -> dict[str, Any]:
        return {"count": self.count, "blocks": self.blocks, "bytes": self.bytes,
                "seconds": self.seconds,
                "mean_bytes": self.bytes / self.count if self.count else None,
                "mean_seconds": self.seconds / self.count if self.count else None,
                "whole_requests": self.whole, "local_prefills": self.local,
                "fallbacks": dict(self.fallbacks),
                "num_fallbacks": sum(self.fallbacks.values())}


def handoff_safe(sp: SamplingParams, draft_token_ids: Sequence[int] | None) -> bool:
    """True when decoding prompt + first token on another engine gives exactly what one
    engine would: one sample, nothing that depends on the first token having been *output*
    (penalties count output tokens, a seed's stream, a grammar's state, a stop string that
    may straddle it, logprob lists) and more than one token to generate."""
    return (sp.num_sequences == 1 and (sp.max_tokens is None or sp.max_tokens > 1)
            and sp.seed is None and not sp.stop and sp.logprobs is None
            and sp.prompt_logprobs is None and sp.structured_outputs is None
            and sp.repetition_penalty == 1.0 and sp.presence_penalty == 0.0
            and sp.frequency_penalty == 0.0 and not draft_token_ids)
