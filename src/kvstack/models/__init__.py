"""Model families. Importing this package registers every family."""

from kvstack.models import gemma3, llama, qwen3, qwen3_5  # noqa: F401  (each registers itself)
from kvstack.models.base import CausalLM, ModelFamily
from kvstack.models.registry import family_of

__all__ = ["CausalLM", "ModelFamily", "family_of"]
