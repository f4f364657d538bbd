"""Model families. Importing this package registers every family."""

from kvstack.models import llama  # noqa: F401  (registers itself)
from kvstack.models.registry import model_class, supported_architectures

__all__ = ["model_class", "supported_architectures"]
