"""`kvstack bench`: every case runs (--quick, tiny model) and writes the JSON it promises.

Timings are never asserted (they depend on the machine); shapes, counts, token agreement and
the engine's deterministic behaviour (cached tokens, preemptions, completion) are.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import EMBEDDED, cached_checkpoint
from helpers.tiny_models import make_tiny_hf_folder

from kvstack.bench import cache, common
from kvstack.bench import cli as bench_cli
from kvstack.bench.common import BenchOptions, Subject, distinct_prompts
from kvstack.bench.pressure import constrained_blocks
from kvstack.cli.main import main

CASES = ("cache", "throughput", "prefix", "pressure")


@pytest.fixture(scope="module", autouse=True)
def _restore_torch_threads() -> Iterator[None]:
    # `--threads` sets torch's process-wide thread count; later test modules get theirs back.
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> str:
    # No tokenizer: prompts become byte ids, which exercises the token-id path of every case.
    return str(make_tiny_hf_folder(tmp_path_factory.mktemp("bench"), "gqa"))


def bench(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, list[str], str]:
    code = main(["bench", *argv])
    captured = capsys.readouterr()
    return code, captured.out.splitlines(), captured.err


def positive(value: Any) -> bool:
    return isinstance(value, (int, float)) and value > 0


@pytest.fixture(scope="module")
def all_results(tiny_model: str, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    out = tmp_path_factory.mktemp("results")
    with pytest.MonkeyPatch.context() as patch:
        # `all` runs whatever cases are registered; this module covers these four.
        patch.setattr(bench_cli, "CASES", {case: bench_cli.CASES[case] for case in CASES})
        code = main(["bench", "all", "--quick", "--model", tiny_model, "--threads", "1",
                     "--out", str(out), "--no-progress"])
    assert code == 0
    return {case: json.loads((out / f"{case}.json").read_text()) for case in CASES} | {
        "_out": out}


def test_all_writes_one_json_per_case_with_plots(all_results: dict[str, Any]) -> None:
    out: Path = all_results["_out"]
    for case in CASES:
        data = all_results[case]
        assert data["case"] == case
        assert data["summary"].startswith(f"{case}: ")
        assert "\n" not in data["summary"]
        assert {"cpu", "logical_cpus", "threads", "torch", "transformers"} <= set(data["machine"])
        assert data["machine"]["threads"] == 1
        assert data["config"]["quick"] is True
        assert data["plots"]
        for plot in data["plots"]:
            assert (out / plot).read_bytes().startswith(b"\x89PNG")


def test_cache_case_times_four_runs_and_compares(all_results: dict[str, Any]) -> None:
    data = all_results["cache"]
    n = data["config"]["new_tokens"]
    results = data["results"]
    for side in ("ours", "transformers"):
        for mode in ("kv_cache", "no_kv_cache"):
            run = results[side][mode]
            assert run["num_new_tokens"] == len(run["token_ids"]) == n
            assert positive(run["decode_tok_s"]) and positive(run["ttft_s"])
            assert len(run["inter_token_latencies_ms"]) == len(run["context_tokens"]) == n - 1
            assert run["context_tokens"][0] == data["config"]["prompt_tokens"] + 1
    assert all(positive(v) for v in results["ratios"].values())
    # The same greedy model with or without a cache, in either engine, picks the same tokens.
    assert results["matching_tokens"] == {"ours_kv_cache_vs_no_kv_cache": n,
                                          "ours_vs_transformers": n}


def test_throughput_case_has_a_row_per_concurrency(all_results: dict[str, Any]) -> None:
    data = all_results["throughput"]
    rows = data["results"]["levels"]
    assert [r["concurrency"] for r in rows] == data["config"]["concurrency"]
    for r in rows:
        assert r["ours"]["all_complete"] is True
        assert r["ours"]["output_tokens"] == r["concurrency"] * data["config"]["new_tokens"]
        assert positive(r["ours"]["output_tok_s"])
        assert positive(r["transformers"]["output_tok_s"])
        assert positive(r["ours_over_transformers"])
        assert 0 <= r["identical_outputs"] <= r["concurrency"]


def test_prefix_case_reuses_the_document(all_results: dict[str, Any]) -> None:
    data = all_results["prefix"]
    doc = data["config"]["document_tokens"]
    for row in data["results"]["questions"]:
        ours = row["ours"]
        assert ours["cold_num_cached_tokens"] == 0
        assert ours["warm_num_cached_tokens"] >= doc // 16 * 16
        assert ours["warm_equals_cold"] is True
        assert positive(ours["speedup"]) and positive(row["transformers"]["speedup"])
    assert positive(data["results"]["aggregate"]["warm_ttft_transformers_over_ours"])


def test_pressure_case_preempts_and_finishes_every_request(all_results: dict[str, Any]) -> None:
    data = all_results["pressure"]
    n = data["config"]["num_requests"]
    r = data["results"]
    assert r["constrained"]["num_blocks"] == data["config"]["constrained_blocks"]
    assert r["constrained"]["num_blocks"] < r["unconstrained"]["num_blocks"]
    assert r["constrained"]["num_preemptions"] >= 1
    assert r["unconstrained"]["num_preemptions"] == 0
    for run in (r["constrained"], r["unconstrained"]):
        assert run["num_complete"] == n and run["num_failed"] == 0
    assert positive(r["throughput_ratio"])
    assert isinstance(r["all_identical"], bool)


def test_one_case_alone_and_peer_max_batch(
    capsys: pytest.CaptureFixture[str], tiny_model: str, tmp_path: Path
) -> None:
    code, lines, _ = bench(capsys, "throughput", "--quick", "--model", tiny_model, "--threads",
                           "1", "--out", str(tmp_path), "--no-progress", "--peer-max-batch", "1")
    assert code == 0
    assert len(lines) == 1 and lines[0].startswith("throughput: ")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["throughput.json", "throughput.png"]
    rows = json.loads((tmp_path / "throughput.json").read_text())["results"]["levels"]
    assert "transformers" in rows[0] and positive(rows[0]["ours_over_transformers"])
    assert "transformers" not in rows[1] and rows[1]["ours_over_transformers"] is None


@pytest.mark.parametrize(
    ("argv", "mentions"),
    [
        ([], "CASE"),
        (["nope"], "invalid choice"),
        (["throughput", "--peer-max-batch", "0"], "--peer-max-batch"),
        (["cache", "--peer-max-batch", "2"], "unrecognized"),
        (["cache", "--model", "no-such-model"], "no-such-model"),
    ],
)
def test_user_errors_are_one_line_and_exit_2(
    capsys: pytest.CaptureFixture[str], argv: list[str], mentions: str
) -> None:
    code, lines, err = bench(capsys, *argv)
    assert code == 2
    assert lines == []
    assert err.count("\n") == 1 and mentions in err


def test_full_size_case_on_a_short_context_model_says_use_quick(
    capsys: pytest.CaptureFixture[str], tiny_model: str, tmp_path: Path
) -> None:
    # The tiny model has 128 positions; the full prefix case needs ~2,000.
    code, lines, err = bench(capsys, "prefix", "--model", tiny_model, "--out", str(tmp_path))
    assert code == 2 and lines == []
    assert "--quick" in err and err.count("\n") == 1
    assert not tmp_path.exists() or not any(tmp_path.iterdir())


class _ByteEncoder:
    def encode(self, text: str) -> list[int]:
        return list(text.encode())


def test_distinct_prompts_never_share_a_first_block() -> None:
    prompts = distinct_prompts(_ByteEncoder(), 64, 128)  # type: ignore[arg-type]
    assert len({tuple(p[:16]) for p in prompts}) == 64
    assert all(124 <= len(p) <= 132 for p in prompts)


def test_pressure_budget_is_a_third_but_fits_the_largest_request() -> None:
    # 6 requests of 20+12 tokens = 2 blocks of 16 each: 12 needed, 4 in the pool.
    assert constrained_blocks([20] * 6, 12, 16) == (12, 4)
    # One request alone needs 5 blocks; a third of 7 would not hold it.
    assert constrained_blocks([60, 4], 12, 16) == (6, 5)


@pytest.mark.slow
def test_cache_prompt_is_the_46_token_chat_prompt(monkeypatch: pytest.MonkeyPatch,
                                                  tmp_path: Path) -> None:
    monkeypatch.setattr(common, "load_checkpoint", cached_checkpoint)
    subject = Subject(BenchOptions(model=EMBEDDED, threads=1, out=tmp_path))
    prompt = subject.chat_prompt(cache.QUESTION)
    assert len(prompt) == 46
    assert subject.tokenizer.decode(prompt).rstrip().endswith("assistant")


@pytest.mark.slow
def test_serve_case_loads_a_live_server_over_http(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setattr(common, "load_checkpoint", cached_checkpoint)
    code, lines, _ = bench(capsys, "serve", "--quick", "--model", EMBEDDED, "--threads", "1",
                           "--out", str(tmp_path), "--no-progress")
    assert code == 0
    data = json.loads((tmp_path / "serve.json").read_text())
    config, rows = data["config"], data["results"]["levels"]
    assert config["levels"] == [1, 2] and config["max_tokens"] == 4
    assert [r["concurrency"] for r in rows] == config["levels"]
    for row, num in zip(rows, config["requests_per_level"], strict=True):
        for variant in ("no_system_prompt", "shared_system_prompt"):
            run = row[variant]
            assert run["num_requests"] == run["num_complete"] == num
            for key in ("requests_per_s", "output_tok_s", "ttft_p50_s", "ttft_p99_s",
                        "tpot_p50_s", "tpot_p99_s", "mean_prompt_tokens"):
                assert positive(run[key]), key
            assert run["ttft_p50_s"] <= run["ttft_p99_s"]
        # A warm-up request cached the system prompt: every measured request reuses its blocks.
        shared = row["shared_system_prompt"]
        assert shared["mean_cached_tokens"] >= config["shared_prefix_tokens"] // 16 * 16 > 0
        assert shared["mean_cached_tokens"] > row["no_system_prompt"]["mean_cached_tokens"]
    # One line per level and variant, then the case's summary.
    assert len(lines) == 2 * len(rows) + 1
    assert all(line.startswith("serve: ") for line in lines)
    assert lines[-1] == data["summary"]
    assert data["results"]["overall"]["num_complete"] == 2 * sum(config["requests_per_level"])
    assert (tmp_path / data["plots"][0]).read_bytes().startswith(b"\x89PNG")
