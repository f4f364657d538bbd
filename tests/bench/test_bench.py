"""`kvstack bench`: every case runs (--quick, tiny model) and writes the JSON it promises.

Timings are never asserted (they depend on the machine); shapes, counts, token agreement and
the engine's deterministic behaviour (cached tokens, preemptions, completion) are.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import EMBEDDED, cached_checkpoint
from helpers.tiny_models import make_tiny_hf_folder

from kvstack.bench import common, report
from kvstack.bench.common import BenchOptions, Subject, distinct_prompts
from kvstack.bench.peers import case as peers_case
from kvstack.bench.pressure import constrained_blocks
from kvstack.cli import bench as bench_cli
from kvstack.cli.main import main
from kvstack.errors import UnsupportedModelError

CASES = ("cache", "throughput", "prefix", "pressure", "ttft", "peers")


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
        # `all` runs whatever cases are registered; this module covers these.
        patch.setattr(bench_cli, "CASES", {case: bench_cli.CASES[case] for case in CASES})
        patch.setattr(bench_cli, "ALL_CASES", list(CASES))
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
        # Rows for the README's table: display text, a workload and our figure at least.
        assert data["table"]
        for row in data["table"]:
            assert set(row) == {"workload", "kvstack", "peer", "speedup"}
            assert row["workload"] and row["kvstack"]
    assert all_results["cache"]["plots"] == ["cache_latency.png", "cache_total_time.png"]


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


def test_ttft_case_has_cold_and_hit_per_length(all_results: dict[str, Any]) -> None:
    data = all_results["ttft"]
    rows = data["results"]["lengths"]
    assert [r["target_tokens"] for r in rows] == data["config"]["prompt_tokens"]
    assert data["plots"] == ["ttft.png"]
    for r in rows:
        assert r["prompt_tokens"] == r["target_tokens"]
        ours, theirs = r["ours"], r["transformers"]
        for side in (ours, theirs):
            assert positive(side["cold_ttft_s"]) and positive(side["hit_ttft_s"])
            assert positive(side["cold_prefill_tok_s"])
        assert ours["cold_num_cached_tokens"] == 0
        # The document's full blocks, and no more: the question is never cached.
        assert ours["hit_num_cached_tokens"] == r["document_tokens"] // 16 * 16 > 0
        assert ours["hit_equals_cold"] is True
        assert positive(r["cold_speedup_over_transformers"])
        assert positive(r["hit_speedup_over_transformers"])
    assert len(data["table"]) == len(rows)


def test_peers_case_runs_every_engine_and_reports_ratios(all_results: dict[str, Any]) -> None:
    data = all_results["peers"]
    results, config = data["results"], data["config"]
    engines = results["engines"]
    assert list(engines) == ["kvstack_float32", "kvstack_bfloat16", "kvstack_int8",
                             "kvstack_gguf", "transformers", "llamacpp"]
    # The tiny model is a safetensors folder: llama.cpp and our gguf format (GGUF only) never
    # run on it.
    assert engines["llamacpp"]["skipped"]
    assert "not a GGUF file" in engines["kvstack_gguf"]["skipped"]
    assert "llama.cpp: skipped" in data["summary"]
    ran = {k: e for k, e in engines.items() if "skipped" not in e}
    assert {"kvstack_float32", "kvstack_bfloat16", "transformers"} <= set(ran)
    bandwidth = results["machine_read_bandwidth_bytes_per_s"]
    assert positive(bandwidth)
    for name, e in ran.items():
        d = e["decode"]
        assert d["num_new_tokens"] == len(d["token_ids"]) == config["decode"]["new_tokens"]
        assert positive(d["decode_tok_s"]) and positive(e["prefill"]["prefill_tok_s"])
        assert positive(e["batch"]["output_tok_s"])
        assert e["batch"]["output_tokens"] == (config["batch"]["num_prompts"]
                                               * config["batch"]["new_tokens"])
        assert d["bytes_per_step"] > e["weight_bytes"] > 0, name
        assert d["bandwidth_bytes_per_s"] == pytest.approx(d["bytes_per_step"]
                                                           * d["decode_tok_s"])
        assert d["bandwidth_fraction"] == pytest.approx(d["bandwidth_bytes_per_s"] / bandwidth)
        # Decode after the long prompt: more KV read per step than after the chat prompt.
        for workload, want in config["long_decode"].items():
            long = e[workload]
            assert long["num_new_tokens"] == len(long["token_ids"]) == want["new_tokens"]
            chat = config["decode"]["prompt_tokens"]
            assert long["mean_context_tokens"] > want["prompt_tokens"] > chat
            assert long["bytes_per_step"] > d["bytes_per_step"], name
            assert long["bandwidth_fraction"] == pytest.approx(
                long["bytes_per_step"] * long["decode_tok_s"] / bandwidth)
    assert list(config["long_decode"]) == ["decode_80"]
    assert "decode after 80 tokens" in data["summary"]
    # Same float32 weights and greedy decoding: transformers picks our tokens.
    n = config["decode"]["new_tokens"]
    assert results["token_reference"] == "kvstack_float32"
    assert ran["transformers"]["decode"]["matching_tokens_vs_reference"] == n
    # bfloat16 holds half the bytes of float32 per weight.
    assert ran["kvstack_bfloat16"]["weight_bytes"] * 2 == ran["kvstack_float32"]["weight_bytes"]
    for ours in (k for k in ran if k.startswith("kvstack_")):
        r = results["ratios"][ours]
        for workload in ("decode", "decode_80", "prefill", "batch"):
            assert positive(r[f"{workload}_over_transformers"])
            assert r[f"{workload}_over_llamacpp"] is None
    assert data["plots"] == ["peers.png"]


def test_peers_formats_follow_the_options(monkeypatch: pytest.MonkeyPatch,
                                          tmp_path: Path) -> None:
    one = BenchOptions(model="m", threads=1, out=tmp_path, dtype="bfloat16")
    assert peers_case.engine_formats(one) == {"bfloat16": {}}
    monkeypatch.setattr(peers_case, "supports_quantization", lambda: False)
    formats = peers_case.engine_formats(BenchOptions(model="m", threads=1, out=tmp_path))
    assert formats["float32"] == {"dtype": "float32"}
    assert "no `quantization`" in formats["int8"]
    assert "not a GGUF file" in formats["gguf"]
    gguf = peers_case.engine_formats(BenchOptions(model="smollm2-135m", threads=1, out=tmp_path))
    assert gguf["gguf"] == {"quantization": "gguf"}


def test_a_format_the_model_refuses_is_skipped_with_its_reason(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A format the model refuses (e.g. quantization="gguf"): that row is skipped, the rest
    still run."""
    def refuse(subject: Any, work: Any, kwargs: dict[str, str]) -> Any:
        if kwargs.get("quantization") == "gguf":
            raise UnsupportedModelError("this file cannot run as blocks")
        return FakeRunner()

    class FakeRunner:
        info = {"loaded": True}

    monkeypatch.setattr(peers_case, "OursRunner", refuse)
    monkeypatch.setattr(peers_case, "TransformersRunner", lambda subject: FakeRunner())
    options = BenchOptions(model="m.gguf", threads=1, out=Path("unused"))
    runners, engines = peers_case._load_engines(
        None, options, None, {"float32": {"dtype": "float32"}, "gguf": {"quantization": "gguf"}})
    assert engines["kvstack_gguf"] == {"skipped": "this file cannot run as blocks"}
    assert engines["kvstack_float32"] == {"loaded": True} and "kvstack_gguf" not in runners


def test_dtype_option_reaches_our_engine(
    capsys: pytest.CaptureFixture[str], tiny_model: str, tmp_path: Path
) -> None:
    code, lines, _ = bench(capsys, "ttft", "--quick", "--model", tiny_model, "--threads", "1",
                           "--out", str(tmp_path), "--no-progress", "--dtype", "bfloat16")
    assert code == 0 and len(lines) == 1 and lines[0].startswith("ttft: ")
    data = json.loads((tmp_path / "ttft.json").read_text())
    assert data["config"]["weights"] == "bfloat16"
    assert data["config"]["transformers_dtype"] == "float32"


def test_quantization_the_engine_lacks_is_a_user_error(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, tiny_model: str
) -> None:
    monkeypatch.setattr(common, "supports_quantization", lambda: False)
    code, lines, err = bench(capsys, "cache", "--quick", "--model", tiny_model,
                             "--quantization", "int8")
    assert code == 2 and lines == []
    assert "--quantization" in err and err.count("\n") == 1


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


def test_cluster_simulation_runs_calibrated_and_writes_its_rows(
    capsys: pytest.CaptureFixture[str], tiny_model: str, tmp_path: Path
) -> None:
    code, lines, err = bench(capsys, "cluster", "--simulate", "--model", tiny_model, "--threads",
                           "1", "--out", str(tmp_path), "--no-progress", "--requests", "300",
                           "--sim-replicas", "4", "--sim-tenants", "2")
    assert code == 0 and len(lines) == 1, err
    assert lines[0].startswith("cluster-sim: 4x2t: hit ")
    data = json.loads((tmp_path / "cluster-sim.json").read_text())
    rows = data["results"]["rows"]
    assert {(r["policy"], r["replicas"], r["tenants"]) for r in rows} == {
        (p, 4, 2) for p in ("cache-aware", "round-robin", "text-trie")}
    assert all(r["requests"] == 300 and 0 <= r["hit_rate"] <= 1 for r in rows)
    rates = data["results"]["calibration"]
    assert positive(rates["prefill_tokens_per_s"]) and positive(rates["decode_tokens_per_s"])
    assert data["config"]["cost_model"]["prefill_tokens_per_s"] == rates["prefill_tokens_per_s"]


def test_cluster_runs_named_by_the_cli_are_the_benchmarks() -> None:
    from kvstack.bench import cluster

    assert tuple(r.name for r in cluster.RUNS) == bench_cli.CLUSTER_RUNS
    assert "cluster" not in bench_cli.ALL_CASES


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


def test_every_case_module_imports_first_in_a_fresh_interpreter() -> None:
    # Cases import each other's helpers and the peers package; whichever is imported first
    # (`kvstack bench cache` alone, say) must not meet a half-initialized module.
    script = (
        "import importlib, sys\n"
        "for name in sys.argv[1:]:\n"
        "    for mod in [m for m in sys.modules if m.startswith('kvstack.bench')]:\n"
        "        del sys.modules[mod]\n"
        "    assert callable(importlib.import_module('kvstack.bench.' + name).run), name\n"
    )
    done = subprocess.run([sys.executable, "-c", script, *bench_cli.CASES],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]


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
    prompt = subject.chat_prompt(common.CHAT_QUESTION)
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


# -- the report: the docs page and the README headline ----------------------------------------

README = """# Project

Intro text | with a pipe.

## Benchmarks

Hand-written words before the table.

<!-- bench:start -->
| old | table |
<!-- bench:end -->

Hand-written words after the table.
"""


def fake_result(out: Path, case: str, plot: str, load: float) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / plot).write_bytes(b"\x89PNG fake")
    (out / f"{case}.json").write_text(json.dumps({
        "case": case,
        "summary": f"{case}: the one-line summary",
        "created": "2026-12-01T10:00:00+00:00",
        "machine": {"cpu": "Test CPU 9000", "logical_cpus": 2, "threads": 2,
                    "load_average": [load, 1.0, 1.0], "torch": "2.13.0",
                    "transformers": "4.99", "kvstack": "0.1.0"},
        "config": {"quick": False},
        "results": {},
        "plots": [plot],
        "table": [{"workload": f"{case} workload", "kvstack": "18.5 tok/s",
                   "peer": "transformers 14.9 tok/s", "speedup": "1.24x"},
                  {"workload": "a | piped cell", "kvstack": "1", "peer": "", "speedup": ""}],
    }))


def report_args(tmp_path: Path, *outs: Path) -> list[str]:
    args = ["report", "--readme", str(tmp_path / "README.md"), "--plots-dir",
            str(tmp_path / "docs" / "bench")]
    for out in outs:
        args += ["--out", str(out)]
    return args


def test_report_writes_the_page_and_only_the_readmes_marked_headline(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)  # the page's default place is docs/benchmarks/ here
    out, readme, plots = tmp_path / "results", tmp_path / "README.md", tmp_path / "docs" / "bench"
    page = tmp_path / "docs" / "benchmarks" / "main.md"
    readme.write_text(README)
    fake_result(out, "cache", "cache_latency.png", 0.5)
    fake_result(out, "peers", "peers.png", 3.5)
    code, lines, _ = bench(capsys, *report_args(tmp_path, out))
    assert code == 0 and len(lines) == 1 and "2 cases (cache, peers)" in lines[0]
    text = readme.read_text()
    before, rest = text.split(report.START)
    section, after = rest.split(report.END)
    assert before == README.split(report.START)[0]
    assert after == README.split(report.END)[1]
    assert "| old | table |" not in section
    # The README's headline: the first row of each case, no load column, a link to the page.
    assert "| `bench cache` | cache workload | 18.5 tok/s | transformers 14.9 tok/s | 1.24x |\n" \
        in section
    assert "| `bench peers` | peers workload |" in section and "piped cell" not in section
    assert "2026-12-01" in section and "Test CPU 9000" in section
    assert "[the benchmark page](docs/benchmarks/main.md)" in section
    # The page: every row, the provenance, the plots and the summary lines.
    body = page.read_text()
    assert body.startswith("# Benchmarks on Test CPU 9000\n") and "do not edit" in body
    assert "2 torch threads" in body
    row = "| `bench cache` | cache workload | 18.5 tok/s | transformers 14.9 tok/s | 1.24x | 0.5 |"
    assert row in body and "| 3.5 |" in body and "a \\| piped cell" in body
    assert "[cache_latency](../bench/cache_latency.png)" in body
    assert "    cache: the one-line summary" in body
    assert sorted(p.name for p in plots.iterdir()) == ["cache_latency.png", "peers.png"]
    # Rewriting again from the same results changes nothing.
    assert bench(capsys, *report_args(tmp_path, out))[0] == 0
    assert readme.read_text() == text and page.read_text() == body


def test_report_gives_one_table_per_results_folder(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """A `bench peers --isa avx2` run in its own folder becomes a second table beside the
    default run's, naming its kernels; its plot is copied under its folder's name."""
    readme, plots = tmp_path / "README.md", tmp_path / "docs" / "bench"
    page = tmp_path / "site" / "bench.md"
    readme.write_text(README)
    first, second = tmp_path / "results", tmp_path / "avx2"
    fake_result(first, "peers", "peers.png", 0.5)
    fake_result(second, "peers", "peers.png", 0.7)
    record = json.loads((second / "peers.json").read_text())
    record["config"]["kernels"] = {"isa": "avx2"}
    record["config"]["model"] = "gemma3-270m"
    (second / "peers.json").write_text(json.dumps(record))
    code, lines, _ = bench(capsys, *report_args(tmp_path, first, second), "--page", str(page))
    assert code == 0 and "2 cases (peers; peers)" in lines[0]
    body = page.read_text()
    tables = body.split("Measured ")
    assert len(tables) == 3 and body.count("| case | workload |") == 2
    assert "C kernels" not in tables[1] and "; C kernels avx2;" in tables[2]
    assert "gemma3-270m" not in tables[1] and "(UTC) with gemma3-270m on " in tables[2]
    assert "[peers](../docs/bench/peers.png)" in tables[1]
    assert "[avx2-peers](../docs/bench/avx2-peers.png)" in tables[2]
    assert sorted(p.name for p in plots.iterdir()) == ["avx2-peers.png", "peers.png"]
    # The README's headline holds the first folder's rows only, linked to the page.
    headline = readme.read_text().split(report.START)[1].split(report.END)[0]
    assert headline.count("| `bench peers` |") == 1 and "(site/bench.md)" in headline


def test_report_writes_a_named_sections_page_and_leaves_the_readme(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Another machine's runs go to their own page (`--section amd`): the README and the main
    page, whose JSON this machine lacks, stay as they were; every plot of a named section
    carries its folder's name, so none overwrites the main section's."""
    monkeypatch.chdir(tmp_path)
    readme, plots = tmp_path / "README.md", tmp_path / "docs" / "bench"
    readme.write_text(README)
    out = tmp_path / "amd-smollm2"
    fake_result(out, "peers", "peers.png", 1.5)
    code, lines, _ = bench(capsys, "report", "--section", "amd", "--out", str(out),
                           "--readme", str(readme), "--plots-dir", str(plots))
    assert code == 0 and "amd.md rewritten" in lines[0] and "README" not in lines[0]
    assert readme.read_text() == README
    assert [p.name for p in (tmp_path / "docs" / "benchmarks").iterdir()] == ["amd.md"]
    body = (tmp_path / "docs" / "benchmarks" / "amd.md").read_text()
    assert "report --section amd --out" in body and "| `bench peers` |" in body
    assert "[amd-smollm2-peers](../bench/amd-smollm2-peers.png)" in body
    assert [p.name for p in plots.iterdir()] == ["amd-smollm2-peers.png"]
    code, lines, err = bench(capsys, "report", "--section", "a b", "--out", str(out),
                             "--readme", str(readme), "--plots-dir", str(plots))
    assert code == 2 and lines == [] and "section name" in err and err.count("\n") == 1
    assert readme.read_text() == README and body == (tmp_path / "docs" / "benchmarks" /
                                                     "amd.md").read_text()


@pytest.mark.parametrize(
    ("readme_text", "with_results", "mentions"),
    [
        ("# no markers here\n", True, "<!-- bench:start -->"),
        (README.replace(report.END, ""), True, "<!-- bench:end -->"),
        (README, False, "kvstack bench all"),
    ],
)
def test_report_errors_are_one_line_and_leave_the_readme_alone(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, readme_text: str, with_results: bool,
    mentions: str
) -> None:
    out, readme = tmp_path / "results", tmp_path / "README.md"
    readme.write_text(readme_text)
    if with_results:
        fake_result(out, "cache", "cache_latency.png", 0.5)
    page = tmp_path / "page.md"
    code, lines, err = bench(capsys, "report", "--out", str(out), "--readme", str(readme),
                             "--plots-dir", str(tmp_path / "plots"), "--page", str(page))
    assert code == 2 and lines == []
    assert mentions in err and err.count("\n") == 1
    assert readme.read_text() == readme_text and not page.exists()
