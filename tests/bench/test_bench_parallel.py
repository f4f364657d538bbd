"""`kvstack bench parallel` and `kvstack bench structured` (--quick, embedded model): the JSON
they promise. No timing is asserted; block counts and token identity are, since they are the
engine's deterministic bookkeeping."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from kvstack.cli.main import main

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module", autouse=True)
def _restore_torch_threads() -> Iterator[None]:
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def run_case(case: str, out: Path, capsys: pytest.CaptureFixture[str]) -> dict:
    code = main(["bench", case, "--quick", "--threads", "1", "--out", str(out), "--no-progress"])
    assert code == 0
    data = json.loads((out / f"{case}.json").read_text())
    assert capsys.readouterr().out.splitlines()[-1] == data["summary"]
    assert data["summary"].startswith(f"{case}: ")
    assert (out / data["plots"][0]).read_bytes().startswith(b"\x89PNG")
    return data


def test_parallel_case_shares_the_prompt(tmp_path: Path,
                                         capsys: pytest.CaptureFixture[str]) -> None:
    data = run_case("parallel", tmp_path, capsys)
    config, results = data["config"], data["results"]
    shared, separate = results["shared"], results["separate"]
    n, prompt, bs = config["samples"], config["prompt_tokens"], config["block_size"]
    assert results["identical_samples"] == n
    assert shared["prompt_tokens_computed"] == prompt
    assert separate["prompt_tokens_computed"] == n * prompt
    own = -(-(prompt + config["new_tokens"]) // bs) - prompt // bs  # each sample's own blocks
    assert shared["peak_blocks"] == prompt // bs + n * own
    assert separate["peak_blocks"] == n * -(-(prompt + config["new_tokens"]) // bs)
    assert shared["copied_blocks"] == (n - 1 if prompt % bs else 0)
    assert results["kv_bytes_ratio"] < 1
    assert [row["workload"].split(",")[0] for row in data["table"]] == ["peak KV bytes",
                                                                       "wall time"]


def test_structured_case_times_every_mode_at_every_batch(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    data = run_case("structured", tmp_path, capsys)
    config, results = data["config"], data["results"]
    for mode in ("free", "constrained", "inline"):
        assert [b for b, v in results["tpot_ms"][mode].items() if v and v > 0] == \
            [str(b) for b in config["batches"]]
    assert set(results["constrained_overhead"]) == {str(b) for b in config["batches"]}
    assert len(data["table"]) == len(config["batches"])
