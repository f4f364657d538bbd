"""Tokenizer of a checkpoint, with GGUF-embedded tokenizers converted once and cached on disk."""

from __future__ import annotations

import logging
import operator
import shutil
import tempfile
from collections.abc import Sequence
from pathlib import Path

from transformers import AutoTokenizer, PreTrainedTokenizerBase

from kvstack.errors import InvalidRequestError, ModelLoadError, one_line
from kvstack.paths import cache_root
from kvstack.weights.checkpoint import Checkpoint

logger = logging.getLogger(__name__)


def load_tokenizer(ckpt: Checkpoint) -> PreTrainedTokenizerBase:
    """The checkpoint's tokenizer, chat template included. Never touches the network.

    Converting a GGUF vocabulary takes seconds, so the converted tokenizer is saved under
    `cache_root()/tokenizers/<fingerprint>/` and loaded from there afterwards.
    """
    if ckpt.tokenizer_gguf_file is None:
        return _from_pretrained(ckpt.tokenizer_path, None)
    cached = cache_root() / "tokenizers" / ckpt.fingerprint
    if cached.is_dir():
        try:
            return _from_pretrained(cached, None)
        except ModelLoadError as err:
            logger.warning("rebuilding unreadable tokenizer cache %s: %s", cached, err)
            shutil.rmtree(cached, ignore_errors=True)
    tokenizer = _from_pretrained(ckpt.tokenizer_path, ckpt.tokenizer_gguf_file)
    _store(tokenizer, cached)
    return tokenizer


def _from_pretrained(path: Path, gguf_file: str | None) -> PreTrainedTokenizerBase:
    try:
        return AutoTokenizer.from_pretrained(path, gguf_file=gguf_file, local_files_only=True)
    except (OSError, ValueError, KeyError) as err:
        raise ModelLoadError(
            f"cannot load a tokenizer from {path / (gguf_file or '')} ({one_line(err)}); "
            "the model folder needs tokenizer.json or tokenizer.model"
        ) from err


def _store(tokenizer: PreTrainedTokenizerBase, cached: Path) -> None:
    # Written beside its final place and renamed, so readers never see a half-written folder.
    try:
        cached.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=".tmp-", dir=cached.parent))
    except OSError as err:
        logger.warning("not caching the tokenizer in %s: %s", cached, one_line(err))
        return
    try:
        tokenizer.save_pretrained(tmp)
        tmp.rename(cached)
    except OSError as err:
        # Another process may have stored the same fingerprint first: theirs is as good.
        if not cached.is_dir():
            logger.warning("not caching the tokenizer in %s: %s", cached, one_line(err))
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


def check_token_ids(token_ids: Sequence[object], vocab_size: int) -> list[int]:
    """Prompt token ids as plain ints, each in [0, vocab_size): the one bound every entry point
    (offline, HTTP) applies. numpy and torch integers count as ids."""
    ids = [_as_index(t) for t in token_ids]
    if not ids:
        raise InvalidRequestError("prompt_token_ids is empty; give at least one token")
    bad = [t for t in ids if not isinstance(t, int) or not 0 <= t < vocab_size]
    if bad:
        raise InvalidRequestError(
            f"prompt token id {bad[0]!r} is not in the vocabulary [0, {vocab_size}); "
            "give integer ids from this model's tokenizer"
        )
    return ids  # type: ignore[return-value]  # all ints: checked above


def _as_index(value: object) -> object:
    """numpy and torch integers as plain ints (they are valid ids); anything else unchanged."""
    try:
        return operator.index(value)  # type: ignore[arg-type]
    except TypeError:
        return value
