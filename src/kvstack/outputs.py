"""What the engine hands back to users: vLLM-shaped request outputs."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class RequestMetrics:
    """Wall-clock timings of one request, in seconds (time.perf_counter based)."""

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None
    last_token_time: float | None = None
    # Seconds between consecutive output tokens (the first entry is the gap after the first).
    inter_token_latencies: list[float] = field(default_factory=list)

    @property
    def ttft(self) -> float | None:
        """Time to first token, from arrival."""
        if self.first_token_time is None:
            return None
        return self.first_token_time - self.arrival_time

    @property
    def total_time(self) -> float | None:
        """From arrival to the finish (or the last token)."""
        end = self.finished_time or self.last_token_time
        return None if end is None else end - self.arrival_time

    def decode_rate(self, num_tokens: int) -> float | None:
        """Tokens per second after the first (the first one is prefill, counted in TTFT)."""
        if num_tokens < 2 or self.first_token_time is None or self.last_token_time is None:
            return None
        elapsed = self.last_token_time - self.first_token_time
        return (num_tokens - 1) / elapsed if elapsed > 0 else None

    @property
    def tpot(self) -> float | None:
        """Mean time per output token after the first."""
        if not self.inter_token_latencies:
            return None
        return sum(self.inter_token_latencies) / len(self.inter_token_latencies)


@dataclass(frozen=True)
class Logprob:
    """One token's log-probability at a position (vLLM's shape): its rank in the model's
    distribution there (1 = most likely) and its text decoded alone."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# Per prompt position: None for the first token, else its token and the k most likely ones.
PromptLogprobs = list[dict[int, Logprob] | None]


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    # Log-probability of each chosen token under the model's raw distribution, when asked for.
    logprobs: list[float] | None = None
    finish_reason: str | None = None  # "stop", "length", "abort" or None while running
    stop_reason: int | str | None = None  # the stop token id or stop string that matched
    # With `logprobs=k > 0`: per token, the k most likely (token id, log-probability) pairs at
    # its position, most likely first.
    top_logprobs: list[list[tuple[int, float]]] | None = None
    # With logprobs: their sum, the sequence's log-probability (best_of ranks by it).
    cumulative_logprob: float | None = None


@dataclass(frozen=True)
class BlendUsage:
    """What a blended request reused (`blend/`). Exact prefix-cache hits are counted in
    `num_cached_tokens`, not here."""

    chunks_hit: int  # chunks past the exact prefix found in the chunk cache
    chunks_missed: int  # chunks past the exact prefix computed in context (and cached later)
    reused_tokens: int  # prompt tokens whose K/V were placed from chunk entries
    recomputed_tokens: int  # of those, the ones recomputed in context through every layer
    # Prompt token-layers computed, over full prefill's (tokens x layers): linear-layer work.
    compute: float
# Where a prompt token's K/V came from (`Provenance.prompt`), in prompt order:
PREFIX_CACHE = "prefix_cache"  # read from the memory prefix cache
TIER = "tier"  # restored from a tier below the memory pool (disk, Redis)
COMPUTED = "computed"  # computed by this request's prefill
BLENDED = "blended"  # placed from a cached chunk and not recomputed (APPROXIMATE, `blend/`)
# and where an output token came from (`Provenance.output`):
DRAFT = "draft"  # a draft token the model verified and accepted (several in one step)
MODEL = "model"  # sampled by the model (one per step, also after a verify step)


@dataclass(frozen=True)
class Provenance:
    """A request's tokens by source, as runs (source, count) in token order. The prompt's
    runs are fixed at the request's first admission (a preempted request recomputes blocks
    it had but keeps its provenance); blended chunks, when they exist, get a source too."""

    prompt: tuple[tuple[str, int], ...] = ()
    output: tuple[tuple[str, int], ...] = ()

    def num_prompt(self, source: str) -> int:
        return sum(n for s, n in self.prompt if s == source)

    def num_output(self, source: str) -> int:
        return sum(n for s, n in self.output if s == source)


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int
    metrics: RequestMetrics
    # With `prompt_logprobs=k`: per position i, None for the first, else a dict (token id ->
    # Logprob) of prompt[i] given prompt[:i] and the k most likely tokens there.
    prompt_logprobs: PromptLogprobs | None = None
    # Draft tokens verified for this request (fed to the model) and how many were accepted.
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    # A blended request's chunk reuse (None: not blended, or not admitted yet).
    blend: BlendUsage | None = None
    provenance: Provenance = field(default_factory=Provenance)

    @property
    def prompt_token_logprobs(self) -> list[float | None] | None:
        """log P(prompt[i] | prompt[:i]) per position (None for the first): each position's
        entry for its own token in `prompt_logprobs`."""
        if self.prompt_logprobs is None:
            return None
        return [None if entry is None else entry[token].logprob
                for entry, token in zip(self.prompt_logprobs, self.prompt_token_ids, strict=True)]
