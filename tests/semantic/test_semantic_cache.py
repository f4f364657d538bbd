"""The semantic cache: what hits (paraphrases), what never does (near-misses, other tenants,
models and contexts, sampled requests), its lifecycle (TTL, LRU cap, invalidation, restart,
corrupted files), the evaluation's pieces, and one live server through the official SDKs.

The real all-MiniLM-L6-v2 embedder is loaded once for the module.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anthropic
import httpx
import openai
import pytest
from helpers.live_server import LiveServer, start_server

from kvstack.cli.main import main
from kvstack.eval.semantic import Pair, choose_threshold, load_pairs, score, sweep
from kvstack.semantic import Answer, Scope, SemanticCache, SemanticCacheConfig, SemanticCacheError
from kvstack.semantic.cache import DB_FILE, DEFAULT_THRESHOLD, INDEX_FILE
from kvstack.semantic.embedder import MiniLMEmbedder
from kvstack.semantic.guard import reject_reason
from kvstack.server.auth import Tenant
from kvstack.server.semantic_api import HEADER, tenant_id

MODEL = "smollm2-135m"
KEY_A, KEY_B = "sem-key-a-0123456789", "sem-key-b-9876543210"
SCOPE = Scope("tenant-a", "model-1", "ctx")
ANSWER = Answer("Canberra.", 3, "stop")

PARAPHRASES = [  # (stored, asked): all hit at the default threshold
    ("What is the capital of Australia?", "Which city is Australia's capital?"),
    ("How do I reverse a list in Python?", "What's the way to reverse a Python list?"),
    ("Who wrote Pride and Prejudice?", "Who is the author of Pride and Prejudice?"),
    ("What is 15% of 80?", "Calculate 15 percent of 80."),
    ("How many days are in a leap year?", "How many days does a leap year have?"),
]
NEAR_MISSES = [  # (stored, asked, what differs)
    ("What is 15% of 80?", "What is 15% of 60?", "number"),
    ("What is two plus two?", "What is two plus three?", "number"),
    ("What is 7 + 5?", "What is 7 - 5?", "number"),
    ("What is the capital of France?", "What is the capital of Germany?", "entity"),
    ("How do I reverse a list in Python?", "How do I reverse a list in JavaScript?", "entity"),
    ("Is coffee bad for your health?", "Is coffee not bad for your health?", "negation"),
    ("How do I make bread with yeast?", "How do I make bread without yeast?", "negation"),
    ("Why does my code compile?", "Why doesn't my code compile?", "negation"),
    ("How do I install numpy?", "How do I uninstall numpy?", "opposite"),
    ("What is the fastest land animal?", "What is the slowest land animal?", "opposite"),
    ("Convert miles to kilometers.", "Convert kilometers to miles.", "order"),
]


@pytest.fixture(scope="module")
def embedder() -> MiniLMEmbedder:
    return MiniLMEmbedder()


def make_cache(embedder: MiniLMEmbedder, directory: Path | None = None,
               clock: Any = None, **config: Any) -> SemanticCache:
    cfg = SemanticCacheConfig(directory=directory, **config)
    return SemanticCache(embedder, cfg) if clock is None else SemanticCache(embedder, cfg, clock)


# -- what hits and what does not -------------------------------------------------------------


def test_paraphrases_hit_and_serve_the_stored_answer(embedder: MiniLMEmbedder) -> None:
    cache = make_cache(embedder)
    for i, (stored, _) in enumerate(PARAPHRASES):
        cache.store(SCOPE, stored, Answer(f"answer {i}", 2, "stop"))
    for i, (_, asked) in enumerate(PARAPHRASES):
        lookup = cache.lookup(SCOPE, asked)
        assert lookup.hit, (asked, lookup.similarity)
        assert lookup.entry is not None and lookup.entry.answer.text == f"answer {i}"
        assert lookup.similarity is not None and lookup.similarity >= DEFAULT_THRESHOLD
    assert cache.stats.hits == len(PARAPHRASES)
    cache.check_integrity()


@pytest.mark.parametrize(("stored", "asked", "reason"), NEAR_MISSES)
def test_near_misses_never_hit(embedder: MiniLMEmbedder, stored: str, asked: str,
                               reason: str) -> None:
    assert reject_reason(asked, stored) == reason
    cache = make_cache(embedder)
    cache.store(SCOPE, stored, ANSWER)
    lookup = cache.lookup(SCOPE, asked)
    assert not lookup.hit
    # Where the embedding alone would have served it, the guard is what refused it.
    assert lookup.similarity is not None
    if lookup.similarity >= DEFAULT_THRESHOLD:
        assert lookup.rejections == (reason,)
        assert cache.stats.guard_rejections == 1
    assert cache.lookup(SCOPE, stored).hit  # the stored question itself still hits


def test_guard_lets_paraphrases_through() -> None:
    for stored, asked in PARAPHRASES:
        assert reject_reason(asked, stored) is None, (stored, asked)
    assert reject_reason("What is twenty five thousand plus 3?", "What is 25,000 + 3?") is None
    assert reject_reason("When did World War II end?", "When did the second world war end?") \
        is None
    assert reject_reason("What's the difference between HTTP and HTTPS?",
                         "How does HTTPS differ from HTTP?") is None


def test_another_tenant_model_or_context_never_hits(embedder: MiniLMEmbedder) -> None:
    cache = make_cache(embedder)
    text = "What is the capital of Australia?"
    cache.store(SCOPE, text, ANSWER)
    assert cache.lookup(SCOPE, text).hit
    for other in (Scope("tenant-b", "model-1", "ctx"), Scope("tenant-a", "model-2", "ctx"),
                  Scope("tenant-a", "model-1", "another system prompt")):
        lookup = cache.lookup(other, text)
        assert not lookup.hit and lookup.similarity is None  # nothing there to compare with
    # Tenant ids are opaque: no API key reaches the cache or its files.
    assert tenant_id(Tenant(KEY_A)) != tenant_id(Tenant(KEY_B))
    assert KEY_A not in tenant_id(Tenant(KEY_A)) and tenant_id(Tenant("")) == "public"


# -- lifecycle -------------------------------------------------------------------------------


class Clock:
    def __init__(self) -> None:
        self.now = 1_000.0

    def __call__(self) -> float:
        return self.now


def test_entries_expire_after_their_ttl(embedder: MiniLMEmbedder) -> None:
    clock = Clock()
    cache = make_cache(embedder, clock=clock, ttl_s=60.0)
    cache.store(SCOPE, "What is the capital of Australia?", ANSWER)
    clock.now += 59
    assert cache.lookup(SCOPE, "Which city is Australia's capital?").hit
    clock.now += 2  # a hit does not extend the TTL: the answer's age counts
    assert not cache.lookup(SCOPE, "Which city is Australia's capital?").hit
    assert len(cache) == 0 and cache.stats.expirations == 1
    cache.check_integrity()


def test_the_least_recently_used_entry_is_evicted_at_the_cap(embedder: MiniLMEmbedder) -> None:
    cache = make_cache(embedder, max_entries=3)
    questions = ["What is the capital of Australia?", "Who wrote Pride and Prejudice?",
                 "How do I reverse a list in Python?", "What causes earthquakes?"]
    for q in questions[:3]:
        cache.store(SCOPE, q, ANSWER)
    assert cache.lookup(SCOPE, questions[0]).hit  # now the oldest-used is questions[1]
    cache.store(SCOPE, questions[3], ANSWER)
    assert len(cache) == 3 and cache.stats.evictions == 1
    assert [cache.lookup(SCOPE, q).hit for q in questions] == [True, False, True, True]
    cache.store(SCOPE, questions[3], Answer("newer", 1, "stop"))  # same question: replaced
    assert len(cache) == 3 and cache.lookup(SCOPE, questions[3]).entry.answer.text == "newer"
    cache.check_integrity()


def test_invalidation_by_tenant_model_and_all(embedder: MiniLMEmbedder) -> None:
    cache = make_cache(embedder)
    scopes = [Scope(t, m) for t in ("a", "b") for m in ("m1", "m2")]
    for scope in scopes:
        cache.store(scope, "What is the capital of Australia?", ANSWER)
    assert cache.invalidate(tenant="a") == 2
    assert [cache.lookup(s, "What is the capital of Australia?").hit for s in scopes] \
        == [False, False, True, True]
    assert cache.invalidate(model="m1") == 1 and cache.count() == 1
    assert cache.invalidate() == 1 and len(cache) == 0
    cache.check_integrity()


def test_entries_survive_a_restart(embedder: MiniLMEmbedder, tmp_path: Path) -> None:
    cache = make_cache(embedder, tmp_path)
    cache.store(SCOPE, "What is the capital of Australia?", ANSWER)
    cache.store(SCOPE, "Who wrote Pride and Prejudice?", Answer("Jane Austen.", 4, "stop"))
    cache.close()
    assert (tmp_path / INDEX_FILE).exists() and (tmp_path / DB_FILE).exists()
    again = make_cache(embedder, tmp_path)
    lookup = again.lookup(SCOPE, "Who is the author of Pride and Prejudice?")
    assert lookup.entry is not None and lookup.entry.answer == Answer("Jane Austen.", 4, "stop")
    assert len(again) == 2
    again.check_integrity()
    # A store after the last index checkpoint (a crash before close) is not lost either.
    again.store(SCOPE, "What causes earthquakes?", ANSWER)
    again._db.close()  # a crash: no close(), so no index checkpoint
    again._lock_file.close()
    third = make_cache(embedder, tmp_path)
    assert len(third) == 3 and third.lookup(SCOPE, "Why do earthquakes happen?").hit
    third.check_integrity()
    third.close()


def test_a_corrupted_index_file_is_rebuilt(embedder: MiniLMEmbedder, tmp_path: Path) -> None:
    cache = make_cache(embedder, tmp_path)
    cache.store(SCOPE, "What is the capital of Australia?", ANSWER)
    cache.close()
    (tmp_path / INDEX_FILE).write_bytes(b"\x00garbage" * 100)
    again = make_cache(embedder, tmp_path)
    assert again.lookup(SCOPE, "Which city is Australia's capital?").hit
    again.check_integrity()
    again.close()
    (tmp_path / INDEX_FILE).write_bytes((tmp_path / INDEX_FILE).read_bytes()[:40])  # truncated
    third = make_cache(embedder, tmp_path)
    assert third.lookup(SCOPE, "Which city is Australia's capital?").hit
    third.close()


def test_a_corrupted_database_is_set_aside(embedder: MiniLMEmbedder, tmp_path: Path) -> None:
    cache = make_cache(embedder, tmp_path)
    cache.store(SCOPE, "What is the capital of Australia?", ANSWER)
    cache.close()
    (tmp_path / DB_FILE).write_bytes(b"this is not a database" * 50)
    again = make_cache(embedder, tmp_path)  # starts empty instead of failing
    assert len(again) == 0 and not again.lookup(SCOPE, "What is the capital of Australia?").hit
    assert list(tmp_path.glob(f"{DB_FILE}.corrupt-*"))
    again.store(SCOPE, "What is the capital of Australia?", ANSWER)
    again.close()
    with sqlite3.connect(tmp_path / DB_FILE) as db:
        assert db.execute("SELECT count(*) FROM entries").fetchone() == (1,)


def test_one_process_per_directory(embedder: MiniLMEmbedder, tmp_path: Path) -> None:
    cache = make_cache(embedder, tmp_path)
    with pytest.raises(SemanticCacheError, match="another process"):
        make_cache(embedder, tmp_path)
    cache.close()
    make_cache(embedder, tmp_path).close()


# -- evaluation and command line -------------------------------------------------------------


def test_packaged_pairs_and_threshold_choice(embedder: MiniLMEmbedder) -> None:
    pairs = load_pairs()
    labels = {p.label for p in pairs}
    assert len(pairs) >= 200 and "paraphrase" in labels
    assert labels >= {"number", "entity", "negation", "opposite", "intent", "order", "swap"}
    holdout = load_pairs(packaged="pairs_holdout.jsonl")
    assert len(holdout) >= 50 and {p.label for p in holdout} >= labels
    assert not {(p.a, p.b) for p in pairs} & {(p.a, p.b) for p in holdout}  # disjoint splits
    few = [Pair(a, b, "paraphrase") for a, b in PARAPHRASES] + \
        [Pair(a, b, reason) for a, b, reason in NEAR_MISSES]
    rows = sweep(score(embedder, few))
    chosen = choose_threshold(rows)
    at = next(r for r in rows if abs(r.threshold - chosen) < 1e-9)
    assert at.false_hit_rate == 0 and at.hit_rate > 0.5
    assert all(r.false_hit_rate >= r2.false_hit_rate for r, r2 in zip(rows, rows[1:], strict=False))


def test_semantic_flags_need_the_switch_and_eval_is_a_group(
        capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["serve", "--semantic-threshold", "0.9"]) == 2
    assert "--semantic-threshold needs --semantic-cache" in capsys.readouterr().err
    assert main(["serve", "--semantic-cache", "--semantic-threshold", "1.5"]) == 2
    assert "threshold" in capsys.readouterr().err
    assert main(["eval", "--help"]) == 0
    assert "semantic" in capsys.readouterr().out


# -- one live server -------------------------------------------------------------------------


@pytest.fixture(scope="module")
def live(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    directory = tmp_path_factory.mktemp("semantic")
    args = ["--kv-cache-memory", "64MiB", "--threads", "1", "--api-key", KEY_A, "--api-key",
            KEY_B, "--semantic-cache", "--semantic-cache-mode", "trust", "--semantic-dir",
            str(directory)]
    holder = {"args": args, "dir": directory, "log": directory / "log.txt"}
    holder["server"] = start_server(args, holder["log"])
    yield holder
    holder["server"].terminate()


def oai(srv: LiveServer, key: str = KEY_A) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{srv.url}/v1", api_key=key, max_retries=0, timeout=120)


def ask(srv: LiveServer, text: str, key: str = KEY_A, **extra: Any) -> tuple[Any, httpx.Headers]:
    raw = oai(srv, key).chat.completions.with_raw_response.create(
        model=MODEL, messages=[{"role": "user", "content": text}], max_tokens=12,
        **({"temperature": 0} | extra))
    return raw.parse(), raw.headers


def entries(srv: LiveServer, key: str = KEY_A) -> int:
    r = httpx.get(f"{srv.url}/v1/semantic_cache", headers={"authorization": f"Bearer {key}"})
    assert r.status_code == 200, r.text
    return r.json()["entries"]


def sample(srv: LiveServer, name: str) -> float:
    for line in httpx.get(f"{srv.url}/metrics").text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise AssertionError(f"{name} not in /metrics")


def test_live_hits_through_the_sdks_streamed_and_not(live: dict[str, Any]) -> None:
    srv: LiveServer = live["server"]
    first, headers = ask(srv, "What is the capital of Australia?")
    assert headers[HEADER] == "miss" and first.usage.semantic_cache_hit is False
    hit, headers = ask(srv, "Which city is Australia's capital?")
    assert headers[HEADER] == "hit" and hit.usage.semantic_cache_hit is True
    assert hit.choices[0].message.content == first.choices[0].message.content
    assert hit.usage.completion_tokens == first.usage.completion_tokens
    near, headers = ask(srv, "What is the capital of Austria?")  # an entity apart: a miss
    assert headers[HEADER] == "miss"

    raw = oai(srv).chat.completions.with_raw_response.create(
        model=MODEL, messages=[{"role": "user", "content": "Which city is Australia's capital?"}],
        max_tokens=12, temperature=0, stream=True, stream_options={"include_usage": True})
    assert raw.headers[HEADER] == "hit"
    chunks = list(raw.parse())
    deltas = [c.choices[0].delta.content for c in chunks if c.choices and
              c.choices[0].delta.content]
    assert len(deltas) > 1  # streamed in pieces, like a model run
    assert "".join(deltas) == first.choices[0].message.content
    assert chunks[-1].usage.semantic_cache_hit is True

    message = anthropic.Anthropic(base_url=srv.url, api_key=KEY_A, max_retries=0).messages
    kwargs: dict[str, Any] = {"model": MODEL, "max_tokens": 12, "extra_body": {"temperature": 0}}
    miss = message.with_raw_response.create(
        **kwargs, messages=[{"role": "user", "content": "Who wrote Pride and Prejudice?"}])
    assert miss.headers[HEADER] == "miss"
    with message.stream(**kwargs, messages=[
            {"role": "user", "content": "Who is the author of Pride and Prejudice?"}]) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == miss.parse().content[0].text
    assert final.usage.model_extra["semantic_cache_hit"] is True

    assert sample(srv, "kvstack_semantic_cache_hits_total") >= 3
    assert sample(srv, "kvstack_semantic_cache_lookups_total") >= 6
    assert sample(srv, "kvstack_semantic_cache_lookup_seconds_count") >= 6
    assert sample(srv, "kvstack_semantic_cache_guard_rejections_total") >= 0


def test_live_sampled_requests_neither_store_nor_hit_unless_they_opt_in(
        live: dict[str, Any]) -> None:
    srv: LiveServer = live["server"]
    before = entries(srv)
    for _ in range(2):
        out, headers = ask(srv, "Name a large animal.", temperature=0.8, seed=1)
        assert HEADER not in headers and "semantic_cache_hit" not in out.usage.model_extra
    assert entries(srv) == before
    out, headers = ask(srv, "Name a large animal.", temperature=0.8, seed=1,
                       extra_body={"semantic_cache": True})
    assert headers[HEADER] == "miss" and entries(srv) == before + 1
    again, headers = ask(srv, "Name a large animal.", temperature=0.8, seed=1,
                         extra_body={"semantic_cache": True})
    assert headers[HEADER] == "hit"
    assert again.choices[0].message.content == out.choices[0].message.content
    _, headers = ask(srv, "Name a large animal.", temperature=0.8, seed=2,
                     extra_body={"semantic_cache": True})
    assert headers[HEADER] == "miss"  # another seed is another scope
    _, headers = ask(srv, "What is the capital of Australia?",
                     extra_body={"semantic_cache": False})
    assert HEADER not in headers  # a greedy request may opt out


def test_live_tenants_are_isolated_and_invalidate_their_own(live: dict[str, Any]) -> None:
    srv: LiveServer = live["server"]
    _, headers = ask(srv, "What causes earthquakes?", key=KEY_A)
    assert headers[HEADER] == "miss"
    assert ask(srv, "Why do earthquakes happen?", key=KEY_A)[1][HEADER] == "hit"
    assert ask(srv, "Why do earthquakes happen?", key=KEY_B)[1][HEADER] == "miss"
    assert ask(srv, "Why do earthquakes happen?", key=KEY_B)[1][HEADER] == "hit"

    url = f"{srv.url}/v1/semantic_cache"
    auth_b = {"authorization": f"Bearer {KEY_B}"}
    refused = httpx.delete(url, params={"tenant": "all"}, headers=auth_b)
    assert refused.status_code == 403 and refused.json()["error"]["param"] == "tenant"
    assert httpx.delete(url).status_code == 401
    n_b = entries(srv, KEY_B)
    done = httpx.delete(url, params={"model": MODEL}, headers=auth_b)
    assert done.status_code == 200 and done.json()["deleted"] == n_b
    assert entries(srv, KEY_B) == 0 and entries(srv, KEY_A) > 0
    assert ask(srv, "Why do earthquakes happen?", key=KEY_B)[1][HEADER] == "miss"
    assert ask(srv, "Why do earthquakes happen?", key=KEY_A)[1][HEADER] == "hit"


def test_live_entries_survive_a_restart_with_a_corrupted_index(live: dict[str, Any]) -> None:
    srv: LiveServer = live["server"]
    num = entries(srv)
    assert srv.terminate() == 0
    (live["dir"] / INDEX_FILE).write_bytes(b"corrupted index")
    live["server"] = srv = start_server(live["args"], live["log"])
    assert entries(srv) == num
    out, headers = ask(srv, "Tell me the capital city of Australia")
    assert headers[HEADER] == "hit" and out.usage.semantic_cache_hit is True
