"""`bench serve_loop`: the engine's own steps and a live `kvstack serve` stream the same
prompts; the case reports both sides' figures and that their greedy texts agree."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import EMBEDDED, cached_checkpoint

from kvstack.bench import common, serve_loop
from kvstack.bench.serve_loop import ROUNDS
from kvstack.cli.main import main


@pytest.mark.slow
def test_serve_loop_reports_engine_and_serve_figures_side_by_side(
        capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch,
        tmp_path: Path) -> None:
    monkeypatch.setattr(common, "load_checkpoint", cached_checkpoint)
    code = main(["bench", "serve_loop", "--quick", "--model", EMBEDDED, "--threads", "1",
                 "--out", str(tmp_path), "--no-progress"])
    assert code == 0
    lines = capsys.readouterr().out.splitlines()
    data = json.loads((tmp_path / "serve_loop.json").read_text())
    size = serve_loop.sizes(quick=True)
    config, rows = data["config"], data["results"]["batches"]
    assert config["weights"] == "gguf"  # the embedded model is a GGUF file: run as bench load
    assert [r["batch"] for r in rows] == list(size.batches)
    for row in rows:
        b, measured = row["batch"], ROUNDS - 1
        # Greedy through the HTTP stream is the engine's own answer, request by request, where
        # both run the same steps (larger batches may mix a decode with a prefill).
        assert row["same_text"] is True or b > 1
        # Each measured request decodes max_tokens - 1 steps after its first token; with all
        # b added together every one of them is a decode-only step of the whole batch.
        assert row["engine"]["num_steps"] == measured * (size.max_tokens - 1)
        assert 0 < row["serve"]["num_gaps"] <= measured * b * (size.max_tokens - 1)
        assert row["serve"]["tokens_per_event"] >= 1
        for side, keys in (("engine", ("step_p50_ms", "step_p95_ms")),
                           ("serve", ("itl_p50_ms", "itl_p95_ms", "itl_mean_ms", "tpot_mean_ms"))):
            for key in keys:
                assert row[side][key] > 0, key
            assert len(row[side]["load_average"]) == 2
        assert row["ratio_p50"] == pytest.approx(row["serve"]["itl_p50_ms"]
                                                 / row["engine"]["step_p50_ms"])
    assert lines == [r["summary"] for r in rows] + [data["summary"]]
    assert data["summary"].startswith("serve_loop: ") and "same text at batch 1: yes" in \
        data["summary"]
