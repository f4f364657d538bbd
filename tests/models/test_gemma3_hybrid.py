"""Gemma 3's hybrid KV cache in the engine: at 8,192 tokens a sequence holds the pages
`kvstack estimate` counts, ~4.5x fewer than every layer keeping every token (a pool that could
not hold the all-global layout serves it), and window groups' blocks travel through a disk
tier to a fresh engine, which restores the last window before its hit and generates exactly
what transformers does."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from helpers.tiny_gemma3 import make_tiny_gemma3_folder
from transformers import AutoModelForCausalLM

from kvstack import LLM, SamplingParams
from kvstack.cli.main import main

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def long_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_gemma3_folder(tmp_path_factory.mktemp("tiny-gemma3-long"), "long")


@pytest.fixture(scope="module")
def mqa_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_gemma3_folder(tmp_path_factory.mktemp("tiny-gemma3-mqa"), "mqa")


def test_8192_tokens_hold_the_estimated_pages_4x_fewer_than_all_global(
    long_folder: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # Pages of 3 layers x 1 KV head x 32 x K,V x 4 B x 16 tokens = 12 KiB; 16 MiB = 1,365
    # pages, fewer than the 3,072 an all-global layout needs for 8,192 tokens.
    llm = LLM(model=str(long_folder), skip_tokenizer_init=True, kv_cache_memory="16MiB",
              block_size=16)
    engine = llm.engine
    info = llm.info
    assert info.kv_shape is not None and engine.kv_manager is not None
    assert engine.kv_manager.num_blocks == 1365
    shape = info.kv_shape
    assert shape.blocks_for(8192) == 512 + 5 * 33 and 6 * 512 / shape.blocks_for(8192) > 4.5
    prompt = torch.randint(3, 256, (8176,), generator=torch.Generator().manual_seed(3)).tolist()
    engine.add_request(prompt, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True),
                       request_id="long")
    held: list[tuple[int, int]] = []  # (tokens computed, pages in use) after each step
    while engine.has_unfinished():
        engine.step()
        request = engine.scheduler.running[0] if engine.scheduler.running else None
        if request is not None:
            held.append((request.num_computed_tokens, engine.stats().num_blocks_used))
        engine.check_integrity()
    decoding = [(n, used) for n, used in held if n >= 8176]
    assert len(decoding) >= 30
    assert all(used <= shape.blocks_for(n) for n, used in decoding)
    assert any(n >= 8192 and used == shape.blocks_for(n) for n, used in decoding)
    assert engine.stats().num_blocks_used == 0
    # `kvstack estimate` on the same folder says what the engine held.
    assert main(["estimate", "--model", str(long_folder), "--seq-len", "8192"]) == 0
    out = capsys.readouterr().out
    assert re.search(r"hybrid saving\s+677 pages/seq held vs 3072 .* 4.5x less", out)


def test_window_blocks_restore_from_a_disk_tier_in_a_fresh_engine(
    mqa_folder: Path, tmp_path: Path
) -> None:
    """Engine A computes a prompt (blocks of every group written through to disk); engine B,
    with an empty memory cache, restores a 32-token prefix: the full group's 8 blocks and each
    window group's last window before the hit, and decodes as transformers does."""
    g = torch.Generator().manual_seed(5)
    prompt = torch.randint(3, 256, (36,), generator=g).tolist()
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    options = {"skip_tokenizer_init": True, "kv_cache_memory": "4MiB", "block_size": 4,
               "kv_disk_dir": str(tmp_path)}
    with LLM(model=str(mqa_folder), **options) as first:
        first.generate({"prompt_token_ids": prompt}, params)
        first.engine.flush_tiers()
    longer = prompt + torch.randint(3, 256, (5,), generator=g).tolist()
    with LLM(model=str(mqa_folder), **options) as second:
        out = second.generate({"prompt_token_ids": longer}, params)[0]
        second.engine.check_integrity()
        assert out.num_cached_tokens == 36
        assert second.stats().tier_hit_tokens == 36
    hf = AutoModelForCausalLM.from_pretrained(mqa_folder, dtype=torch.float32).eval()
    hf.generation_config.eos_token_id = None
    want = hf.generate(torch.tensor([longer]), max_new_tokens=16, do_sample=False,
                       pad_token_id=0)[0, len(longer):].tolist()
    assert out.outputs[0].token_ids == want
