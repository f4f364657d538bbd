"""The live view's pure parts: redaction of the pool map and the prefix tree per viewer, the
radix merge, the charts' history and percentiles, and who a key shows the page to. No model."""

from __future__ import annotations

import json
from collections.abc import Sequence

import pytest
from helpers.kv_requests import prefill

from kvstack.engine.stats import EngineStats
from kvstack.kv.manager import KVCacheManager
from kvstack.kv.snapshot import KVSnapshot
from kvstack.outputs import RequestMetrics, RequestOutput
from kvstack.server.auth import KeyRing, Tenant, tenant_id
from kvstack.ui.access import ADMIN, OPEN, TENANT, Viewer
from kvstack.ui.history import History, LatencyWindow, SemanticCounts, percentile
from kvstack.ui.playground import source_slice
from kvstack.ui.views import MAX_TREE_NODES, TextCache, render

BS = 4
SALT_A, SALT_B = "salt-a", "salt-b"
A = Viewer(TENANT, "t-a", SALT_A)
B = Viewer(TENANT, "t-b", SALT_B)
ADMIN_VIEWER = Viewer(ADMIN, "admin", "salt-admin")
LABELS = {SALT_A: "t-a", SALT_B: "t-b", None: "public"}


def decode(ids: Sequence[int]) -> str:
    return "".join(f"<{t}>" for t in ids)


def make_kv(prompts: list[tuple[str, list[int], str | None]],
            keep: Sequence[str] = ()) -> KVCacheManager:
    kv = KVCacheManager(32, BS, True, "fp")
    for request_id, prompt, salt in prompts:
        prefill(kv, request_id, prompt, salt)
        if request_id not in keep:
            kv.free(request_id)
    return kv


SHARED = [100, 101, 102, 103, 104, 105, 106, 107]  # two full blocks


def tree_texts(nodes: list[dict]) -> list[str]:
    return sorted(n["text"] for n in nodes)


def test_tenants_see_only_their_own_text_and_requests() -> None:
    kv = make_kv([("a1", SHARED + [1, 2, 3, 4, 9], SALT_A),
                  ("b1", SHARED + [5, 6, 7, 8, 9], SALT_B),
                  ("a2", [200, 201, 202, 203, 204, 205], SALT_A)], keep=("a2",))
    snap = kv.snapshot()
    texts = TextCache(decode)
    pool_a, tree_a = render(snap, A, texts, LABELS)
    pool_b, tree_b = render(snap, B, texts, LABELS)
    a_json, b_json = json.dumps([pool_a, tree_a]), json.dumps([pool_b, tree_b])
    assert "<200>" in a_json and "<5>" not in a_json and "a2" in a_json
    assert "<5>" in b_json and "<200>" not in b_json and "<1>" not in b_json and "a2" not in b_json
    assert pool_a["states"] == pool_b["states"] == snap.states  # the map itself is shared
    for pool, mine, theirs in ((pool_a, SALT_A, SALT_B), (pool_b, SALT_B, SALT_A)):
        for block_id, published in snap.published.items():
            if published.cache_salt == mine:
                assert pool["owner"][block_id] == "m" and pool["hash"][block_id]
                assert pool["node"][block_id] >= 0
            else:
                assert published.cache_salt == theirs
                assert pool["owner"][block_id] == "o" and pool["hash"][block_id] is None
                assert pool["node"][block_id] == -1 and pool["origin"][block_id] == "-"
    assert "tenant" not in pool_a and all("tenant" not in n for n in tree_a)
    # a2 still runs: its blocks are in use, held by a2 (A sees the id, B does not).
    held = [i for i, ids in snap.holders.items() if ids == ("a2",)]
    assert held and all(pool_a["holders"][str(i)] == ["a2"] for i in held)
    assert pool_b["holders"] == {} and all(pool_b["owner"][i] == "o" for i in held)


def test_admin_sees_everything_with_tenant_labels() -> None:
    kv = make_kv([("a1", SHARED + [1, 2, 3, 4, 9], SALT_A), ("b1", SHARED + [9], SALT_B),
                  ("x", [300, 301, 302, 303, 9], "user-salt")])
    pool, tree = render(kv.snapshot(), ADMIN_VIEWER, TextCache(decode), LABELS)
    labels = {n["text"]: n["tenant"] for n in tree}
    assert labels[decode(SHARED + [1, 2, 3, 4])] == "t-a"
    assert labels[decode(SHARED)] == "t-b"
    assert labels[decode([300, 301, 302, 303])] == "salted"  # a salt no key gives
    assert set(pool["owner"]) <= {"m", "-"}
    assert sorted(pool["tenants"]) == ["salted", "t-a", "t-b"]


def test_an_open_viewer_does_not_see_requests_with_their_own_salt() -> None:
    kv = make_kv([("p", [1, 2, 3, 4, 5], None), ("s", [6, 7, 8, 9, 10], "private")])
    _, tree = render(kv.snapshot(), Viewer(OPEN, "public", None), TextCache(decode), LABELS)
    assert tree_texts(tree) == [decode([1, 2, 3, 4])]


def test_tree_merges_single_child_runs_and_branches_where_prefixes_part() -> None:
    # Two prompts share two blocks, then part; a third request hits the shared blocks again.
    kv = make_kv([("a", SHARED + [1, 2, 3, 4, 11, 12, 13, 14, 9], SALT_A),
                  ("b", SHARED + [5, 6, 7, 8, 9], SALT_A), ("c", SHARED + [9], SALT_A)])
    _, tree = render(kv.snapshot(), A, TextCache(decode), LABELS)
    by_text = {n["text"]: n for n in tree}
    trunk = by_text[decode(SHARED)]
    assert trunk["parent"] is None and trunk["hits"] == 2 and trunk["tokens"] == 8
    assert len(trunk["blocks"]) == 2  # two blocks, one node
    branch = by_text[decode([1, 2, 3, 4, 11, 12, 13, 14])]
    assert branch["parent"] == trunk["id"] and branch["hits"] == 0 and len(branch["blocks"]) == 2
    assert by_text[decode([5, 6, 7, 8])]["parent"] == trunk["id"]
    assert len(tree) == 3 and not any(n["orphan"] for n in tree)
    assert {n["state"] for n in tree} == {"c"}


def test_tree_marks_orphans_and_caps_its_size() -> None:
    kv = make_kv([("a", SHARED + [9], SALT_A)])
    snap = kv.snapshot()
    head = next(i for i, b in snap.published.items() if b.parent_hash is None)
    cut = KVSnapshot(snap.taken_at, BS, snap.states,
                     {i: b for i, b in snap.published.items() if i != head}, snap.uses,
                     snap.holders, snap.request_salts, snap.tiers)
    _, tree = render(cut, A, TextCache(decode), LABELS)
    assert [n["orphan"] for n in tree] == [True]
    many = make_kv([(f"r{i}", [1000 + i, 1, 2, 3, 9], SALT_A) for i in range(6)])
    import kvstack.ui.views as views

    views.MAX_TREE_NODES, before = 4, MAX_TREE_NODES
    try:
        _, capped = render(many.snapshot(), A, TextCache(decode), LABELS)
    finally:
        views.MAX_TREE_NODES = before
    assert len(capped) == 4


def test_text_cache_decodes_a_run_once() -> None:
    calls = []

    def counting(ids: Sequence[int]) -> str:
        calls.append(list(ids))
        return decode(ids)

    kv = make_kv([("a", SHARED + [9], SALT_A)])
    texts = TextCache(counting)
    for _ in range(3):
        render(kv.snapshot(), A, texts, LABELS)
    assert calls == [SHARED]


def stats(**fields: int) -> EngineStats:
    base = dict(num_requests_running=0, num_requests_waiting=0, kv_cache_bytes=0,
                num_preemptions=0, num_prompt_tokens=0, num_generation_tokens=0,
                num_blocks_total=10)
    return EngineStats(**(base | fields))


def test_history_points_are_deltas_and_window_rates() -> None:
    history = History()
    none = {"ttft": None, "tpot": None}
    first = history.add(100.0, stats(), SemanticCounts(0, 0), none)
    assert first["tok_s"] == 0 and first["hit_rate"] is None
    p = history.add(102.0, stats(num_generation_tokens=50, prefix_cache_query_tokens=100,
                                 prefix_cache_hit_tokens=25, num_preemptions=2,
                                 num_blocks_used=4, num_blocks_pinned=1, num_blocks_cached=3),
                    SemanticCounts(5, 2), none)
    assert p["tok_s"] == 25 and p["hit_rate"] == 0.25 and p["preemptions"] == 2
    assert (p["blocks_used"], p["blocks_pinned"], p["blocks_cached"]) == (3, 1, 3)
    assert p["semantic"] == [5, 2]
    later = history.add(120.0, stats(num_generation_tokens=50, prefix_cache_query_tokens=200,
                                     prefix_cache_hit_tokens=125), None, none)
    assert later["hit_rate"] == 1.0  # the last 10 s only: 100 looked up, 100 found
    assert later["semantic"] is None and len(history.points) == 3


def test_latency_percentiles_over_the_last_minute() -> None:
    window = LatencyWindow(window_s=60)
    for i, ttft in enumerate([0.1, 0.2, 0.3, 0.4, 1.0]):
        m = RequestMetrics(arrival_time=0.0, first_token_time=ttft)
        m.inter_token_latencies = [0.01 * (i + 1)]
        window.observe(RequestOutput("r", None, [], [], True, 0, m), now=100.0 + i)
    got = window.percentiles(now=110.0)
    assert got["ttft"] == [300.0, 760.0, 976.0] and got["tpot"][0] == 30.0
    assert window.percentiles(now=1000.0) == {"ttft": None, "tpot": None}
    assert percentile([5.0], 99) == 5.0
    with pytest.raises(ValueError):
        percentile([], 50)


def test_source_slice_cuts_runs() -> None:
    runs = [("draft", 3), ("model", 2), ("draft", 1)]
    assert source_slice(runs, 0, 6) == [["draft", 3], ["model", 2], ["draft", 1]]
    assert source_slice(runs, 2, 5) == [["draft", 1], ["model", 2]]
    assert source_slice(runs, 5, 6) == [["draft", 1]] and source_slice(runs, 6, 6) == []


def test_keys_decide_who_sees_what() -> None:
    ring = KeyRing(["ka", "kb"], admin_key="root")
    a = ring.viewer("ka")
    assert a is not None and (a.role, a.label, a.salt) == (TENANT, tenant_id(Tenant("ka")),
                                                           Tenant("ka").cache_salt(None))
    admin = ring.viewer("root")
    assert admin is not None and admin.admin and admin.owns("anything")
    assert ring.viewer("nope") is None and ring.viewer(None) is None
    assert ring.labels()[Tenant("kb").cache_salt(None)] == tenant_id(Tenant("kb"))
    open_ring = KeyRing([], admin_key="root")
    assert open_ring.viewer(None) == Viewer(OPEN, "public", None)
    assert open_ring.viewer("root").role == ADMIN  # type: ignore[union-attr]
    from kvstack.errors import InvalidRequestError

    with pytest.raises(InvalidRequestError, match="admin key is also an API key"):
        KeyRing(["same"], admin_key="same")
    with pytest.raises(InvalidRequestError, match="admin key is empty"):
        KeyRing([], admin_key="")
