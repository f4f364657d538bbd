"""`kvstack cache`: named prompt caches in the KV tiers — warm a document, list, count, clear.

`warm` runs the model (a prefill) and writes the document's KV blocks to the disk directory
and/or Redis; `ls`, `stats` and `clear` only read block headers and never load a model.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvstack.cli.args import add_model_args, load_llm
from kvstack.errors import InvalidRequestError
from kvstack.kv.tiers.codec import HEADER, BlockFault, parse_header
from kvstack.kv.tiers.disk import SUFFIX, DiskTier, block_files
from kvstack.kv.tiers.redis_tier import connect, scan_blocks
from kvstack.units import format_bytes


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(
        "cache",
        help="named prompt caches in the KV tiers: warm, ls, stats, clear",
        description="Precompute a document's KV blocks into the disk and Redis tiers, so that "
        "any later engine (another process, another machine on the same Redis) starts from "
        "them; list, count and clear what the tiers hold.",
        epilog="example: kvstack cache warm --file doc.txt --kv-disk-dir ~/.cache/kvstack/kv",
    )
    actions = parser.add_subparsers(title="actions", metavar="ACTION", dest="action",
                                    required=True)
    warm = actions.add_parser("warm", help="prefill a document and store its KV blocks",
                              description="Run a prefill of the document (one token generated) "
                              "and wait until its full KV blocks are in every tier given.")
    source = warm.add_mutually_exclusive_group(required=True)
    source.add_argument("--file", metavar="PATH",
                        help="the document (UTF-8 text), or - for stdin")
    source.add_argument("--chunk", nargs="+", metavar="PATH",
                        help="store each file's text as a chunk entry for blending (reused "
                        "at any position by requests that opt in; APPROXIMATE)")
    add_model_args(warm, cache_switches=False)
    warm.set_defaults(run=run_warm)
    for name, text, run in (("ls", "list the blocks the tiers hold", run_ls),
                            ("stats", "count blocks and bytes per tier and model", run_stats),
                            ("clear", "delete every kvstack block from the tiers", run_clear)):
        action = actions.add_parser(name, help=text, description=text[0].upper() + text[1:] + ".")
        action.add_argument("--kv-disk-dir", default=None, metavar="DIR",
                            help="the disk tier's directory")
        action.add_argument("--kv-redis-url", default=None, metavar="URL",
                            help="the Redis tier's server, e.g. redis://127.0.0.1:6379/0")
        action.set_defaults(run=run)
    return parser


def run_warm(args: argparse.Namespace) -> int:
    if not (args.kv_disk_dir or args.kv_redis_url):
        raise InvalidRequestError("nowhere to warm into; give --kv-disk-dir and/or --kv-redis-url")
    if args.chunk:
        return _warm_chunks(args)
    text = sys.stdin.read() if args.file == "-" else _read(Path(args.file))
    if not text:
        raise InvalidRequestError(f"{args.file} is empty; give a document to warm")
    start = time.perf_counter()
    with load_llm(args) as llm:
        num_tokens = len(llm.get_tokenizer().encode(text)) if llm.get_tokenizer() else 0
        num_stored = llm.warm(text)
        faults = {name: s.faults for name, s in llm.tier_stats().items() if s.faults}
    where = ", ".join(t for t in (args.kv_disk_dir, args.kv_redis_url) if t)
    print(f"warmed {num_stored} of {num_tokens} tokens of {args.file} into {where} "
          f"in {time.perf_counter() - start:.1f} s"
          + (f" (faults: {faults})" if faults else ""))
    return 0 if num_stored or num_tokens < args.block_size else 1


def _warm_chunks(args: argparse.Namespace) -> int:
    texts = [_read(Path(p)) for p in args.chunk]
    start = time.perf_counter()
    with load_llm(args) as llm:
        num_new = llm.precompute_chunks(texts)
        faults = {name: s.faults for name, s in llm.tier_stats().items() if s.faults}
    where = ", ".join(t for t in (args.kv_disk_dir, args.kv_redis_url) if t)
    print(f"warmed {num_new} chunk entries ({len(texts) - num_new} held already) from "
          f"{len(texts)} files into {where} in {time.perf_counter() - start:.1f} s"
          + (f" (faults: {faults})" if faults else ""))
    return 1 if faults else 0


def _read(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except OSError as err:
        raise InvalidRequestError(f"cannot read {path}: {err.strerror}") from err
    except UnicodeDecodeError as err:
        raise InvalidRequestError(f"{path} is not UTF-8 text") from err


# -- reading what the tiers hold, without a model -------------------------------------------


@dataclass(frozen=True)
class BlockEntry:
    tier: str
    name: str  # block hash hex
    size: int
    fingerprint: str | None  # None when the header is not a valid kvstack block header
    describe: str  # dtype and layout, or why the header is bad
    age_s: float | None


def _disk_entries(directory: str) -> Iterator[BlockEntry]:
    if not Path(directory).is_dir():
        raise InvalidRequestError(f"{directory} is not a directory")
    now = time.time()
    for entry in block_files(Path(directory)):
        try:
            st = entry.stat()
            with open(entry.path, "rb") as f:
                head = f.read(HEADER.size)
        except OSError:
            continue
        yield _entry("disk", entry.name.removesuffix(SUFFIX), st.st_size, head,
                     now - st.st_mtime)


def _redis_entries(url: str) -> Iterator[BlockEntry]:
    client = connect(url, timeout_s=5.0)
    import redis

    try:
        for key in scan_blocks(client):
            pipe = client.pipeline(transaction=False)
            pipe.strlen(key)
            pipe.getrange(key, 0, HEADER.size - 1)
            pipe.ttl(key)
            size, head, ttl = pipe.execute()
            if not size:
                continue
            yield _entry("redis", key.decode().rsplit(":", 1)[-1], size, head,
                         None if ttl is None or ttl < 0 else float(ttl))
    except redis.exceptions.RedisError as err:
        raise InvalidRequestError(f"Redis at {url} failed: {err}") from err
    finally:
        client.close()


def _entry(tier: str, name: str, size: int, head: bytes, age_s: float | None) -> BlockEntry:
    try:
        h = parse_header(head)
    except BlockFault as err:
        from kvstack.blend.codec import parse_chunk_header  # torch: only when listing
        from kvstack.recurrent.codec import parse_snapshot_header

        try:
            c = parse_chunk_header(head)
        except BlockFault:
            try:
                s = parse_snapshot_header(head)
            except BlockFault:
                return BlockEntry(tier, name, size, None, f"bad header: {err}", age_s)
            return BlockEntry(tier, name, size, s.fingerprint, f"state snapshot ({s.dtype} "
                              f"linear layers={s.num_layers}; hybrid model)", age_s)
        return BlockEntry(tier, name, size, c.fingerprint, f"chunk entry ({c.dtype} layers="
                          f"{c.num_layers} tokens={c.num_tokens}; blending)", age_s)
    describe = (f"{h.dtype} layers={h.num_layers} kv_heads={h.num_kv_heads} "
                f"head_dim={h.head_dim} block={h.block_size}")
    return BlockEntry(tier, name, size, h.fingerprint, describe, age_s)


def _entries(args: argparse.Namespace) -> Iterator[BlockEntry]:
    if not (args.kv_disk_dir or args.kv_redis_url):
        raise InvalidRequestError("no tier given; pass --kv-disk-dir and/or --kv-redis-url")
    if args.kv_disk_dir:
        yield from _disk_entries(args.kv_disk_dir)
    if args.kv_redis_url:
        yield from _redis_entries(args.kv_redis_url)


def run_ls(args: argparse.Namespace) -> int:
    for e in _entries(args):
        age = "" if e.age_s is None else (f"ttl {e.age_s:.0f}s" if e.tier == "redis"
                                           else f"age {e.age_s:.0f}s")
        model = e.fingerprint[:12] if e.fingerprint else "-"
        print(f"{e.tier:5}  {e.name[:16]}  {format_bytes(e.size):>10}  model {model}  "
              f"{e.describe}  {age}".rstrip())
    return 0


def run_stats(args: argparse.Namespace) -> int:
    blocks: Counter[tuple[str, str]] = Counter()
    sizes: Counter[tuple[str, str]] = Counter()
    for e in _entries(args):
        key = (e.tier, e.fingerprint[:12] if e.fingerprint else "bad header")
        blocks[key] += 1
        sizes[key] += e.size
    for tier in ("disk", "redis"):
        where = args.kv_disk_dir if tier == "disk" else args.kv_redis_url
        if not where:
            continue
        keys = [k for k in blocks if k[0] == tier]
        total = sum(sizes[k] for k in keys)
        print(f"{tier} {where}: {sum(blocks[k] for k in keys)} blocks, {format_bytes(total)}")
        for k in sorted(keys):
            print(f"  model {k[1]}: {blocks[k]} blocks, {format_bytes(sizes[k])}")
    return 0


def run_clear(args: argparse.Namespace) -> int:
    if not (args.kv_disk_dir or args.kv_redis_url):
        raise InvalidRequestError("no tier given; pass --kv-disk-dir and/or --kv-redis-url")
    if args.kv_disk_dir:
        if not Path(args.kv_disk_dir).is_dir():
            raise InvalidRequestError(f"{args.kv_disk_dir} is not a directory")
        tier = DiskTier(args.kv_disk_dir, max_bytes=1)
        num = len(tier)
        freed = tier.clear()
        print(f"disk {args.kv_disk_dir}: removed {num} blocks, {format_bytes(freed)}")
    if args.kv_redis_url:
        print(f"redis {args.kv_redis_url}: removed {_clear_redis(args.kv_redis_url)} blocks")
    return 0


def _clear_redis(url: str) -> int:
    client = connect(url, timeout_s=5.0)
    import redis

    try:
        keys = list(scan_blocks(client))
        for start in range(0, len(keys), 1000):
            client.delete(*keys[start:start + 1000])
        return len(keys)
    except redis.exceptions.RedisError as err:
        raise InvalidRequestError(f"Redis at {url} failed: {err}") from err
    finally:
        client.close()
