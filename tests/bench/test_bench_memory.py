"""`kvstack bench memory` (--quick, tiny model): the JSON it promises. No timing is asserted;
the byte counts are, since they are the engine's deterministic allocation."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from helpers.tiny_models import make_tiny_hf_folder

from kvstack.bench.memory import DECODE_CONTEXTS, KV_DTYPES
from kvstack.cli.main import main


@pytest.fixture(scope="module", autouse=True)
def _restore_torch_threads() -> Iterator[None]:
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def test_memory_case_counts_bytes_per_dtype_and_matches_the_estimate(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    model = make_tiny_hf_folder(tmp_path, "gqa")
    out = tmp_path / "results"
    code = main(["bench", "memory", "--quick", "--model", str(model), "--threads", "1",
                 "--out", str(out), "--no-progress"])
    assert code == 0
    data = json.loads((out / "memory.json").read_text())
    assert capsys.readouterr().out.splitlines()[-1] == data["summary"]
    assert data["summary"].startswith("memory: ")
    results, config = data["results"], data["config"]
    runs = results["kv_dtypes"]
    assert list(runs) == list(KV_DTYPES) == config["kv_dtypes"]
    for name, run in runs.items():
        assert run["allocated_bytes"] <= config["budget_bytes"]
        assert run["bytes_per_block"] == run["bytes_per_block_estimate"], name
        assert run["tokens_per_budget"] == run["tokens_per_budget_estimate"] > 0
        assert run["estimate_matches"] is True
        assert len(run["token_ids"]) == config["new_tokens"]
        curve = run["curve"]
        assert len(curve["tokens"]) == len(curve["measured"]) == config["new_tokens"] - 1
        assert curve["tokens"][0] == config["prompt_tokens"]
        assert curve["measured"] == curve["estimate"]
        assert run["rss_mib"] > 0
    assert runs["int8"]["tokens_vs_bfloat16"] >= 1.9
    assert runs["int8"]["tokens_vs_float32"] >= 3.8
    # The window run stops growing once the window is full.
    window = results["window"]["curve"]
    assert max(window["measured"]) <= window["estimate"][-1]
    assert window["measured"][-1] < runs["float32"]["curve"]["measured"][-1]
    assert results["estimate_matches"] is True and results["peak_rss_mib"] > 0
    decode = results["decode_tok_s_in_turns"]  # --quick: the first context length only
    assert list(decode) == [str(DECODE_CONTEXTS[0])]
    assert set(decode[str(DECODE_CONTEXTS[0])]) == {"float32", "int8"}
    assert [row["workload"].split(",")[0] for row in data["table"]][-1] == "decode tok/s"
    assert (out / data["plots"][0]).read_bytes().startswith(b"\x89PNG")
