"""One request's state as it moves through the engine."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from kvstack.engine.detokenizer import IncrementalDetokenizer
from kvstack.kv.block_hash import BlockHash
from kvstack.kv.block_pool import KVBlock
from kvstack.layers.sampler import SamplingState, make_generator
from kvstack.outputs import RequestMetrics
from kvstack.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED = "finished"


@dataclass(eq=False)
class Request:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    max_tokens: int  # resolved: never past the model's context
    detokenizer: IncrementalDetokenizer
    cache_salt: str | None = None
    status: RequestStatus = RequestStatus.WAITING
    output_token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    prompt_logprobs: list[float | None] = field(default_factory=list)
    num_computed_tokens: int = 0  # tokens whose K/V sit in this request's blocks
    num_cached_tokens: int = -1  # prefix-cache hit at first admission (-1: not admitted yet)
    blocks: list[KVBlock] = field(default_factory=list)
    num_evicted_blocks: int = 0  # window mode: blocks freed between the sinks and `blocks`' rest
    block_hashes: list[BlockHash] = field(default_factory=list)
    num_preemptions: int = 0
    resumed_at_step: int = -1
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    text: str = ""  # output text, stop strings already cut
    num_emitted_chars: int = 0  # how much of `text` a stream has handed out
    metrics: RequestMetrics = field(default_factory=lambda: RequestMetrics(time.perf_counter()))
    sampling: SamplingState = field(init=False)

    def __post_init__(self) -> None:
        self.sampling = SamplingState(
            params=self.params,
            prompt_token_ids=self.prompt_token_ids,
            output_token_ids=self.output_token_ids,
            generator=make_generator(self.params.seed),
        )

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    def token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    def tokens_between(self, start: int, end: int) -> list[int]:
        """Tokens [start, end) of prompt + output, without copying the whole sequence (a
        decode step needs one token)."""
        n = len(self.prompt_token_ids)
        if start >= n:
            return self.output_token_ids[start - n : end - n]
        if end <= n:
            return self.prompt_token_ids[start:end]
        return self.prompt_token_ids[start:] + self.output_token_ids[: end - n]

    @property
    def finished(self) -> bool:
        return self.status is RequestStatus.FINISHED
