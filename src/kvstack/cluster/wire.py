"""What travels between the ingress and the engine replicas, and what replicas publish.

Requests and replies are plain dataclasses (Ray pickles them). A replica's routing stats, which
Ray Serve polls every `request_routing_stats_period_s` and re-sends to every router whenever
any replica's change, are kept small: the replica's layout, its load, and its last few
`BlockEvents` batches (keys as 8-byte strings), never a snapshot. A router that missed more
batches than a report carries fetches a `Snapshot` with a call aimed at that replica.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from kvstack.cluster.events import BlockEvents, BlockKey, decode_keys, encode_keys
from kvstack.cluster.router import LoadReport
from kvstack.cluster.scoring import Layout
from kvstack.engine.info import ModelInfo
from kvstack.errors import KvstackError
from kvstack.sampling_params import SamplingParams

STATS_KEY = "kvstack"  # our entry in a replica's routing stats dict
STATS_VERSION = 1


@dataclass(frozen=True)
class ReplicaRequest:
    """One generation, as the ingress sends it to whichever replica the router picks."""

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    cache_salt: str | None
    keys: tuple[BlockKey, ...]  # the prompt's full-block keys, hashed as the engine does
    draft_token_ids: list[int] | None = None
    # The prompt's text, for routers that read text (Ray's PrefixCacheAffinityRouter looks
    # for a `prompt` attribute); None when the policy in use needs no text.
    prompt: str | None = None
    exclude: tuple[str, ...] = ()  # replicas never to pick (the one a retry lost)
    # A prefill replica's `pd.handoff.Handoff` (prompt blocks to fetch), for a decode replica.
    handoff: Any = None
    snapshot_at: tuple[int, ...] = ()  # cache breakpoints (a hybrid model's state snapshots)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)


@dataclass(frozen=True)
class Control:
    """A call for one replica (`target`; None: any): pins, snapshots, stats, description."""

    target: str | None = None
    args: tuple[Any, ...] = ()
    request_id: str = ""  # routers look for an id; control calls are never decisions

    @property
    def prompt(self) -> str:
        """Text for routers that insist on reading some (Ray's PrefixCacheAffinityRouter
        fails a request without it); such a router cannot aim a call at one replica."""
        return f"kvstack control call for replica {self.target or 'any'}"


@dataclass(frozen=True)
class ReplicaInfo:
    """What the ingress learns from a replica once: the model, its tokenizer, the layout its
    block hashes depend on. The ingress loads no weights of its own."""

    name: str
    model: ModelInfo
    tokenizer: Any
    layout: Layout


class ReplicaGoneError(Exception):
    """The replica died or cannot be reached (transport level; retried or reported)."""

    def __init__(self, message: str, replica: str | None = None) -> None:
        super().__init__(message)
        self.replica = replica


class ReplicaLostError(KvstackError):
    """The replica serving this request died after the answer had begun."""

    http_status = 503
    error_type = "api_error"


class WrongReplicaError(KvstackError):
    """A call aimed at one replica reached another (that replica is gone)."""

    http_status = 503
    error_type = "api_error"


# -- routing stats ---------------------------------------------------------------------------


@dataclass(frozen=True)
class ReplicaReport:
    """One replica's routing stats, decoded."""

    epoch: str
    layout: Layout
    capacity_blocks: int
    batches: tuple[BlockEvents, ...]
    load: LoadReport
    extra: dict[str, Any] = field(default_factory=dict)


def encode_report(epoch: str, layout: Layout, capacity_blocks: int,
                  batches: Sequence[BlockEvents], load: LoadReport) -> dict[str, Any]:
    payload = {
        "v": STATS_VERSION,
        "epoch": epoch,
        "layout": (layout.fingerprint, layout.block_size, layout.kv_dtype),
        "capacity": capacity_blocks,
        "batches": tuple((b.seq, encode_keys(b.stored), encode_keys(b.removed), b.cleared)
                         for b in batches),
        "load": (load.queued_prefill_tokens, load.queued_requests, load.running_requests,
                 load.as_of),
    }
    return {STATS_KEY: payload}


def decode_report(stats: Mapping[str, Any] | None) -> ReplicaReport | None:
    """The report in a replica's routing stats; None before its first one (or another
    format: such a replica is served by load only, never by affinity)."""
    payload = (stats or {}).get(STATS_KEY)
    if not isinstance(payload, dict) or payload.get("v") != STATS_VERSION:
        return None
    epoch = payload["epoch"]
    batches = tuple(BlockEvents(epoch, seq, decode_keys(stored), decode_keys(removed), cleared)
                    for seq, stored, removed, cleared in payload["batches"])
    fingerprint, block_size, kv_dtype = payload["layout"]
    queued, queued_requests, running, as_of = payload["load"]
    return ReplicaReport(epoch, Layout(fingerprint, int(block_size), kv_dtype),
                         int(payload["capacity"]), batches,
                         LoadReport(float(queued), int(queued_requests), int(running),
                                    float(as_of)))


def report_bytes(stats: Mapping[str, Any]) -> int:
    """Key bytes a report carries (the batches' keys; framing is Ray's)."""
    payload = stats.get(STATS_KEY) or {}
    return sum(len(stored) + len(removed) for _, stored, removed, _ in payload.get("batches", ()))
