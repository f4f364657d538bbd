"""Choosing the next token of each request from the logits of its last position.

Order of operations (as in vLLM): repetition penalty, frequency and presence penalties, then
either argmax (greedy) or temperature, min_p, top_k, top_p and a random draw.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np
import torch

from kvstack.sampling_params import SamplingParams


def make_generator(seed: int | None, device: torch.device | str = "cpu") -> torch.Generator | None:
    """A generator seeded with `seed` on `device`, or None when the request has no seed.

    Any Python int is accepted; it is reduced modulo 2**64, the range torch seeds live in.
    """
    if seed is None:
        return None
    generator = torch.Generator(device=device)
    generator.manual_seed(seed % (1 << 64))
    return generator


class TokenGuide(Protocol):
    """Which tokens may come next for a constrained request (`structured/`)."""

    def allowed_tokens(self, vocab_size: int) -> torch.Tensor:
        """bool [vocab_size]: True where the token may come next (never all False)."""
        ...


@dataclass
class SamplingState:
    """One request's sampling context, owned by the request and passed to the sampler each step.

    `output_token_ids` is the request's own list: the engine appends to it and the sampler
    reads it. It may only grow; if it ever shrinks the penalty bookkeeping is rebuilt.
    `generator` is created from `sampling_params.seed` when not given, so a seeded request
    draws from its own stream and its tokens do not depend on the batch it runs in.
    Token ids must be smaller than the vocabulary size of the logits.
    """

    sampling_params: SamplingParams
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    generator: torch.Generator | None = None
    # A constrained request's guide: tokens it masks out are never chosen, greedy or not.
    guide: TokenGuide | None = None
    # Penalty bookkeeping, kept on the logits' device and updated incrementally so a decode
    # step costs O(new tokens), not O(prompt + output).
    _seen: torch.Tensor | None = field(default=None, init=False, repr=False)  # [V] bool
    _counts: torch.Tensor | None = field(default=None, init=False, repr=False)  # [V] float32
    _num_counted: int = field(default=0, init=False, repr=False)

    def __post_init__(self) -> None:
        if self.generator is None:
            self.generator = make_generator(self.sampling_params.seed)

    def penalty_tensors(
        self, vocab_size: int, device: torch.device
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(seen, counts): seen[v] is True when v occurs in the prompt or the output so far;
        counts[v] is how often v occurs in the output. Both [vocab_size] on `device`."""
        out = self.output_token_ids
        if (
            self._seen is None
            or self._counts is None
            or self._seen.shape[0] != vocab_size
            or self._seen.device != device
            or len(out) < self._num_counted
        ):
            self._seen = torch.zeros(vocab_size, dtype=torch.bool, device=device)
            if self.prompt_token_ids:
                self._seen[torch.tensor(self.prompt_token_ids, device=device)] = True
            self._counts = torch.zeros(vocab_size, dtype=torch.float32, device=device)
            self._num_counted = 0
        if len(out) > self._num_counted:
            new = torch.tensor(out[self._num_counted :], device=device)
            self._seen[new] = True
            # index_add_ accumulates repeated ids; plain index assignment would not.
            self._counts.index_add_(0, new, torch.ones(len(new), device=device))
            self._num_counted = len(out)
        return self._seen, self._counts


def apply_penalties(logits: torch.Tensor, states: Sequence[SamplingState]) -> torch.Tensor:
    """Logits [B, V] with each row's repetition, frequency and presence penalties applied.

    For row i with params p, tokens seen in prompt or output and output counts c[v]:
      repetition: a seen token's logit l becomes l / p.repetition_penalty if l > 0,
                  else l * p.repetition_penalty (both make it less likely when the penalty > 1);
      then l -= p.frequency_penalty * c[v] + p.presence_penalty * (c[v] > 0).
    Rows without penalties are returned unchanged. The input is never modified; when no row
    has penalties the input tensor itself is returned.
    """
    rows = [i for i, s in enumerate(states) if s.sampling_params.has_penalties]
    if not rows:
        return logits
    vocab_size, device = logits.shape[1], logits.device
    seen_rows, count_rows = zip(
        *(states[i].penalty_tensors(vocab_size, device) for i in rows), strict=True
    )
    params = [states[i].sampling_params for i in rows]

    def column(values: list[float]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.float32, device=device).unsqueeze(1)  # [P, 1]

    penalized = logits[rows].float()  # [P, V]; advanced indexing copies, the input stays intact
    # Each penalty costs several passes over [P, V]; skip the ones no row uses.
    if any(p.repetition_penalty != 1 for p in params):
        seen = torch.stack(seen_rows)  # [P, V]
        repetition = column([p.repetition_penalty for p in params])
        shrunk = torch.where(penalized > 0, penalized / repetition, penalized * repetition)
        penalized = torch.where(seen, shrunk, penalized)
    if any(p.frequency_penalty != 0 or p.presence_penalty != 0 for p in params):
        counts = torch.stack(count_rows)  # [P, V]
        penalized -= column([p.frequency_penalty for p in params]) * counts
        penalized -= column([p.presence_penalty for p in params]) * (counts > 0)
    out = logits.to(torch.float32, copy=True)
    out[rows] = penalized
    return out


def _top_k_top_p(x: torch.Tensor, top_k: list[int], top_p: list[float] | None) -> torch.Tensor:
    """Mask x [S, V] to each row's top_k highest logits (k = V: off), then to the smallest
    nucleus of those whose probability mass reaches top_p (inf: off; None: off in every row).

    Equal logits at the k-th place are ranked arbitrarily (exact ties do not occur in real
    model outputs). Limits arrive as lists so that no decision waits on the device.
    """
    vocab_size = x.shape[1]
    max_k = max(top_k)
    # topk is far cheaper than a full sort; the sort is needed only for a row without top_k.
    if max_k < vocab_size:
        ranked, order = x.topk(max_k, dim=-1)  # [S, K], descending
    else:
        ranked, order = x.sort(dim=-1, descending=True)
    positions = torch.arange(ranked.shape[1], device=x.device)
    k = torch.tensor(top_k, device=x.device).unsqueeze(1)
    remove = positions.unsqueeze(0) >= k  # [S, K] in ranked order
    if top_p is not None:
        probs = ranked.masked_fill(remove, float("-inf")).softmax(dim=-1)
        mass_before = probs.cumsum(dim=-1) - probs
        # Keep the shortest prefix whose mass reaches top_p.
        p = torch.tensor(top_p, dtype=torch.float32, device=x.device).unsqueeze(1)
        remove |= mass_before >= p
    keep = torch.zeros_like(x, dtype=torch.bool).scatter_(-1, order, ~remove)
    return x.masked_fill(~keep, float("-inf"))


def _sample(logits: torch.Tensor, states: Sequence[SamplingState]) -> torch.Tensor:
    """Draw one token per row of logits [S, V] (penalized, float32) -> [S] token ids."""
    vocab_size, device = logits.shape[1], logits.device

    def column(values: list[float]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.float32, device=device)

    params = [s.sampling_params for s in states]
    temperature = [p.temperature for p in params]
    x = logits / column(temperature).unsqueeze(1) if any(t != 1 for t in temperature) else logits
    min_p = [p.min_p for p in params]
    if any(min_p):
        probs = x.softmax(dim=-1)
        threshold = probs.amax(dim=-1, keepdim=True) * column(min_p).unsqueeze(1)
        x = x.masked_fill(probs < threshold, float("-inf"))
    top_k = [p.top_k if 0 < p.top_k < vocab_size else vocab_size for p in params]
    # top_p = 1 becomes inf, not 1: a float cumsum can round past 1 and drop tail tokens.
    top_p = [p.top_p if p.top_p < 1 else math.inf for p in params]
    use_top_p = any(p < 1 for p in top_p)
    if use_top_p or any(k < vocab_size for k in top_k):
        x = _top_k_top_p(x, top_k, top_p if use_top_p else None)

    # Gumbel-max: argmax(x + G) with G = -log(-log U) i.i.d. picks token v with probability
    # softmax(x)[v]. Unlike torch.multinomial it lets each row draw from its own generator,
    # and it needs no softmax. U = 0 gives G = -inf: that token is skipped for this draw, a
    # bias of order 2**-24 per token, far below anything observable.
    noise = torch.empty_like(x)
    seeded = [(i, s.generator) for i, s in enumerate(states) if s.generator is not None]
    if len(seeded) < len(states):
        noise.uniform_()  # unseeded rows share the global RNG
    for i, generator in seeded:
        if generator.device == noise.device:
            noise[i].uniform_(generator=generator)
        else:  # e.g. a CPU generator for logits on an accelerator: same stream, then copied
            draw = torch.empty(vocab_size, device=generator.device).uniform_(generator=generator)
            noise[i] = draw.to(device)
    return argmax_rows(x - noise.log_().neg_().log_())


def argmax_rows(x: torch.Tensor) -> torch.Tensor:
    """Each row's argmax [S] (int64; the lowest index on ties and a NaN counted as the
    maximum, as torch.argmax). Float32 CPU logits go through NumPy, whose vectorized argmax
    over a 49k vocabulary takes ~10 us against torch's ~60-120 us: about 1% of a decode step."""
    if x.device.type == "cpu" and x.dtype == torch.float32:
        return torch.from_numpy(x.detach().numpy().argmax(axis=-1).astype(np.int64, copy=False))
    return x.argmax(dim=-1)


def apply_guides(logits: torch.Tensor, states: Sequence[SamplingState]) -> torch.Tensor:
    """The logits with every token a row's guide forbids at -inf (a copy; `logits` itself
    when no row is guided). Masking comes first, so penalties, temperature and the top-k/p
    filters only ever rank allowed tokens, and a greedy row takes the best allowed one."""
    rows = [i for i, s in enumerate(states) if s.guide is not None]
    if not rows:
        return logits
    vocab_size = logits.shape[1]
    allowed = torch.stack([states[i].guide.allowed_tokens(vocab_size)  # type: ignore[union-attr]
                           for i in rows]).to(logits.device)
    out = logits.clone()
    index = torch.tensor(rows, device=logits.device)
    out[index] = out[index].masked_fill(~allowed, float("-inf"))
    return out


def top_logprobs(logits: torch.Tensor, ks: Sequence[int]) -> list[list[tuple[int, float]]]:
    """Per row of raw logits [S, V], its ks[row] most likely tokens and their log-probabilities
    (raw model distribution, most likely first; [] where k is 0)."""
    max_k = max(ks, default=0)
    if max_k == 0:
        return [[] for _ in ks]
    values, ids = torch.log_softmax(logits.float(), dim=-1).topk(max_k, dim=-1)
    pairs = [list(zip(i, v, strict=True)) for i, v in zip(ids.tolist(), values.tolist(),
                                                          strict=True)]
    return [row[:k] for row, k in zip(pairs, ks, strict=True)]


class Sampler:
    """Turns the last-position logits of a batch into one next token per request."""

    def __call__(
        self, logits: torch.Tensor, states: Sequence[SamplingState]
    ) -> tuple[list[int], list[float] | None]:
        """logits: [B, V] raw model output for the last position of each of B requests.

        Returns the chosen token id of each row and, when any state asks for logprobs, the
        log-probability of each row's chosen token under the raw model distribution
        (log_softmax of the unmodified logits, before any guide's mask); otherwise None.
        Greedy rows take the argmax of the masked, penalized logits, lowest id on ties. A
        seeded row's tokens depend only on its generator, never on the other rows of the
        batch. `logits` is not modified.
        """
        if logits.dim() != 2 or logits.shape[0] != len(states):
            raise ValueError(
                f"logits must be [num_states, vocab]; got {tuple(logits.shape)} "
                f"for {len(states)} states"
            )
        allowed = apply_guides(logits, states)
        if all(s.sampling_params.greedy and not s.sampling_params.has_penalties for s in states):
            token_ids = argmax_rows(allowed)
        else:
            token_ids = self._choose(apply_penalties(allowed, states), states)
        logprobs = None
        if any(s.sampling_params.logprobs is not None for s in states):
            logprobs = (
                torch.log_softmax(logits.float(), dim=-1)
                .gather(1, token_ids.unsqueeze(1))
                .squeeze(1)
                .tolist()
            )
        return token_ids.tolist(), logprobs

    @staticmethod
    def _choose(logits: torch.Tensor, states: Sequence[SamplingState]) -> torch.Tensor:
        sampled = [i for i, s in enumerate(states) if not s.sampling_params.greedy]
        if len(sampled) == len(states):
            return _sample(logits.float(), states)
        token_ids = argmax_rows(logits)
        if sampled:
            rows = torch.tensor(sampled, device=logits.device)
            token_ids[rows] = _sample(logits[rows].float(), [states[i] for i in sampled])
        return token_ids
