"""Stored conversations as server state: their input items listed in OpenAI's shape, their
KV pinned while active (surviving pressure that evicts unpinned blocks, within a bounded
share of the pool), and, with a SQLite file and the disk tier, a restart that continues the
same tokens from the same KV."""

from __future__ import annotations

import random
from array import array
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from helpers.app_server import AppServer

from kvstack import LLM
from kvstack.engine.async_llm import AsyncLLM
from kvstack.errors import InvalidRequestError
from kvstack.server.app import create_app
from kvstack.server.responses.items import Conversation
from kvstack.server.responses.sqlite_store import SqliteResponseStore, open_store
from kvstack.server.responses.store import ResponseStore, StoredResponse
from kvstack.server.state import ServerConfig

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_torch_thread")]

MODEL = "smollm2-135m"
KEY_A, KEY_B = "key-a-state", "key-b-state"
GREEDY = {"model": MODEL, "temperature": 0, "max_output_tokens": 8}
WORDS = ["alpha", "bravo", "charlie", "delta", "echo", "foxtrot", "golf", "hotel", "india",
         "juliet", "kilo", "lima"]


def talk(tag: str, n: int) -> dict[str, str]:
    """Instructions and about `n` tokens of input; distinct tags share no cached block (the
    tag leads the system message, so not even the template's head is shared)."""
    return {"instructions": f"[{tag}] Be brief.",
            "input": " ".join(WORDS[i % len(WORDS)] for i in range(n))}


class Served:
    def __init__(self, config: ServerConfig, **llm_kwargs: Any) -> None:
        self.llm = LLM(MODEL, **llm_kwargs)
        self.engine = AsyncLLM(self.llm.engine)
        self.app = create_app(self.engine, api_keys=[KEY_A, KEY_B], config=config)
        self.server = AppServer(self.app)
        self.url = self.server.url

    def client(self, key: str = KEY_A) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key=key, max_retries=0,
                             timeout=300)

    def get(self, path: str, key: str = KEY_A, **params: Any) -> httpx.Response:
        return httpx.get(f"{self.url}{path}", params=params, timeout=60,
                         headers={"authorization": f"Bearer {key}"})

    def pinned(self) -> int:
        return self.engine.stats().num_blocks_pinned

    def close(self) -> None:
        self.server.stop()
        self.engine.shutdown()
        self.llm.engine.check_integrity()
        stats = self.llm.stats()
        assert stats.num_blocks_used == stats.num_blocks_pinned  # only pins hold blocks
        self.llm.close()  # waits for the tier writes: a restart finds them


@pytest.fixture(scope="module")
def small() -> Iterator[Served]:
    """A small pool (about 45 blocks), a third of it for pins."""
    s = Served(ServerConfig(responses_pin_ttl_s=600), kv_cache_memory="32MiB",
               max_pinned_fraction=0.34)
    yield s
    s.close()


# -- no model needed ---------------------------------------------------------------------------


def _stored(response_id: str, items: tuple[dict[str, Any], ...] = ()) -> StoredResponse:
    talk = Conversation([{"role": "user", "content": "hi"}], frozenset({"call_1"}))
    return StoredResponse({"id": response_id, "output": []}, talk, array("i", [1, 2, 3]),
                          array("i", [4, 5]), "out", items)


def test_the_sqlite_store_keeps_entries_across_reopening(tmp_path: Path) -> None:
    path = tmp_path / "responses.db"
    store = open_store(path, max_entries=2)
    for name in ("r1", "r2", "r3"):
        store.put("a", _stored(name, ({"id": f"msg_{name}", "type": "message"},)))
    assert store.get("a", "r1") is None and store.get("b", "r3") is None
    assert not store.delete("b", "r3") and store.delete("a", "r2")
    store.close()
    again = SqliteResponseStore(path, max_entries=2)
    got = again.get("a", "r3")
    assert got == _stored("r3", ({"id": "msg_r3", "type": "message"},))
    assert got is not None and got.prompt_ids == array("i", [1, 2, 3])
    assert len(again) == 1 and again.get("a", "r2") is None
    again.close()
    assert isinstance(open_store(None), ResponseStore)


def test_a_file_that_is_not_a_database_is_a_typed_error(tmp_path: Path) -> None:
    path = tmp_path / "not.db"
    path.write_bytes(b"this is not sqlite" * 100)
    with pytest.raises(InvalidRequestError, match="not a responses database"):
        SqliteResponseStore(path)


# -- input items -------------------------------------------------------------------------------


def test_input_items_list_the_chain_in_openai_shape(small: Served) -> None:
    client = small.client()
    first = client.responses.create(input=[
        {"role": "developer", "content": "Answer briefly."},
        {"role": "user", "content": [{"type": "input_text", "text": "Name a fruit."}]}],
        **GREEDY)
    second = client.responses.create(previous_response_id=first.id, input="Another?",
                                     **GREEDY)
    listed = client.responses.input_items.list(second.id, order="asc").data
    assert [(i.type, i.role) for i in listed] == [
        ("message", "developer"), ("message", "user"), ("message", "assistant"),
        ("message", "user")]
    assert listed[1].content[0].text == "Name a fruit." and listed[3].content[0].text == "Another?"
    assert listed[2].id == first.output[0].id
    assert listed[2].content[0].text == first.output_text
    assert len({i.id for i in listed}) == 4
    newest_first = client.responses.input_items.list(second.id).data  # OpenAI's default
    assert [i.id for i in newest_first] == [i.id for i in reversed(listed)]
    paged = [i.id for i in client.responses.input_items.list(second.id, limit=1)]
    assert paged == [i.id for i in newest_first]  # the SDK follows has_more and `after`
    page = small.get(f"/v1/responses/{second.id}/input_items", limit=3, order="asc",
                     after=listed[0].id).json()
    assert page["object"] == "list" and page["has_more"] is False
    assert [i["id"] for i in page["data"]] == [i.id for i in listed[1:]]
    assert (page["first_id"], page["last_id"]) == (listed[1].id, listed[3].id)
    assert [i.id for i in client.responses.input_items.list(first.id, order="asc").data] == \
        [i.id for i in listed[:2]]


def test_input_items_refuse_other_tenants_and_bad_queries(small: Served) -> None:
    mine = small.client().responses.create(input="Hello.", **GREEDY)
    path = f"/v1/responses/{mine.id}/input_items"
    assert small.get(path, key=KEY_B).status_code == 404
    assert small.get("/v1/responses/resp_unknown/input_items").status_code == 404
    for params, param in (({"limit": 0}, "limit"), ({"limit": 101}, "limit"),
                          ({"order": "sideways"}, "order"), ({"after": "msg_nope"}, "after")):
        r = small.get(path, **params)
        assert r.status_code == 400, r.text
        assert r.json()["error"]["param"] == param
    small.client().responses.delete(mine.id)
    assert small.get(path).status_code == 404


# -- retention ---------------------------------------------------------------------------------


def _pressure(served: Served, seed: int) -> None:
    """Push more new prompt tokens through the pool than it holds: every unpinned block goes."""
    rng = random.Random(seed)
    info = served.engine.info
    pool_tokens = info.num_kv_blocks * info.block_size
    for _ in range(5):
        ids = [rng.randrange(1000, 40000) for _ in range(pool_tokens // 4)]
        r = httpx.post(f"{served.url}/v1/completions", timeout=300,
                       headers={"authorization": f"Bearer {KEY_A}"},
                       json={"model": MODEL, "prompt": ids, "max_tokens": 1})
        assert r.status_code == 200, r.text


def test_an_active_conversation_survives_pressure_that_evicts_the_rest(small: Served) -> None:
    client = small.client()
    before = small.pinned()
    kept = client.responses.create(**talk("kept", 80), **GREEDY)
    assert small.pinned() > before  # its blocks are pinned now
    pinned = small.pinned()
    loose = client.responses.create(**talk("loose", 80), store=False, **GREEDY)
    assert small.pinned() == pinned  # store: false pins nothing
    _pressure(small, seed=1)
    again = client.responses.create(**talk("loose", 80), store=False, **GREEDY)
    assert again.usage.input_tokens == loose.usage.input_tokens
    assert again.usage.input_tokens_details.cached_tokens == 0  # evicted
    on = client.responses.create(previous_response_id=kept.id, input="Go on.",
                                 instructions=talk("kept", 0)["instructions"], **GREEDY)
    computed = kept.usage.input_tokens + kept.usage.output_tokens - 1
    assert on.usage.input_tokens_details.cached_tokens == computed // 16 * 16 > 0


def test_the_pin_share_of_the_pool_is_bounded(small: Served) -> None:
    cap = small.llm.engine.kv_manager.pins.max_blocks
    client = small.client()
    for tag in ("c1", "c2", "c3", "c4"):
        client.responses.create(**talk(tag, 90), **GREEDY)
        assert small.pinned() <= cap
    assert small.pinned() >= cap - 8  # full, up to a conversation's worth
    # The most recent conversation's blocks are the ones still pinned: it survives pressure.
    _pressure(small, seed=2)
    last = client.responses.create(**talk("c4", 90), store=False, **GREEDY)
    assert last.usage.input_tokens_details.cached_tokens > 0
    first = client.responses.create(**talk("c1", 90), store=False, **GREEDY)
    assert first.usage.input_tokens_details.cached_tokens == 0  # its pin lapsed first


# -- restart -----------------------------------------------------------------------------------


def test_a_stored_conversation_and_its_kv_survive_a_restart(tmp_path: Path) -> None:
    config = ServerConfig(responses_db=tmp_path / "responses.db")
    tiers = {"kv_cache_memory": "64MiB", "kv_disk_dir": tmp_path / "kv"}
    turn = {"input": "And a second one?", "instructions": talk("restart", 0)["instructions"],
            **GREEDY}
    before = Served(config, **tiers)
    try:
        client = before.client()
        first = client.responses.create(**talk("restart", 60), **GREEDY)
        continued = client.responses.create(previous_response_id=first.id, **turn)
    finally:
        before.close()
    after = Served(config, **tiers)
    try:
        client = after.client()
        assert client.responses.retrieve(first.id).output_text == first.output_text
        again = client.responses.create(previous_response_id=first.id, **turn)
        assert again.output_text == continued.output_text
        assert again.usage.input_tokens == continued.usage.input_tokens
        assert again.usage.output_tokens == continued.usage.output_tokens
        assert again.usage.input_tokens_details.cached_tokens > 0  # from the disk tier
        assert len(client.responses.input_items.list(again.id).data) == 3
        with pytest.raises(openai.NotFoundError):
            after.client(KEY_B).responses.create(previous_response_id=first.id, **turn)
    finally:
        after.close()
