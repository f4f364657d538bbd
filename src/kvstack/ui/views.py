"""The pool map and the prefix tree of one `KVSnapshot`, for one viewer, as JSON-ready values.

Pool map, columns indexed by block id (strings hold one letter per block, so a 10,000-block
pool costs tens of kilobytes):
  states  f free, u in use, c cached (evictable), p pinned
  owner   m the viewer's, o someone else's, - nobody's (free)
  tiers   - none, d disk, r redis, b both
  origin  c computed, r restored from a tier, - not published (or not the viewer's)
  node    the block's node in the prefix tree (-1: none, or not the viewer's)
  hash    the first 12 hex digits of the block hash (null: not the viewer's)
  holders block id -> the viewer's request ids holding it
  tenant  (admin only) index into `tenants`, the tenant labels
Nothing in a block the viewer does not own derives from its tokens or its request.

Prefix tree: the viewer's published blocks chained by parent hash, with runs of blocks that
have one child and the same state, hits and tiers merged into one node (a radix tree).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from kvstack.kv.snapshot import FREE, RESTORED, KVSnapshot, PublishedBlock
from kvstack.ui.access import Viewer

Decode = Callable[[Sequence[int]], str]
MAX_TREE_NODES = 2000  # a bigger tree is cut (least recently used roots first) and says so
_TIER_LETTER = {(): "-", ("disk",): "d", ("redis",): "r", ("disk", "redis"): "b"}


class TextCache:
    """Decoded text of runs of published blocks. A block's tokens never change under its
    hash, so a run is decoded once; least recently used runs are forgotten past capacity."""

    def __init__(self, decode: Decode, capacity: int = 8192) -> None:
        self.decode = decode
        self.capacity = capacity
        self._texts: OrderedDict[tuple[bytes, bytes], str] = OrderedDict()
        self._lock = threading.Lock()  # the ticker and a one-off `state` may render at once

    def text(self, run: Sequence[PublishedBlock]) -> str:
        key = (run[0].block_hash, run[-1].block_hash)
        with self._lock:
            text = self._texts.get(key)
            if text is not None:
                self._texts.move_to_end(key)
                return text
        text = self.decode([t for block in run for t in block.token_ids])
        with self._lock:
            self._texts[key] = text
            if len(self._texts) > self.capacity:
                self._texts.popitem(last=False)
        return text


def _owner_salt(snap: KVSnapshot, block_id: int) -> tuple[bool, str | None]:
    """(known, salt) of a block's tenant: its publisher's, else its first holder's."""
    published = snap.published.get(block_id)
    if published is not None:
        return True, published.cache_salt
    for request_id in snap.holders.get(block_id, ()):
        return True, snap.request_salts.get(request_id)
    return False, None


def pool_view(snap: KVSnapshot, viewer: Viewer, node_of: Mapping[int, int],
              labels: Mapping[str | None, str]) -> dict[str, Any]:
    """The pool map columns (see the module docstring)."""
    owner, tiers, origin, hashes, tenant = [], [], [], [], []
    node = [-1] * snap.num_blocks
    holders: dict[str, list[str]] = {}
    tenants: dict[str, int] = {}
    for block_id, state in enumerate(snap.states):
        known, salt = _owner_salt(snap, block_id)
        mine = known and viewer.owns(salt)
        owner.append("-" if state == FREE and not known else "m" if mine else "o")
        tiers.append(_TIER_LETTER.get(snap.tiers.get(block_id, ()), "-"))
        published = snap.published.get(block_id)
        origin.append("-" if published is None or not mine
                      else "r" if published.origin == RESTORED else "c")
        hashes.append(published.block_hash.hex()[:12] if mine and published else None)
        if mine:
            node[block_id] = node_of.get(block_id, -1)
            ids = [r for r in snap.holders.get(block_id, ()) if viewer.owns(
                snap.request_salts.get(r))]
            if ids:
                holders[str(block_id)] = ids
        if viewer.admin:
            label = labels.get(salt, "salted") if known else None
            tenant.append(-1 if label is None else tenants.setdefault(label, len(tenants)))
    view: dict[str, Any] = {"states": snap.states, "owner": "".join(owner),
                            "tiers": "".join(tiers), "origin": "".join(origin), "node": node,
                            "hash": hashes, "holders": holders}
    if viewer.admin:
        view["tenant"], view["tenants"] = tenant, list(tenants)
    return view


def _kind(snap: KVSnapshot, block_id: int) -> tuple[Any, ...]:
    use = snap.uses.get(block_id)
    return (snap.states[block_id], use.hits if use else 0, snap.tiers.get(block_id, ()),
            snap.published[block_id].origin)


def prefix_tree(snap: KVSnapshot, viewer: Viewer, texts: TextCache,
                labels: Mapping[str | None, str]) -> tuple[list[dict[str, Any]], dict[int, int]]:
    """(nodes, block id -> node id) of the viewer's cached prefixes."""
    visible = {i: b for i, b in snap.published.items() if viewer.owns(b.cache_salt)}
    by_hash = {b.block_hash: i for i, b in visible.items()}
    children: dict[int | None, list[int]] = {}
    for block_id, block in visible.items():
        parent = by_hash.get(block.parent_hash) if block.parent_hash is not None else None
        children.setdefault(parent, []).append(block_id)

    def last_used(block_id: int) -> float:
        use = snap.uses.get(block_id)
        return use.last_used if use else 0.0

    roots = sorted(children.get(None, []), key=last_used)  # popped last: most recent first
    stack: list[tuple[int, int | None]] = [(r, None) for r in roots]
    nodes: list[dict[str, Any]] = []
    node_of: dict[int, int] = {}
    while stack and len(nodes) < MAX_TREE_NODES:
        block_id, parent = stack.pop()
        run = [block_id]
        kids = children.get(block_id, [])
        while len(kids) == 1 and _kind(snap, kids[0]) == _kind(snap, run[-1]):
            run.append(kids[0])
            kids = children.get(kids[0], [])
        node_id = len(nodes)
        nodes.append(_node(snap, viewer, run, node_id, parent, texts, labels))
        node_of.update((b, node_id) for b in run)
        stack.extend((kid, node_id) for kid in sorted(kids, key=last_used))
    return nodes, node_of


def _node(snap: KVSnapshot, viewer: Viewer, run: list[int], node_id: int, parent: int | None,
          texts: TextCache, labels: Mapping[str | None, str]) -> dict[str, Any]:
    blocks = [snap.published[b] for b in run]
    first_use = snap.uses.get(run[0])
    state, hits, tiers, origin = _kind(snap, run[0])
    node = {
        "id": node_id, "parent": parent, "blocks": run, "text": texts.text(blocks),
        "tokens": sum(len(b.token_ids) for b in blocks), "hits": hits, "state": state,
        "tiers": list(tiers), "origin": origin,
        "last_used": max((u.last_used for b in run if (u := snap.uses.get(b))),
                         default=first_use.last_used if first_use else blocks[0].published_at),
        # The head of this prefix was evicted: no request can reach these blocks any more.
        "orphan": parent is None and blocks[0].parent_hash is not None,
    }
    if viewer.admin:
        node["tenant"] = labels.get(blocks[0].cache_salt, "salted")
    return node


def render(snap: KVSnapshot, viewer: Viewer, texts: TextCache,
           labels: Mapping[str | None, str]) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """(pool map, prefix tree) of a snapshot as this viewer may see it."""
    nodes, node_of = prefix_tree(snap, viewer, texts, labels)
    return pool_view(snap, viewer, node_of, labels), nodes
