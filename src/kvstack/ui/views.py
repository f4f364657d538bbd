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

from kvstack.kv.snapshot import RESTORED, KVSnapshot, PublishedBlock
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
    return False, None  # a free block with nothing in it


def pool_view(snap: KVSnapshot, viewer: Viewer, node_of: Mapping[int, int],
              labels: Mapping[str | None, str]) -> dict[str, Any]:
    """The pool map columns (see the module docstring). Work is proportional to the blocks
    that hold something: a free block with no record keeps every column's default."""
    n = snap.num_blocks
    owner, tiers, origin = ["-"] * n, ["-"] * n, ["-"] * n
    hashes: list[str | None] = [None] * n
    node, tenant = [-1] * n, [-1] * n
    holders: dict[str, list[str]] = {}
    tenants: dict[str, int] = {}
    owns, admin = viewer.owns, viewer.admin
    for block_id, names in snap.tiers.items():
        tiers[block_id] = _TIER_LETTER.get(names, "-")
    for block_id in snap.published.keys() | snap.holders.keys():
        _, salt = _owner_salt(snap, block_id)
        if admin:
            tenant[block_id] = tenants.setdefault(labels.get(salt, "salted"), len(tenants))
        if not owns(salt):
            owner[block_id] = "o"
            continue
        owner[block_id] = "m"
        node[block_id] = node_of.get(block_id, -1)
        published = snap.published.get(block_id)
        if published is not None:
            origin[block_id] = "r" if published.origin == RESTORED else "c"
            hashes[block_id] = published.block_hash.hex()[:12]
        ids = [r for r in snap.holders.get(block_id, ()) if owns(snap.request_salts.get(r))]
        if ids:
            holders[str(block_id)] = ids
    view: dict[str, Any] = {"states": snap.states, "owner": "".join(owner),
                            "tiers": "".join(tiers), "origin": "".join(origin), "node": node,
                            "hash": hashes, "holders": holders}
    if admin:
        view["tenant"], view["tenants"] = tenant, list(tenants)
    return view


def prefix_tree(snap: KVSnapshot, viewer: Viewer, texts: TextCache,
                labels: Mapping[str | None, str]) -> tuple[list[dict[str, Any]], dict[int, int]]:
    """(nodes, block id -> node id) of the viewer's cached prefixes."""
    owns = viewer.owns
    visible = {i: b for i, b in snap.published.items() if owns(b.cache_salt)}
    by_hash = {b.block_hash: i for i, b in visible.items()}
    children: dict[int | None, list[int]] = {}
    for block_id, block in visible.items():
        parent = by_hash.get(block.parent_hash) if block.parent_hash is not None else None
        children.setdefault(parent, []).append(block_id)
    uses, states, tiers = snap.uses, snap.states, snap.tiers
    # What must match for a block to merge into its parent's node: state, hits, tiers, origin.
    kind = {i: (states[i], uses[i].hits if i in uses else 0, tiers.get(i, ()), b.origin)
            for i, b in visible.items()}
    last_used = {i: uses[i].last_used if i in uses else b.published_at
                 for i, b in visible.items()}
    roots = sorted(children.get(None, []), key=last_used.__getitem__)  # popped last: newest
    stack: list[tuple[int, int | None]] = [(r, None) for r in roots]
    nodes: list[dict[str, Any]] = []
    node_of: dict[int, int] = {}
    while stack and len(nodes) < MAX_TREE_NODES:
        block_id, parent = stack.pop()
        run = [block_id]
        kids = children.get(block_id, [])
        while len(kids) == 1 and kind[kids[0]] == kind[block_id]:
            run.append(kids[0])
            kids = children.get(kids[0], [])
        node_id = len(nodes)
        blocks = [visible[b] for b in run]
        state, hits, block_tiers, origin = kind[block_id]
        node = {
            "id": node_id, "parent": parent, "blocks": run, "text": texts.text(blocks),
            "tokens": sum(len(b.token_ids) for b in blocks), "hits": hits, "state": state,
            "tiers": list(block_tiers), "origin": origin,
            "last_used": max(last_used[b] for b in run),
            # The head of this prefix was evicted: no request can reach these blocks any more.
            "orphan": parent is None and blocks[0].parent_hash is not None,
        }
        if viewer.admin:
            node["tenant"] = labels.get(blocks[0].cache_salt, "salted")
        nodes.append(node)
        node_of.update((b, node_id) for b in run)
        stack.extend((kid, node_id) for kid in sorted(kids, key=last_used.__getitem__))
    return nodes, node_of


def render(snap: KVSnapshot, viewer: Viewer, texts: TextCache,
           labels: Mapping[str | None, str]) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """(pool map, prefix tree) of a snapshot as this viewer may see it."""
    nodes, node_of = prefix_tree(snap, viewer, texts, labels)
    return pool_view(snap, viewer, node_of, labels), nodes
