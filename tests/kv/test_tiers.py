"""KV tiers below the memory pool: the block codec, the disk and Redis tiers, the chain, and the
engine using them across processes. Every fault is a miss: same output, a counter, no crash."""

from __future__ import annotations

import builtins
import errno
import json
import os
import shutil
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers.clock import FakeClock
from helpers.redis_server import RedisServer, redis_server, start_redis  # noqa: F401

import kvstack
from kvstack.cli.main import main as cli_main
from kvstack.config import ModelConfig
from kvstack.engine.llm import LLM
from kvstack.kv.block_hash import hash_block
from kvstack.kv.storage.base import KVCacheStorage
from kvstack.kv.tiers import disk as disk_module
from kvstack.kv.tiers.base import KVTier
from kvstack.kv.tiers.chain import TierChain
from kvstack.kv.tiers.codec import HEADER, BlockFault, BlockFormat, parse_header
from kvstack.kv.tiers.disk import DiskTier, block_files
from kvstack.kv.tiers.redis_tier import RedisTier
from kvstack.sampling_params import SamplingParams

FP = "ab" * 32
OTHER_FP = "cd" * 32
SRC = str(Path(kvstack.__file__).resolve().parent.parent)


def small_format(fingerprint: str = FP) -> BlockFormat:
    # payload: 2 layers x (k, v) x 4 tokens x 1 head x 8 dims x 4 B = 512 B
    return BlockFormat(fingerprint, "float32", num_layers=2, num_kv_heads=1, head_dim=8,
                       block_size=4)


def block(fmt: BlockFormat, i: int, salt: int = 0) -> tuple[bytes, bytes]:
    """(block hash, encoded block) with a payload that names i and salt."""
    block_hash = hash_block(None, [i])
    payload = torch.full((fmt.payload_bytes // 4,), float(i * 1000 + salt)).numpy().tobytes()
    return block_hash, fmt.encode(block_hash, payload)


def dir_bytes(directory: Path) -> int:
    return sum(e.stat().st_size for e in os.scandir(directory))


# -- codec -----------------------------------------------------------------------------------


def _set_version(data: bytes) -> bytes:
    return data[:8] + (99).to_bytes(2, "little") + data[10:]


CORRUPTIONS: dict[str, Callable[[bytes], bytes]] = {
    "truncated": lambda d: d[: len(d) // 2],
    "checksum": lambda d: d[:-1] + bytes([d[-1] ^ 0xFF]),
    "fingerprint": lambda d: small_format(OTHER_FP).encode(hash_block(None, [1]),
                                                           d[HEADER.size:]),
    "version": _set_version,
    "bad_magic": lambda d: b"X" + d[1:],
    "hash": lambda d: small_format().encode(hash_block(None, [2]), d[HEADER.size:]),
    "layout": lambda d: BlockFormat(FP, "float32", 2, 2, 4, 4).encode(hash_block(None, [1]),
                                                                      d[HEADER.size:]),
}


def test_codec_round_trip_and_header() -> None:
    fmt = small_format()
    block_hash, data = block(fmt, 1)
    assert len(data) == fmt.block_bytes
    payload = fmt.decode(block_hash, data)
    assert bytes(payload) == data[HEADER.size:]
    header = parse_header(data)
    assert (header.fingerprint, header.dtype, header.block_size) == (FP, "float32", 4)


@pytest.mark.parametrize("kind", sorted(CORRUPTIONS))
def test_codec_rejects_every_corruption(kind: str) -> None:
    fmt = small_format()
    block_hash, data = block(fmt, 1)
    with pytest.raises(BlockFault) as info:
        fmt.decode(block_hash, CORRUPTIONS[kind](data))
    assert info.value.kind == kind


# -- disk tier -------------------------------------------------------------------------------


def test_disk_tier_survives_restart(tmp_path: Path) -> None:
    fmt = small_format()
    blocks = [block(fmt, i) for i in range(4)]
    tier = DiskTier(tmp_path, max_bytes=1 << 20)
    for h, data in blocks[:3]:
        assert tier.store(h, data)
    hashes = [h for h, _ in blocks]
    assert tier.lookup(hashes) == 3
    assert tier.load(hashes[:3]) == [d for _, d in blocks[:3]]
    (tmp_path / ".tmp-half-written").write_bytes(b"junk")
    again = DiskTier(tmp_path, max_bytes=1 << 20)  # a new process: index rebuilt from the dir
    assert len(again) == 3 and again.num_bytes == 3 * fmt.block_bytes
    assert again.lookup(hashes) == 3
    assert again.stats.misses == 1


def test_disk_tier_lru_never_exceeds_cap(tmp_path: Path) -> None:
    fmt = small_format()
    cap = 5 * fmt.block_bytes + 100
    tier = DiskTier(tmp_path, max_bytes=cap)
    blocks = [block(fmt, i) for i in range(20)]
    for h, data in blocks:
        assert tier.store(h, data)
        assert dir_bytes(tmp_path) <= cap
        tier.check_integrity()
        assert tier.load([blocks[0][0]]) == [blocks[0][1]]  # block 0 stays recently used
    held = [i for i, (h, _) in enumerate(blocks) if tier.lookup([h])]
    assert held == [0, 16, 17, 18, 19]
    # Restarted with a smaller cap: the least recently used files go at once.
    smaller = DiskTier(tmp_path, max_bytes=2 * fmt.block_bytes)
    smaller.check_integrity()
    assert dir_bytes(tmp_path) <= 2 * fmt.block_bytes
    assert smaller.lookup([blocks[0][0]]) == 1  # loaded last, so kept


def _enospc_open(monkeypatch: pytest.MonkeyPatch) -> None:
    """The disk tier's writes fail as on a full disk."""
    real_open = builtins.open

    class FullFile:
        def __init__(self, f: Any) -> None:
            self.f = f

        def __enter__(self) -> FullFile:
            return self

        def __exit__(self, *exc: object) -> None:
            self.f.close()

        def write(self, data: bytes) -> int:
            raise OSError(errno.ENOSPC, "No space left on device")

    def fake_open(path: Any, mode: str = "r", *args: Any, **kwargs: Any) -> Any:
        f = real_open(path, mode, *args, **kwargs)
        return FullFile(f) if "w" in mode else f

    monkeypatch.setattr(disk_module, "open", fake_open, raising=False)


def test_disk_full_is_a_counted_fault(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    fmt = small_format()
    tier = DiskTier(tmp_path, max_bytes=1 << 20)
    _enospc_open(monkeypatch)
    h, data = block(fmt, 1)
    assert tier.store(h, data) is False
    assert tier.stats.faults == {"disk_full": 1}
    assert os.listdir(tmp_path) == []  # no temp file left behind
    assert tier.lookup([h]) == 0


WRITER = """
import sys, time
import torch
from kvstack.kv.block_hash import hash_block
from kvstack.kv.tiers.codec import BlockFormat
from kvstack.kv.tiers.disk import DiskTier
writer, directory = int(sys.argv[1]), sys.argv[2]
fmt = BlockFormat("ab" * 32, "float32", 4, 2, 64, 16)
tier = DiskTier(directory, max_bytes=1 << 30)
deadline = time.monotonic() + 1.5
while time.monotonic() < deadline:
    for i in list(range(8)) + [100 * writer + j for j in range(4)]:
        h = hash_block(None, [i])
        payload = torch.full((fmt.payload_bytes // 4,), float(writer)).numpy().tobytes()
        tier._index.clear()  # write every time: the race is the point
        tier.store(h, fmt.encode(h, payload))
"""


def test_concurrent_writers_never_expose_half_written_blocks(tmp_path: Path) -> None:
    fmt = BlockFormat(FP, "float32", 4, 2, 64, 16)  # 64 KiB blocks: writes take a while
    env = {**os.environ, "PYTHONPATH": SRC}
    procs = [subprocess.Popen([sys.executable, "-c", WRITER, str(w), str(tmp_path)], env=env)
             for w in (1, 2)]
    stop = threading.Event()

    def thread_writer(writer: int) -> None:
        tier = DiskTier(tmp_path, max_bytes=1 << 30)
        payload = torch.full((fmt.payload_bytes // 4,), float(writer)).numpy().tobytes()
        while not stop.is_set():
            for i in range(8):
                h = hash_block(None, [i])
                tier._index.clear()
                tier.store(h, fmt.encode(h, payload))

    threads = [threading.Thread(target=thread_writer, args=(w,)) for w in (3, 4)]
    for t in threads:
        t.start()
    reader = DiskTier(tmp_path, max_bytes=1 << 30)
    hashes = [hash_block(None, [i]) for i in range(8)]
    num_read = 0
    deadline = time.monotonic() + 20
    while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
        for h in hashes:
            for data in reader.load([h]):
                payload = fmt.decode(h, data)  # raises BlockFault on a torn file
                values = set(torch.frombuffer(bytearray(payload), dtype=torch.float32).tolist())
                assert len(values) == 1 and values <= {1.0, 2.0, 3.0, 4.0}
                num_read += 1
    stop.set()
    for t in threads:
        t.join()
    assert all(p.wait(30) == 0 for p in procs)
    assert num_read > 0
    assert not [n for n in os.listdir(tmp_path) if n.startswith(".tmp-")]
    assert len(list(block_files(tmp_path))) == 8 + 2 * 4


# -- Redis tier ------------------------------------------------------------------------------


def test_redis_tier_store_load_ttl_and_key_prefix(redis_server: RedisServer) -> None:  # noqa: F811
    fmt = small_format()
    tier = RedisTier(redis_server.url, FP, ttl_s=60)
    blocks = [block(fmt, i) for i in range(4)]
    for h, data in blocks[:3]:
        assert tier.store(h, data)
    hashes = [h for h, _ in blocks]
    assert tier.lookup(hashes) == 3
    assert tier.load(hashes) == [d for _, d in blocks[:3]]
    keys = sorted(k.decode() for k in tier.client.keys("*"))
    assert keys == sorted(f"kvstack:kv1:{FP}:{h.hex()}" for h in hashes[:3])
    assert 0 < tier.client.ttl(keys[0]) <= 60
    assert RedisTier(redis_server.url, OTHER_FP).lookup(hashes) == 0  # another model's keys
    tier.close()


def test_redis_maxmemory_refusal_is_a_fault(tmp_path: Path) -> None:
    server = start_redis(tmp_path, maxmemory="3mb")
    try:
        fmt = BlockFormat(FP, "float32", 4, 2, 64, 16)  # 64 KiB blocks
        tier = RedisTier(server.url, FP)
        results = [tier.store(*block(fmt, i)) for i in range(80)]
        assert any(results) and not all(results)
        assert tier.stats.faults.get("oom", 0) == results.count(False)
        assert server.ping()
    finally:
        server.stop()


def _blackhole() -> socket.socket:
    """A port that accepts connections and never answers: a hung Redis."""
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen(16)
    return s


def test_redis_down_or_slow_is_a_miss(tmp_path: Path) -> None:
    fmt = small_format()
    h, data = block(fmt, 1)
    with socket.socket() as closed:
        closed.bind(("127.0.0.1", 0))
        down_url = f"redis://127.0.0.1:{closed.getsockname()[1]}/0"
    down = RedisTier(down_url, FP)
    assert down.lookup([h]) == 0 and down.load([h]) == [] and down.store(h, data) is False
    assert down.stats.faults["connection"] == 1
    assert down.stats.faults["unavailable"] == 2  # skipped, not retried, while marked down
    with _blackhole() as hole:
        slow = RedisTier(f"redis://127.0.0.1:{hole.getsockname()[1]}/0", FP, timeout_s=0.1)
        assert slow.lookup([h]) == 0 and slow.store(h, data) is False
        assert slow.stats.faults["timeout"] == 1


def test_redis_restart_loses_blocks_then_recovers(redis_server: RedisServer) -> None:  # noqa: F811
    fmt = small_format()
    clock = FakeClock()
    tier = RedisTier(redis_server.url, FP, retry_after_s=0.05, clock=clock)
    h, data = block(fmt, 1)
    assert tier.store(h, data) and tier.lookup([h]) == 1
    redis_server.restart()
    assert tier.lookup([h]) == 0  # a stale connection or an empty server: a miss either way
    clock.advance(0.1)
    assert tier.store(h, data) and tier.lookup([h]) == 1


# -- the chain -------------------------------------------------------------------------------


class MemoryTier(KVTier):
    """A dict, with stores that can be held up to fill the writer's queue."""

    def __init__(self, name: str) -> None:
        self.name = name
        super().__init__()
        self.blocks: dict[bytes, bytes] = {}
        self.gate = threading.Event()
        self.gate.set()

    def lookup(self, hashes: Any) -> int:
        n = 0
        while n < len(hashes) and hashes[n] in self.blocks:
            n += 1
        return n

    def load(self, hashes: Any) -> list[bytes]:
        return [self.blocks[h] for h in hashes[: self.lookup(hashes)]]

    def store(self, block_hash: bytes, data: bytes) -> bool:
        self.gate.wait()
        self.blocks[block_hash] = data
        self.stats.add(stores=1)
        return True

    def discard(self, block_hash: bytes) -> None:
        self.blocks.pop(block_hash, None)


def tiny_storage(num_blocks: int = 8) -> KVCacheStorage:
    model = ModelConfig("LlamaForCausalLM", vocab_size=32, hidden_size=8, intermediate_size=16,
                        num_layers=2, num_heads=1, num_kv_heads=1, head_dim=8, max_model_len=64)
    return KVCacheStorage(model, num_blocks, block_size=4, dtype=torch.float32)


def test_chain_restores_across_tiers_promotes_and_drops_when_full() -> None:
    storage = tiny_storage()
    for layer in range(2):
        storage.k[layer].normal_()
        storage.v[layer].normal_()
    fast, slow = MemoryTier("fast"), MemoryTier("slow")
    fmt = small_format()
    chain = TierChain([fast, slow], storage, fmt, queue_bytes=fmt.payload_bytes)
    hashes = [hash_block(None, [i]) for i in range(4)]
    chain.offload([(0, hashes[0]), (1, hashes[1])], wait=True)
    chain.flush()
    fast.blocks.pop(hashes[1])  # block 1 now only in the slow tier
    assert chain.lookup(hashes) == 2
    assert chain.restore(hashes[:2], [5, 6]) == 2
    for layer in range(2):
        assert torch.equal(storage.k[layer][20:28], storage.k[layer][0:8])
        assert torch.equal(storage.v[layer][20:28], storage.v[layer][0:8])
    chain.flush()
    assert hashes[1] in fast.blocks  # promoted from the slow tier
    # A full queue drops (and counts) instead of blocking the step thread.
    fast.gate.clear()
    chain.offload([(2, hashes[2])])  # taken by the writer, which now waits on the gate
    deadline = time.monotonic() + 5
    while chain._writer._jobs and time.monotonic() < deadline:
        time.sleep(0.01)
    chain.offload([(3, hashes[3]), (4, hash_block(None, [9]))])
    assert fast.stats.faults == {"queue_full": 1} and slow.stats.faults == {"queue_full": 1}
    fast.gate.set()
    chain.close()
    assert hashes[2] in slow.blocks and hashes[3] in slow.blocks


# -- the engine ------------------------------------------------------------------------------


def _doc_text() -> str:
    from pydoc_data.topics import topics

    return topics["assert"][:800]


QUESTION = "\n\nQuestion: what does assert do?\nAnswer:"
PARAMS = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
ENGINE = {"kv_cache_memory": "64MiB", "num_threads": 1}


@pytest.fixture(scope="module")
def cold() -> dict[str, Any]:
    """The document + question without any tier: the reference every tier run must match."""
    llm = LLM(**ENGINE)
    tokenizer = llm.get_tokenizer()
    doc_ids = tokenizer.encode(_doc_text())
    prompt = doc_ids + tokenizer.encode(QUESTION)
    out = llm.generate({"prompt_token_ids": prompt}, PARAMS)[0]
    assert out.num_cached_tokens == 0
    return {"doc_ids": doc_ids, "prompt": prompt, "token_ids": out.outputs[0].token_ids,
            "num_doc_blocks": len(doc_ids) // 16, "fingerprint": llm.engine.fingerprint,
            "doc_hashes": llm.engine.kv_manager.prefix_hashes(doc_ids, None)}


def _ask(llm: LLM, cold: dict[str, Any]) -> Any:
    out = llm.generate({"prompt_token_ids": cold["prompt"]}, PARAMS)[0]
    assert out.outputs[0].token_ids == cold["token_ids"]
    llm.engine.check_integrity()
    return out


@pytest.fixture(scope="module")
def warm_dir(tmp_path_factory: pytest.TempPathFactory, cold: dict[str, Any]) -> Path:
    directory = tmp_path_factory.mktemp("warm")
    with LLM(**ENGINE, kv_disk_dir=directory) as llm:
        assert llm.warm({"prompt_token_ids": cold["doc_ids"]}) == cold["num_doc_blocks"] * 16
    assert len(list(block_files(directory))) == cold["num_doc_blocks"]
    return directory


PROBE = """
import json, sys
import kvstack.engine.core as engine_module
from kvstack.engine.llm import LLM
from kvstack.sampling_params import SamplingParams
from kvstack.weights import load_checkpoint
checkpoint = load_checkpoint("smollm2-135m")
engine_module.load_checkpoint = lambda model: checkpoint
prompt, runs = json.loads(sys.argv[1])
params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
results = []
for tiers in runs:
    with LLM(kv_cache_memory="64MiB", num_threads=1, **tiers) as llm:
        out = llm.generate({"prompt_token_ids": prompt}, params)[0]
        stats = llm.stats()
        results.append({"token_ids": out.outputs[0].token_ids,
                        "num_cached_tokens": out.num_cached_tokens,
                        "tier_hit_tokens": stats.tier_hit_tokens,
                        "faults": [t.faults for t in stats.tiers]})
print(json.dumps(results))
"""


def test_cli_warm_then_fresh_processes_hit_disk_and_redis(
    tmp_path: Path, redis_server: RedisServer, cold: dict[str, Any],  # noqa: F811
    capsys: pytest.CaptureFixture[str],
) -> None:
    doc = tmp_path / "doc.txt"
    doc.write_text(_doc_text(), encoding="utf-8")
    disk = tmp_path / "kv"
    env = {**os.environ, "PYTHONPATH": SRC, "OMP_WAIT_POLICY": "PASSIVE"}
    warm = subprocess.run(
        [sys.executable, "-m", "kvstack", "cache", "warm", "--file", str(doc), "--kv-disk-dir",
         str(disk), "--kv-redis-url", redis_server.url, "--kv-cache-memory", "64MiB",
         "--threads", "1"], env=env, capture_output=True, text=True, timeout=300)
    assert warm.returncode == 0, warm.stderr
    num_tokens = cold["num_doc_blocks"] * 16
    assert f"warmed {num_tokens} of {len(cold['doc_ids'])} tokens" in warm.stdout

    runs = [{"kv_disk_dir": str(disk)}, {"kv_redis_url": redis_server.url}]
    probe = subprocess.run([sys.executable, "-c", PROBE, json.dumps([cold["prompt"], runs])],
                           env=env, capture_output=True, text=True, timeout=300)
    assert probe.returncode == 0, probe.stderr
    for result in json.loads(probe.stdout):
        assert result["token_ids"] == cold["token_ids"]
        assert result["num_cached_tokens"] == result["tier_hit_tokens"] == num_tokens
        assert result["faults"] == [{}]

    assert cli_main(["cache", "stats", "--kv-disk-dir", str(disk), "--kv-redis-url",
                     redis_server.url]) == 0
    stats = capsys.readouterr().out
    num_blocks = len(list(block_files(disk)))  # the document's, and the probes' own blocks
    assert num_blocks > cold["num_doc_blocks"]
    assert f"disk {disk}: {num_blocks} blocks" in stats
    assert f"redis {redis_server.url}: {num_blocks} blocks" in stats
    assert f"model {cold['fingerprint'][:12]}: {num_blocks} blocks" in stats
    assert cli_main(["cache", "ls", "--kv-disk-dir", str(disk)]) == 0
    assert len(capsys.readouterr().out.splitlines()) == num_blocks
    assert cli_main(["cache", "clear", "--kv-disk-dir", str(disk), "--kv-redis-url",
                     redis_server.url]) == 0
    assert not list(block_files(disk))
    assert RedisTier(redis_server.url, FP).client.keys("*") == []


def _payload_of(path: Path) -> bytes:
    return path.read_bytes()[HEADER.size:]


def _reformat(path: Path, fingerprint: str) -> None:
    h = parse_header(path.read_bytes())
    fmt = BlockFormat(fingerprint, h.dtype, h.num_layers, h.num_kv_heads, h.head_dim,
                      h.block_size)
    path.write_bytes(fmt.encode(h.block_hash, _payload_of(path)))


FILE_FAULTS: dict[str, Callable[[Path], None]] = {
    "truncated": lambda p: p.write_bytes(p.read_bytes()[:1000]),
    "checksum": lambda p: p.write_bytes(CORRUPTIONS["checksum"](p.read_bytes())),
    "fingerprint": lambda p: _reformat(p, OTHER_FP),
    "version": lambda p: p.write_bytes(_set_version(p.read_bytes())),
}


@pytest.mark.parametrize("kind", sorted(FILE_FAULTS))
def test_bad_block_file_is_a_miss(kind: str, warm_dir: Path, tmp_path: Path,
                                  cold: dict[str, Any]) -> None:
    directory = tmp_path / "kv"
    shutil.copytree(warm_dir, directory)
    bad_index = 3
    bad_hash = cold["doc_hashes"][bad_index]
    bad = directory / f"{bad_hash.hex()}.kvb"
    FILE_FAULTS[kind](bad)
    with LLM(**ENGINE, kv_disk_dir=directory) as llm:
        out = _ask(llm, cold)
        assert out.num_cached_tokens == bad_index * 16  # the run ends at the bad block
        assert llm.tier_stats()["disk"].faults == {kind: 1}
    # Dropped, then written again whole when the engine recomputed it.
    header = parse_header(bad.read_bytes())
    assert header.fingerprint == cold["fingerprint"] and header.version == 1
    assert len(bad.read_bytes()) == HEADER.size + header.payload_len


def test_disk_full_engine_output_unchanged(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                           cold: dict[str, Any]) -> None:
    _enospc_open(monkeypatch)
    with LLM(**ENGINE, kv_disk_dir=tmp_path) as llm:
        _ask(llm, cold)
        llm.engine.flush_tiers()
        stats = llm.tier_stats()["disk"]
    assert stats.faults["disk_full"] >= cold["num_doc_blocks"] and stats.stores == 0
    assert os.listdir(tmp_path) == []


def test_redis_down_slow_and_restarted_engine_output_unchanged(
    redis_server: RedisServer, cold: dict[str, Any],  # noqa: F811
) -> None:
    with socket.socket() as closed:
        closed.bind(("127.0.0.1", 0))
        down_url = f"redis://127.0.0.1:{closed.getsockname()[1]}/0"
    with LLM(**ENGINE, kv_redis_url=down_url) as llm:
        out = _ask(llm, cold)
        assert out.num_cached_tokens == 0
        assert llm.tier_stats()["redis"].faults.get("connection", 0) >= 1
    with _blackhole() as hole, LLM(**ENGINE,
                                   kv_redis_url=f"redis://127.0.0.1:{hole.getsockname()[1]}/0",
                                   ) as llm:
        _ask(llm, cold)
        assert llm.tier_stats()["redis"].faults.get("timeout", 0) >= 1

    clock = FakeClock()
    with LLM(**ENGINE, kv_redis_url=redis_server.url, clock=clock) as llm:
        tier = llm.engine.kv_tiers.tiers[0]
        tier.retry_after_s = 0.05
        assert llm.warm({"prompt_token_ids": cold["doc_ids"]}) == cold["num_doc_blocks"] * 16
        redis_server.restart()  # every block gone, every pooled connection dead
        llm.reset_prefix_cache()
        misses = tier.stats.misses
        assert _ask(llm, cold).num_cached_tokens == 0
        assert tier.stats.misses > misses
        clock.advance(0.1)
        # Recomputed blocks are written again once Redis is back.
        llm.reset_prefix_cache()
        _ask(llm, cold)
        llm.engine.flush_tiers()
        assert llm.engine.warm(cold["doc_ids"]) == cold["num_doc_blocks"] * 16
    with LLM(**ENGINE, kv_redis_url=redis_server.url) as llm:
        # The question's full blocks were written too, on the recompute.
        assert _ask(llm, cold).num_cached_tokens == (len(cold["prompt"]) - 1) // 16 * 16


def test_cache_cli_user_errors_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    doc = tmp_path / "doc.txt"
    doc.write_text("some text")
    assert cli_main(["cache", "warm", "--file", str(doc)]) == 2
    assert "--kv-disk-dir" in capsys.readouterr().err
    assert cli_main(["cache", "ls"]) == 2
    assert cli_main(["cache", "stats", "--kv-disk-dir", str(tmp_path / "missing")]) == 2
    assert "is not a directory" in capsys.readouterr().err


def test_tiers_need_prefix_caching(tmp_path: Path) -> None:
    with pytest.raises(kvstack.KvstackError, match="prefix caching"):
        LLM(**ENGINE, kv_disk_dir=tmp_path, enable_prefix_caching=False)
    with pytest.raises(kvstack.KvstackError, match="Redis URL"):
        LLM(**ENGINE, kv_redis_url="localhost:6379")


@pytest.fixture(autouse=True)
def _no_leaked_writers() -> Iterator[None]:
    before = _writer_threads()
    yield
    # Every engine above was closed: no tier writer thread outlives its test.
    assert _writer_threads() <= before


def _writer_threads() -> set[threading.Thread]:
    return {t for t in threading.enumerate() if t.name == "kvstack-kv-writer"}
