"""The router's view fed by replicas' routing stats: membership, batches with gaps and
snapshots, layouts that never get affinity, the policies, exclusions and prediction accuracy.
Pure: reports are built with the wire format, no engine and no Ray."""

from __future__ import annotations

import random

from kvstack.cluster.events import BlockEvents, Snapshot
from kvstack.cluster.router import LoadReport, request_keys
from kvstack.cluster.scoring import Layout
from kvstack.cluster.view import ClusterView
from kvstack.cluster.wire import ReplicaRequest, decode_report, encode_report
from kvstack.sampling_params import SamplingParams

LAYOUT = Layout("model-a", 16, "float32")
P = 1041


def tokens(seed: int, n: int = P) -> list[int]:
    return random.Random(seed).choices(range(50_000), k=n)


def request(seed: int, salt: str | None = None, rid: str = "r", n: int = P,
            exclude: tuple[str, ...] = ()) -> ReplicaRequest:
    ids = tokens(seed, n)
    return ReplicaRequest(rid, ids, SamplingParams(max_tokens=1), salt,
                          tuple(request_keys(ids, LAYOUT, salt)), exclude=exclude)


def report(batches: list[BlockEvents], layout: Layout = LAYOUT, epoch: str = "e",
           queued: float = 0.0, running: int = 0) -> dict:
    return encode_report(epoch, layout, 4096, batches, LoadReport(queued, 0, running, 0.0))


def stored(seq: int, keys: list[int], epoch: str = "e") -> BlockEvents:
    return BlockEvents(epoch, seq, keys, ())


def test_reports_round_trip_through_the_wire_format() -> None:
    batch = BlockEvents("e", 3, [1, 2**63 + 5], [7], cleared=True)
    got = decode_report(report([batch], queued=12.5, running=2))
    assert got is not None and got.layout == LAYOUT and got.capacity_blocks == 4096
    assert got.batches == (batch,) and got.load.queued_prefill_tokens == 12.5
    assert decode_report({}) is None and decode_report({"kvstack": {"v": 99}}) is None


def test_follow_up_goes_where_its_document_is_and_the_prediction_is_scored() -> None:
    view = ClusterView("cache-aware", LAYOUT)
    doc = request(1)
    view.update({"a": report([stored(0, [])]), "b": report([stored(0, list(doc.keys))])})
    follow = request(1, rid="f")
    ranks = view.choose(follow, ["a", "b"])
    assert ranks[0] == ["b"]
    predicted = view.routed(follow, "b")
    assert predicted == (P - 1) // 16 * 16
    view.outcome("f", "b", predicted)
    summary = view.summary()
    assert summary["router"]["prediction"]["exact_fraction"] == 1.0
    assert summary["router"]["decision_us"]["p99"] is not None


def test_a_replica_with_another_layout_never_gets_affinity() -> None:
    doc = request(2)
    for other in (Layout("model-b", 16, "float32"), Layout("model-a", 32, "float32"),
                  Layout("model-a", 16, "int8")):
        view = ClusterView("cache-aware", LAYOUT)
        # The foreign replica holds every key of the prompt; the compatible one is busier.
        view.update({"foreign": report([stored(0, list(doc.keys))], layout=other),
                     "ours": report([stored(0, [])], queued=300.0)})
        first = view.choose(request(2, rid="x"), ["foreign", "ours"])
        assert view.holder(doc.keys) is None
        assert view.routed(request(2, rid="x"), "foreign") == 0
        assert first[0] in (["foreign"], ["ours"])  # by load only: no predicted hit
        assert not view.summary()["replicas"][0]["compatible"]


def test_tenants_never_steer_by_each_others_blocks() -> None:
    view = ClusterView("cache-aware", LAYOUT)
    alice = request(3, salt="alice")
    view.update({"a": report([stored(0, list(alice.keys))]), "b": report([stored(0, [])])})
    bob = request(3, salt="bob", rid="bob")  # the same document, another tenant
    assert not set(alice.keys) & set(bob.keys)
    assert view.holder(bob.keys) is None
    ranks = view.choose(bob, ["a", "b"])
    assert view.routed(bob, ranks[0][0]) == 0


def test_missed_batches_ask_for_a_snapshot_and_the_snapshot_heals() -> None:
    view = ClusterView("cache-aware", LAYOUT)
    doc = request(4)
    keys = list(doc.keys)
    view.update({"a": report([stored(0, keys[:10])])})
    assert view.needs_snapshot() == []
    # Batches 1-4 never arrived; the report carries only 5 and 6.
    view.update({"a": report([stored(5, keys[40:50]), stored(6, keys[50:60])])})
    assert view.needs_snapshot() == ["a"]
    view.apply_snapshot("a", Snapshot("e", 6, keys[:60]))
    assert view.needs_snapshot() == []
    assert view.holder(doc.keys) == "a"
    assert view.summary()["replicas"][0]["cached_blocks"] == 60


def test_a_fresh_view_and_a_restarted_replica_start_from_snapshots() -> None:
    view = ClusterView("cache-aware", LAYOUT)
    keys = list(request(5).keys)
    # A new ingress joins late: the replica's report starts at batch 7.
    view.update({"a": report([stored(7, keys[:3])])})
    assert view.needs_snapshot() == ["a"]
    view.apply_snapshot("a", Snapshot("e", 7, keys[:20]))
    assert view.holder(keys) == "a"
    # The replica restarts under the same name with an empty cache (new epoch, batch 0).
    view.update({"a": report([stored(0, [], epoch="e2")], epoch="e2")})
    assert view.needs_snapshot() == [] and view.holder(keys) is None


def test_duplicate_reports_change_nothing_and_departed_replicas_are_forgotten() -> None:
    view = ClusterView("cache-aware", LAYOUT)
    keys = list(request(6).keys)
    both = {"a": report([stored(0, keys)]), "b": report([stored(0, [])])}
    view.update(both)
    view.update(both)
    assert view.summary()["replicas"][0]["cached_blocks"] == len(keys)
    view.update({"b": both["b"]})
    assert view.replicas == ["b"] and view.holder(keys) is None
    view.remove("b")
    assert view.replicas == []


def test_baseline_policies_and_exclusions() -> None:
    names = ["a", "b", "c"]
    rr = ClusterView("round-robin", LAYOUT)
    rr.update({n: report([]) for n in names})
    firsts = [rr.choose(request(7, rid=str(i)), names)[0][0] for i in range(6)]
    assert sorted(firsts) == sorted(names * 2)
    pow2 = ClusterView("pow2", LAYOUT)
    ranks = pow2.choose(request(7), names)
    assert len(ranks[0]) == 2 and set(ranks[0]) <= set(names)
    oracle = ClusterView("oracle", LAYOUT, oracle_pins={request(7).keys[0]: 2})
    oracle.update({n: report([]) for n in names})
    assert oracle.choose(request(7), names)[0] == ["c"]
    ca = ClusterView("cache-aware", LAYOUT)
    doc = request(8)
    ca.update({"a": report([stored(0, list(doc.keys))]), "b": report([])})
    ranks = ca.choose(request(8, exclude=("a",)), ["a", "b"])
    assert ranks[0] == ["b"] and ["a"] not in ranks


def test_a_burst_of_one_new_prefix_stays_on_one_replica() -> None:
    """The decision record: routed requests count as held before any report says so."""
    view = ClusterView("cache-aware", LAYOUT)
    view.update({"a": report([]), "b": report([])})
    chosen = set()
    for i in range(4):
        follow = request(9, rid=f"burst{i}")
        name = view.choose(follow, ["a", "b"])[0][0]
        view.routed(follow, name)
        chosen.add(name)
    assert len(chosen) == 1


def test_a_hit_waits_for_its_replica_until_the_line_there_outweighs_the_prefix() -> None:
    """Ray holds a request offered one replica until it has room; the router counts the
    held requests as that replica's load, so a hot prefix spreads once its line is long."""
    view = ClusterView("cache-aware", LAYOUT)
    doc = request(5)
    view.update({"a": report([stored(0, list(doc.keys))]), "b": report([])})
    ranks = [view.choose(request(5, rid=f"h{i}"), ["a", "b"]) for i in range(6)]
    waiting = [r for r in ranks if r == [["a"]]]
    assert len(waiting) == 6
    router = view.router
    assert router is not None and len(router.held) == 6
    again = view.choose(request(5, rid="h0"), ["a", "b"])  # a retry refreshes, never doubles
    assert again == [["a"]] and len(router.held) == 6
    view.routed(request(5, rid="h0"), "a")
    assert len(router.held) == 5
    for i in range(6, 400):
        if view.choose(request(5, rid=f"h{i}"), ["a", "b"]) != [["a"]]:
            break
    # Each held hit costs its last token and a decode at "a" (1 + 32 tokens); computing the
    # prefix at "b" costs 1,040 more: at load_weight 1/4 the line turns after 1040 * 4 / 33.
    config = router.config
    assert abs(i - 1040 / config.load_weight / (1 + config.running_request_tokens)) < 2
    assert view.choose(request(5, rid="late"), ["a", "b"])[0] == ["b"]
    router.held.expire(10**12)  # requests cancelled while held are forgotten
    assert len(router.held) == 0 and view.choose(request(5, rid="z"), ["a", "b"]) == [["a"]]


def test_the_oracle_offers_only_the_pinned_replica() -> None:
    oracle = ClusterView("oracle", LAYOUT, oracle_pins={request(7).keys[0]: 1})
    oracle.update({n: report([], running=4) for n in ("a", "b")})
    assert oracle.choose(request(7), ["a", "b"]) == [["b"]]
