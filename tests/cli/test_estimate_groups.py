"""`kvstack estimate` on a model with sliding-window layers: the hybrid layout's pages per
KV group, as the engine allocates them, and the saving over keeping every layer. The 270M's
config is built here (loading the file takes a minute); `tests/models/test_gemma3_270m.py`
checks it."""

from __future__ import annotations

import re
from types import SimpleNamespace

import pytest

from kvstack.cli import estimate
from kvstack.cli.main import main
from kvstack.models.gemma3_config import FULL, SLIDING, Gemma3Config

GEMMA3_270M = Gemma3Config(
    architecture="Gemma3ForCausalLM", vocab_size=262144, hidden_size=640,
    intermediate_size=2048, num_layers=18, num_heads=4, num_kv_heads=1, head_dim=256,
    max_model_len=32768, layer_types=tuple(FULL if (i + 1) % 6 == 0 else SLIDING
                                           for i in range(18)),
    sliding_window=512,
)


def test_estimate_shows_bytes_per_group_and_the_hybrid_saving(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(estimate, "_load_checkpoint", lambda _: SimpleNamespace(
        config=GEMMA3_270M))
    assert main(["estimate", "--model", "gemma3-270m", "--seq-len", "8192"]) == 0
    out = capsys.readouterr().out
    # 1 KV head x 256 x K,V x 4 B = 2 KiB per layer and token; 18 layers. Pages of 3 layers:
    # 1 full group keeps 512 blocks, 5 window groups 33 each (32 of window + the query's own).
    assert re.search(r"per token\s+36 KiB", out)
    assert re.search(r"per block\s+96 KiB .*16 tokens of a page's 3 layers", out)
    assert re.search(r"8192 tokens x 1 seqs\s+63.47 MiB", out)
    assert re.search(r"group full\s+3 layers in 1 group.*: 512 blocks/group/seq.*, 48 MiB", out)
    assert re.search(r"group sliding 512\s+15 layers in 5 group.*: 33 blocks/group/seq.*15.47 MiB",
                     out)
    assert re.search(r"hybrid saving\s+677 pages/seq held vs 3072 .*63.47 MiB vs 288 MiB, "
                     r"4.5x less", out)
