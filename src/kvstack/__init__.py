"""kvstack: an LLM inference engine built around KV-cache reuse."""

from kvstack.errors import KvstackError
from kvstack.llm import LLM
from kvstack.outputs import CompletionOutput, RequestOutput
from kvstack.sampling_params import SamplingParams

__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput", "KvstackError"]
__version__ = "0.1.0"
