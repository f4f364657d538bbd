"""The Redis tier: KV blocks shared by every engine that reaches one Redis server.

Keys are `kvstack:kv1:<model fingerprint>:<block hash hex>`, values the same encoded blocks as
the disk tier, each with a TTL (refreshed when loaded). The server's own `maxmemory` policy
decides what it keeps; a refused write (OOM) is a counted fault, not an error.

Redis is a cache here, never a dependency: sockets time out fast (0.2 s by default), nothing is
retried, and after a timeout or a lost connection the tier stays out of the way for
`retry_after_s` before trying again (so a dead server costs one timeout per interval, not one
per request). Every failure is a miss plus a fault counter.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Any, TypeVar, cast

from kvstack.clock import MONOTONIC, Clock
from kvstack.errors import InvalidRequestError
from kvstack.kv.block_hash import BlockHash
from kvstack.kv.tiers.base import KVTier

KEY_PREFIX = "kvstack:kv1:"
_LOAD_CHUNK = 8  # blocks per round trip: stop early at a gap without pulling the whole run

T = TypeVar("T")


def connect(url: str, timeout_s: float) -> Any:
    """A redis-py client that fails fast: short socket timeouts and no retries."""
    try:
        import redis
        from redis.backoff import NoBackoff
        from redis.retry import Retry
    except ImportError as err:
        raise InvalidRequestError(
            "the Redis KV tier needs redis-py; run `pip install 'kvstack[redis]'`"
        ) from err
    try:
        return redis.Redis.from_url(url, socket_timeout=timeout_s,
                                    socket_connect_timeout=timeout_s, retry=Retry(NoBackoff(), 0),
                                    retry_on_timeout=False, health_check_interval=0)
    except ValueError as err:
        message = f"bad Redis URL {url!r}: {err}; use redis://host:port/db"
        raise InvalidRequestError(message) from err


class RedisTier(KVTier):
    name = "redis"

    def __init__(self, url: str, fingerprint: str, ttl_s: int = 86400, timeout_s: float = 0.2,
                 retry_after_s: float = 1.0, clock: Clock = MONOTONIC) -> None:
        super().__init__()
        self.clock = clock  # the retry pause's; tests pass a fake one
        self.url = url
        self.ttl_s = ttl_s
        self.retry_after_s = retry_after_s
        self.prefix = f"{KEY_PREFIX}{fingerprint}:"
        self.client = connect(url, timeout_s)
        self._down_until = 0.0

    def key(self, block_hash: BlockHash) -> str:
        return self.prefix + block_hash.hex()

    def _call(self, fn: Callable[[], T]) -> T | None:
        """Run one Redis exchange; None (and a fault counted) if it failed or Redis is down."""
        import redis

        if self.clock() < self._down_until:
            self.stats.fault("unavailable")
            return None
        try:
            return fn()
        except redis.exceptions.TimeoutError:
            kind = "timeout"
        except (redis.exceptions.ConnectionError, OSError):
            kind = "connection"
        except redis.exceptions.ResponseError as err:
            # Over maxmemory (noeviction): the server refuses writes, reads still work.
            oom = isinstance(err, getattr(redis.exceptions, "OutOfMemoryError", ())) or (
                "maxmemory" in str(err))
            self.stats.fault("oom" if oom else "redis_error")
            return None
        except redis.exceptions.RedisError:
            self.stats.fault("redis_error")
            return None
        self.stats.fault(kind)
        self._down_until = self.clock() + self.retry_after_s
        return None

    def lookup(self, hashes: Sequence[BlockHash]) -> int:
        def exists() -> list[int]:
            pipe = self.client.pipeline(transaction=False)
            for block_hash in hashes:
                pipe.exists(self.key(block_hash))
            return cast(list[int], pipe.execute())

        found = self._call(exists) if hashes else []
        return self.count_run((bool(held) for held in found or []), len(hashes))

    def load(self, hashes: Sequence[BlockHash]) -> list[bytes]:
        out: list[bytes] = []
        for start in range(0, len(hashes), _LOAD_CHUNK):
            chunk = hashes[start:start + _LOAD_CHUNK]

            def get(chunk: Sequence[BlockHash] = chunk) -> list[Any]:
                pipe = self.client.pipeline(transaction=False)
                for block_hash in chunk:
                    pipe.get(self.key(block_hash))
                    pipe.expire(self.key(block_hash), self.ttl_s)
                return cast(list[Any], pipe.execute()[::2])

            values = self._call(get) or []
            for value in values:
                if value is None:
                    return out
                out.append(value)
            if len(values) < len(chunk):
                break
        return out

    def store(self, block_hash: BlockHash, data: bytes) -> bool:
        if self._call(lambda: self.client.set(self.key(block_hash), data, ex=self.ttl_s)) is None:
            return False
        self.stats.add(stores=1, bytes_stored=len(data))
        return True

    def discard(self, block_hash: BlockHash) -> None:
        self._call(lambda: self.client.delete(self.key(block_hash)))

    def close(self) -> None:
        self.client.close()


def scan_blocks(client: Any, fingerprint: str | None = None) -> Iterator[bytes]:
    """Keys of the kvstack blocks on a server (of one model, given its fingerprint)."""
    pattern = f"{KEY_PREFIX}{fingerprint}:*" if fingerprint else f"{KEY_PREFIX}*"
    yield from client.scan_iter(match=pattern, count=1000)
