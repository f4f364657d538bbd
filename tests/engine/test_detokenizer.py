"""IncrementalDetokenizer on the embedded model's real tokenizer, and the stop-string helpers."""

from __future__ import annotations

import random
from collections.abc import Iterator
from typing import Any

import pytest
import transformers
from hypothesis import given, settings
from hypothesis import strategies as st

from kvstack.engine.detokenizer import IncrementalDetokenizer, find_stop, stop_holdback
from kvstack.weights import EMBEDDED_MODEL, resolve_model

TEXTS = [
    "The quick brown fox jumps over the lazy dog.\n\nIt's 42 degrees — isn't it?",
    "Hello 世界! 日本語のテキストと中文文本。한국어 텍스트",
    "Party 🎉🚀 time 😀👨\u200d👩\u200d👧 family, flags 🇫🇷🇯🇵 and skin tones 👍🏽",
    "naïve café, Ελληνικά, русский, עברית, العربية, हिन्दी",
    "def f(x):\n    return x ** 2  # 𝔘𝔫𝔦𝔠𝔬𝔡𝔢 math 𝑥²",
]


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    # Found the way the engine finds it: wherever the package is installed.
    gguf = resolve_model(EMBEDDED_MODEL)
    return transformers.AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)


@pytest.fixture(scope="module")
def prompt_ids(tokenizer: Any) -> list[int]:
    messages = [{"role": "user", "content": "Say something."}]
    prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return tokenizer.encode(prompt, add_special_tokens=False)


def stream(detokenizer: IncrementalDetokenizer, token_ids: list[int]) -> list[str]:
    return [detokenizer.add(token_id) for token_id in token_ids]


@pytest.mark.parametrize("text", TEXTS)
def test_deltas_join_to_the_full_decode_and_never_split_a_character(
    tokenizer: Any, prompt_ids: list[int], text: str
) -> None:
    output_ids = tokenizer.encode(text, add_special_tokens=False)
    detokenizer = IncrementalDetokenizer(tokenizer, prompt_ids)
    deltas = stream(detokenizer, output_ids)
    assert all("\ufffd" not in delta for delta in deltas)
    assert "".join(deltas) == detokenizer.text == tokenizer.decode(output_ids) == text


def test_multibyte_characters_are_held_until_complete(tokenizer: Any) -> None:
    output_ids = tokenizer.encode("🎉", add_special_tokens=False)
    assert len(output_ids) > 1  # the emoji's four bytes span several tokens
    deltas = stream(IncrementalDetokenizer(tokenizer, []), output_ids)
    assert deltas == [""] * (len(output_ids) - 1) + ["🎉"]


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_special_tokens_follow_skip_special_tokens(
    tokenizer: Any, prompt_ids: list[int], skip_special_tokens: bool
) -> None:
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    output_ids = [*tokenizer.encode("Hi 👋 there", add_special_tokens=False), im_end]
    detokenizer = IncrementalDetokenizer(tokenizer, prompt_ids, skip_special_tokens)
    joined = "".join(stream(detokenizer, output_ids))
    assert joined == tokenizer.decode(output_ids, skip_special_tokens=skip_special_tokens)
    assert joined.endswith("<|im_end|>") != skip_special_tokens


def test_random_token_streams_never_emit_a_partial_character(tokenizer: Any) -> None:
    """Arbitrary ids (byte tokens included) may decode to invalid UTF-8; deltas must still
    never end mid-character and must form a prefix of the full decode, missing at most a
    trailing incomplete character."""
    rng = random.Random(0)
    # Low ids are single bytes in SmolLM2's byte-level vocabulary: many partial characters.
    pool = list(range(256)) + rng.sample(range(256, tokenizer.vocab_size), 256)
    for _ in range(30):
        output_ids = [rng.choice(pool) for _ in range(rng.randint(1, 40))]
        deltas = stream(IncrementalDetokenizer(tokenizer, [1, 2, 3]), output_ids)
        assert not any(delta.endswith("\ufffd") for delta in deltas)
        full = tokenizer.decode(output_ids, skip_special_tokens=True)
        joined = "".join(deltas)
        assert full.startswith(joined)
        assert joined == full or full.endswith("\ufffd")


class CountingTokenizer:
    """Wraps a tokenizer and records the length of each decode call."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.decode_lengths: list[int] = []

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        self.decode_lengths.append(len(token_ids))
        return self.tokenizer.decode(token_ids, skip_special_tokens=skip_special_tokens)


def test_per_token_work_does_not_grow_with_the_output(
    tokenizer: Any, prompt_ids: list[int]
) -> None:
    output_ids = tokenizer.encode(" ".join(TEXTS) * 4, add_special_tokens=False)
    assert len(output_ids) > 300
    counting = CountingTokenizer(tokenizer)
    detokenizer = IncrementalDetokenizer(counting, prompt_ids)
    assert "".join(stream(detokenizer, output_ids)) == tokenizer.decode(output_ids)
    # Each decode covers the last emitted delta plus pending tokens: a handful, never the
    # whole output (the longest pending run here is one 4-byte emoji in single-byte tokens).
    assert max(counting.decode_lengths) <= 10


# --- stop strings -----------------------------------------------------------------------------


def test_find_stop_reports_a_stop_in_the_new_characters() -> None:
    assert find_stop("hello world", 5, ["wor"]) == (6, "wor")
    assert find_stop("hello world", 5, ["xyz"]) is None


def test_find_stop_catches_a_stop_straddling_old_and_new_text() -> None:
    assert find_stop("abcSTOP", 2, ["STOP"]) == (3, "STOP")
    assert find_stop("abcSTOP", 0, ["STOP"]) is None


def test_find_stop_ignores_matches_wholly_in_old_text() -> None:
    assert find_stop("stop here and more", 4, ["stop"]) is None
    assert find_stop("stop here and stop", 4, ["stop"]) == (14, "stop")


def test_find_stop_prefers_the_earliest_start_then_list_order() -> None:
    assert find_stop("hello", 5, ["lo", "ell"]) == (1, "ell")
    assert find_stop("hello", 5, ["he", "hel"]) == (0, "he")
    assert find_stop("hello", 5, ["", "o"]) == (4, "o")


def test_stop_holdback_counts_a_possible_stop_prefix() -> None:
    assert stop_holdback("Hello wor", ["world"]) == 3
    assert stop_holdback("Hello", ["lo!", "xyz"]) == 2
    assert stop_holdback("wo", ["world"]) == 2
    assert stop_holdback("Hello", ["world"]) == 0
    assert stop_holdback("abc", ["abc"]) == 0  # a whole stop is find_stop's to report
    assert stop_holdback("a</s", ["</s>", "<"]) == 3
    assert stop_holdback("anything", []) == 0


def chunks(text: str, cuts: list[int]) -> Iterator[int]:
    """Lengths of the pieces `text` splits into at the (sorted, deduplicated) cut points."""
    points = [0, *sorted({c for c in cuts if 0 < c < len(text)}), len(text)]
    return (b - a for a, b in zip(points, points[1:], strict=False))


@settings(max_examples=200, deadline=None)
@given(
    text=st.text(alphabet="abc", max_size=30),
    stops=st.lists(st.text(alphabet="abc", min_size=1, max_size=4), min_size=1, max_size=3),
    cuts=st.lists(st.integers(0, 30), max_size=10),
)
def test_streaming_with_holdback_finds_the_first_completed_stop(
    text: str, stops: list[str], cuts: list[int]
) -> None:
    """Stream `text` in arbitrary chunks like an engine: check for a stop after each chunk,
    emit all but the holdback. The emitted text never contains a stop, and the stop found is
    one that ends inside the chunk where stops first appear."""
    seen, emitted, found = "", 0, None
    for size in chunks(text, cuts):
        seen += text[len(seen) : len(seen) + size]
        found = find_stop(seen, size, stops)
        if found is not None:
            break
        emitted = len(seen) - stop_holdback(seen, stops)
    if found is None:
        assert not any(stop in text for stop in stops)
        return
    index, stop = found
    assert seen[index : index + len(stop)] == stop
    assert not any(s in seen[: len(seen) - size] for s in stops)
    assert emitted <= index  # nothing of the stop was shown before it was recognised
    assert not any(s in seen[:emitted] for s in stops)
