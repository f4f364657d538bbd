"""Hugging Face transformers running exactly our weights, driven through `generate`.

Both sides get the same token ids and decode greedily for a fixed number of tokens (the peer
never stops at EOS, like our `ignore_eos=True`), so their outputs should agree token for token
and their timings compare the engines, not the workloads.
"""

from __future__ import annotations

import copy
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    GenerationConfig,
    StoppingCriteria,
    StoppingCriteriaList,
)
from transformers.generation import utils as generation_utils

from kvstack.errors import ModelLoadError
from kvstack.weights import Checkpoint

# transformers 5.x renamed generate()'s `past_key_values` to `cache`; older releases know only
# the former.
_CACHE_KWARG = (
    "cache" if "cache" in getattr(generation_utils, "ALL_CACHE_NAMES", ()) else "past_key_values"
)


def transformers_model(ckpt: Checkpoint) -> Any:
    """A transformers model holding exactly the checkpoint's weights, in float32, eval mode."""

    hf = dict(ckpt.hf_config)
    config = AutoConfig.for_model(hf.pop("model_type", "llama"), **hf)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    missing, unexpected = model.load_state_dict(
        {k: v.float() for k, v in ckpt.tensors.items()}, strict=False
    )
    # Rotary buffers are computed, and a tied lm_head is the embedding itself.
    missing = [k for k in missing if "rotary_emb" not in k
               and not (k == "lm_head.weight" and config.tie_word_embeddings)]
    if missing or unexpected:
        raise ModelLoadError(
            f"transformers' {type(model).__name__} does not match the checkpoint "
            f"(missing {missing[:3]}, unexpected {unexpected[:3]}); the peer cannot run it"
        )
    model.tie_weights()
    return model.eval()


@dataclass
class PeerRun:
    """One `generate` call: output ids per prompt and the clock after each generated token."""

    token_ids: list[list[int]]
    start: float
    token_times: list[float] = field(default_factory=list)

    @property
    def elapsed(self) -> float:
        return self.token_times[-1] - self.start

    @property
    def ttft(self) -> float:
        return self.token_times[0] - self.start

    @property
    def inter_token_latencies(self) -> list[float]:
        t = self.token_times
        return [b - a for a, b in zip(t, t[1:], strict=False)]


class TransformersPeer:
    def __init__(self, ckpt: Checkpoint) -> None:
        self.model = transformers_model(ckpt)
        # A fixed number of new tokens, as `ignore_eos=True`: no EOS may end generation early.
        # (generate() fills an unset eos_token_id from the model's generation config.)
        self.model.generation_config.eos_token_id = None
        self.pad_token_id = ckpt.config.bos_token_id or 0

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        max_new_tokens: int,
        use_cache: bool = True,
        on_token: Callable[[], None] | None = None,
        past_key_values: Any | None = None,
    ) -> PeerRun:
        """Greedy batched `generate`, prompts left-padded to a common length.

        `past_key_values` (a cache of a prefix of every prompt) is deep-copied first, inside
        the timed region, since generate() extends it in place.
        """
        width = max(len(p) for p in prompts)
        input_ids = torch.full((len(prompts), width), self.pad_token_id, dtype=torch.long)
        attention_mask = torch.zeros((len(prompts), width), dtype=torch.long)
        for row, p in enumerate(prompts):
            input_ids[row, width - len(p):] = torch.tensor(list(p), dtype=torch.long)
            attention_mask[row, width - len(p):] = 1
        config = GenerationConfig(
            max_new_tokens=max_new_tokens,
            do_sample=False,
            use_cache=use_cache,
            pad_token_id=self.pad_token_id,
        )
        clock = _Clock(on_token)
        start = time.perf_counter()
        kwargs: dict[str, Any] = {}
        if past_key_values is not None:
            kwargs[_CACHE_KWARG] = copy.deepcopy(past_key_values)
        with torch.inference_mode():
            out = self.model.generate(
                input_ids,
                attention_mask=attention_mask,
                generation_config=config,
                stopping_criteria=StoppingCriteriaList([clock]),
                **kwargs,
            )
        return PeerRun(out[:, width:].tolist(), start, clock.times)

    def prefill(self, prompt: Sequence[int]) -> tuple[Any, float]:
        """The KV cache (a transformers `DynamicCache`) of one prompt, and seconds it took."""
        start = time.perf_counter()
        with torch.inference_mode():
            out = self.model(torch.tensor([list(prompt)]), use_cache=True)
        cache = out["cache"] if "cache" in out else out["past_key_values"]
        return cache, time.perf_counter() - start


class _Clock(StoppingCriteria):
    """A stopping criterion that never stops: generate() calls it once per new token."""

    def __init__(self, on_token: Callable[[], None] | None) -> None:
        self.times: list[float] = []
        self.on_token = on_token

    def __call__(self, input_ids: torch.Tensor, scores: Any, **kwargs: Any) -> torch.Tensor:
        self.times.append(time.perf_counter())
        if self.on_token is not None:
            self.on_token()
        return torch.zeros(input_ids.shape[0], dtype=torch.bool)
