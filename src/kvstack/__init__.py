"""kvstack: an LLM inference engine built around KV-cache reuse."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from kvstack.blend.params import BlendParams, Chunk
from kvstack.errors import KvstackError
from kvstack.outputs import CompletionOutput, RequestOutput
from kvstack.sampling_params import SamplingParams
from kvstack.version import __version__

if TYPE_CHECKING:
    from kvstack.engine.llm import LLM

__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput", "KvstackError",
           "Chunk", "BlendParams", "__version__"]


def __getattr__(name: str) -> Any:
    # LLM pulls in torch and transformers (seconds); `kvstack --help` should not wait for them.
    if name == "LLM":
        from kvstack.engine.llm import LLM

        return LLM
    raise AttributeError(f"module 'kvstack' has no attribute {name!r}")
