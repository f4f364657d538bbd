"""Typed user errors. Each message is one line that says what to do.

The CLI prints `str(err)` and exits 2; the server maps `http_status` to a 4xx response.
"""

from __future__ import annotations


class KvstackError(Exception):
    """Base class of every error a user can cause and fix."""

    http_status: int = 400
    error_type: str = "invalid_request_error"


class InvalidRequestError(KvstackError, ValueError):
    """A request or a parameter is out of range or malformed."""


class PromptTooLongError(InvalidRequestError):
    """The prompt plus requested output does not fit the model's context."""

    def __init__(self, num_prompt_tokens: int, max_model_len: int) -> None:
        self.num_prompt_tokens = num_prompt_tokens
        self.max_model_len = max_model_len
        super().__init__(
            f"prompt has {num_prompt_tokens} tokens but the model's context is "
            f"{max_model_len} tokens; shorten the prompt"
        )


class ModelNotFoundError(KvstackError, FileNotFoundError):
    """The model name does not resolve to a local file or folder."""

    http_status = 404
    error_type = "not_found_error"


class ModelLoadError(KvstackError):
    """A model file exists but cannot be read (corrupt, truncated, missing tensors)."""


class UnsupportedModelError(KvstackError):
    """The architecture, tensor type or feature is not implemented."""


class CapacityError(KvstackError):
    """A request can never fit in the KV cache pool, even running alone."""


def one_line(err: BaseException) -> str:
    """An exception's message squeezed onto one short line, for wrapping in a user error."""
    text = " ".join(str(err).split()) or type(err).__name__
    return text if len(text) <= 200 else text[:197] + "..."
