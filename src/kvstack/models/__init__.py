"""Model families. Importing this package registers every family."""

from kvstack.models import llama  # noqa: F401  (registers itself)
from kvstack.models.base import CausalLM, ModelFamily
from kvstack.models.registry import family_of

__all__ = ["CausalLM", "ModelFamily", "family_of"]
