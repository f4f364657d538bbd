"""The pure parts of blending: settings and their errors, segment tokenization, cache keys,
the chunk entry codec, the in-memory chunk cache's LRU budget and the selectors."""

from __future__ import annotations

import pytest
import torch

from kvstack import BlendParams, Chunk
from kvstack.blend.chunk_cache import ChunkCache
from kvstack.blend.codec import ChunkFormat
from kvstack.blend.entry import ChunkEntry, chunk_key
from kvstack.blend.params import BlendError
from kvstack.blend.segments import tokenize_segments
from kvstack.blend.selectors import (
    GRADUAL_GAP,
    GRADUAL_WIDEN,
    keep_count,
    stages,
    static_choice,
    top,
)
from kvstack.errors import KvstackError
from kvstack.kv.tiers.codec import BlockFault

FP = "ab" * 32


@pytest.mark.parametrize("kwargs", [
    {"recompute_ratio": -0.1}, {"recompute_ratio": 1.5}, {"recompute_ratio": float("nan")},
    {"recompute_ratio": True}, {"selector": "best"}, {"check_layer": -1}, {"first_k": 0},
    {"seed": 1.5},
])
def test_bad_settings_are_typed_errors(kwargs: dict[str, object]) -> None:
    with pytest.raises(BlendError) as err:
        BlendParams(**kwargs)  # type: ignore[arg-type]
    assert isinstance(err.value, KvstackError) and "\n" not in str(err.value)


def test_settings_from_json_refuse_unknown_fields() -> None:
    assert BlendParams.from_dict({"recompute_ratio": 0.3}).recompute_ratio == 0.3
    assert BlendParams.from_dict(None) == BlendParams()
    with pytest.raises(BlendError, match="ratio"):
        BlendParams.from_dict({"ratio": 0.3})


def test_chunk_holds_text_or_ids() -> None:
    with pytest.raises(BlendError):
        Chunk()
    with pytest.raises(BlendError):
        Chunk(text="a", token_ids=(1,))
    assert Chunk(token_ids=[1, 2]).token_ids == (1, 2)


def test_segments_concatenate_and_mark_chunk_spans() -> None:
    ids, spans = tokenize_segments(None, [[1, 2], Chunk(token_ids=(3, 4, 5)), [6],
                                          Chunk(token_ids=(3, 4, 5))])
    assert ids == [1, 2, 3, 4, 5, 6, 3, 4, 5]
    assert spans == [(2, 5), (6, 9)]


@pytest.mark.parametrize(("segments", "match"), [
    ([[]], "no text"), ([], "no text"), ([Chunk(token_ids=())], "empty chunk"),
    ("text", "list"), ([3.5], "float"), (["text"], "tokenizer"),
])
def test_bad_segments_are_typed_errors(segments: object, match: str) -> None:
    with pytest.raises(BlendError, match=match):
        tokenize_segments(None, segments)  # type: ignore[arg-type]


def test_keys_depend_on_content_salt_and_model_only() -> None:
    base = chunk_key(FP, None, [1], [5, 6, 7])
    assert base == chunk_key(FP, None, [1], [5, 6, 7])
    assert base == chunk_key(FP, "", [1], (5, 6, 7))
    others = {chunk_key(FP, "tenant", [1], [5, 6, 7]), chunk_key("cd" * 32, None, [1], [5, 6, 7]),
              chunk_key(FP, None, [1], [5, 6]), chunk_key(FP, None, [], [5, 6, 7]),
              chunk_key(FP, None, [1], [7, 6, 5])}
    assert base not in others and len(others) == 5


def entry(key: bytes, num_tokens: int, fill: float = 1.0, layers: int = 2) -> ChunkEntry:
    g = torch.Generator().manual_seed(num_tokens)
    k = torch.randn(layers, num_tokens, 2, 8, generator=g) * fill
    return ChunkEntry(key, k, -k)


def test_codec_round_trip_and_faults() -> None:
    fmt = ChunkFormat(FP, torch.float32, 2, 2, 8)
    e = entry(b"k" * 32, 5)
    data = fmt.encode(e)
    assert data is not None
    back = fmt.decode(e.key, data)
    assert torch.equal(back.k, e.k) and torch.equal(back.v, e.v)
    damaged = bytearray(data)
    damaged[-1] ^= 1
    cases = [(b"x" * 32, data, "hash"), (e.key, data[:-4], "truncated"),
             (e.key, bytes(damaged), "checksum"), (e.key, b"nope" * 40, "bad_magic")]
    for key, blob, kind in cases:
        with pytest.raises(BlockFault) as err:
            fmt.decode(key, blob)
        assert err.value.kind == kind
    with pytest.raises(BlockFault) as err:
        ChunkFormat("cd" * 32, torch.float32, 2, 2, 8).decode(e.key, data)
    assert err.value.kind == "fingerprint"


def test_memory_cache_evicts_least_recently_used_within_its_budget() -> None:
    size = entry(b"a" * 32, 4).num_bytes
    cache = ChunkCache(ChunkFormat(FP, torch.float32, 2, 2, 8), max_bytes=2 * size)
    a, b, c = (entry(bytes([i]) * 32, 4) for i in range(3))
    cache.put(a)
    cache.put(b)
    assert cache.get(a.key) is a  # a is now the most recent
    cache.put(c)
    assert b.key not in cache and a.key in cache and c.key in cache
    assert cache.get(b.key) is None
    s = cache.stats()
    assert (s.num_entries, s.num_bytes, s.hits, s.misses, s.evictions) == (2, 2 * size, 1, 1, 1)
    cache.put(entry(b"z" * 32, 40))  # larger than the whole budget: not kept
    assert cache.stats().num_entries == 2


def test_selectors() -> None:
    assert [keep_count(r, 10) for r in (0, 0.05, 0.15, 0.5, 1)] == [0, 1, 2, 5, 10]
    assert top(torch.tensor([0.1, 3.0, 3.0, 2.0]), 2).tolist() == [1, 2]
    assert static_choice("first_k", 0.0, 2, 0, [3, 1, 4]).tolist() == [0, 1, 3, 4, 5]
    assert static_choice("first_k", 0.5, None, 0, [4, 2]).tolist() == [0, 1, 4]
    picks = static_choice("random", 0.5, None, 7, [6, 4])
    assert picks.tolist() == static_choice("random", 0.5, None, 7, [6, 4]).tolist()
    assert len(picks) == 5 and len(set(picks.tolist())) == 5
    assert stages("kv_deviation", 1, 0.15, 100, 30) == {1: 15}
    assert stages("gradual", 1, 0.15, 100, 30) == {
        1: keep_count(GRADUAL_WIDEN * 0.15, 100), 1 + GRADUAL_GAP: 15}
    assert stages("gradual", 1, 0.6, 100, 30)[1] == 100  # never more than every token
    last = 29 - GRADUAL_GAP  # the second stage at the last layer, then one past it
    assert stages("gradual", last, 0.15, 100, 30) == {last: keep_count(GRADUAL_WIDEN * 0.15, 100),
                                                      29: 15}
    assert stages("gradual", 30 - GRADUAL_GAP, 0.15, 100, 30) == {30 - GRADUAL_GAP: 15}
