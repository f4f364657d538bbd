"""Recurrent-state snapshots in the disk tier (a tiny random Qwen3.5): a fresh engine on the
same directory hits blocks and the snapshot at their end, and decodes exactly what a cold
engine decodes; a damaged snapshot file is a counted miss."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from helpers.redis_server import redis_server  # noqa: F401 (a fixture)
from helpers.tiny_qwen3_5 import make_tiny_qwen3_5_folder

from kvstack import LLM, SamplingParams
from kvstack.kv.tiers.codec import HEADER
from kvstack.kv.tiers.disk import SUFFIX
from kvstack.recurrent.codec import SnapshotFormat, parse_snapshot_header, snapshot_key
from kvstack.recurrent.store import StateStore

pytestmark = pytest.mark.usefixtures("one_torch_thread")
BS = 4
GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_qwen3_5_folder(tmp_path_factory.mktemp("tiny-qwen3_5"))


def tiny_llm(folder: Path, **kwargs: Any) -> LLM:
    kwargs = {"kv_cache_memory": "8MiB", "block_size": BS, "max_num_seqs": 4} | kwargs
    return LLM(model=str(folder), skip_tokenizer_init=True, **kwargs)


def tokens(n: int, seed: int) -> list[int]:
    return torch.randint(3, 256, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def run(llm: LLM, prompt: list[int]) -> tuple[list[int], int]:
    [out] = llm.generate([{"prompt_token_ids": prompt}], GREEDY)
    return list(out.outputs[0].token_ids), out.num_cached_tokens


def store(llm: LLM) -> StateStore:
    s = llm.engine.hooks.features["recurrent"]
    assert isinstance(s, StateStore)
    return s


def snapshot_files(directory: Path) -> list[Path]:
    found = []
    for path in directory.glob(f"*{SUFFIX}"):
        with open(path, "rb") as f:
            if f.read(8) == b"KVSTSNP\0":
                found.append(path)
    return found


def test_fresh_engine_resumes_from_a_disk_snapshot(folder: Path, tmp_path: Path,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    base, more = tokens(30, 1), tokens(9, 2)
    want, _ = run(tiny_llm(folder, enable_prefix_caching=False), base + more)
    first = tiny_llm(folder, kv_disk_dir=str(tmp_path), state_snapshot_every=1000)
    run(first, base)
    first.close()  # flushes the writes
    # the prompt-end snapshot (block 7) and the sequence-end one went beside their blocks
    files = snapshot_files(tmp_path)
    assert len(files) == 2 == store(first).tiers.num_stored  # type: ignore[union-attr]
    with tiny_llm(folder, kv_disk_dir=str(tmp_path), state_snapshot_every=1000) as fresh:
        out, cached = run(fresh, base + more)
    assert cached == 28  # 7 blocks from the disk tier, the state at their end with them
    assert out == want
    assert store(fresh).tiers.num_restored == 1  # type: ignore[union-attr]
    header = parse_snapshot_header(files[0].read_bytes()[:HEADER.size])
    fmt = SnapshotFormat(fresh.engine.info.fingerprint, fresh.engine.model.new_states())
    assert header.fingerprint == fmt.fingerprint
    assert (tmp_path / f"{snapshot_key(header.block_hash).hex()}{SUFFIX}") in files
    from kvstack.cli.main import main

    capsys.readouterr()
    assert main(["cache", "ls", "--kv-disk-dir", str(tmp_path)]) == 0
    # the fresh engine's own (its prompt end, its sequence end) were written beside them
    listed = capsys.readouterr().out.count("state snapshot (float32 linear layers=6")
    assert listed == len(snapshot_files(tmp_path)) == 4


def test_damaged_disk_snapshot_is_a_counted_miss(folder: Path, tmp_path: Path) -> None:
    base, more = tokens(30, 3), tokens(5, 4)
    want, _ = run(tiny_llm(folder, enable_prefix_caching=False), base + more)
    first = tiny_llm(folder, kv_disk_dir=str(tmp_path), state_snapshot_every=1000)
    run(first, base)
    first.close()
    for path in snapshot_files(tmp_path):
        data = bytearray(path.read_bytes())
        data[-3] ^= 0xFF  # a flipped payload byte: the CRC32 fails
        path.write_bytes(bytes(data))
    with tiny_llm(folder, kv_disk_dir=str(tmp_path), state_snapshot_every=1000) as fresh:
        out, cached = run(fresh, base + more)
    assert cached == 0 and out == want  # blocks restored, but no sound state at their end
    assert fresh.engine.tier_stats()["disk"].faults.get("checksum", 0) >= 1
    assert store(fresh).tiers.num_faults >= 1  # type: ignore[union-attr]


def test_fresh_engine_resumes_from_a_redis_snapshot(folder: Path, redis_server: Any) -> None:  # noqa: F811
    base, more = tokens(30, 7), tokens(9, 8)
    want, _ = run(tiny_llm(folder, enable_prefix_caching=False), base + more)
    with tiny_llm(folder, kv_redis_url=redis_server.url, state_snapshot_every=1000) as first:
        run(first, base)
    with tiny_llm(folder, kv_redis_url=redis_server.url, state_snapshot_every=1000) as fresh:
        out, cached = run(fresh, base + more)
        assert store(fresh).tiers.num_restored == 1  # type: ignore[union-attr]
    assert cached == 28 and out == want
