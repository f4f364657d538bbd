"""The `kvstack` command line, run in-process through `main([...])`."""

from __future__ import annotations

import io
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from kvstack import LLM, SamplingParams
from kvstack.cli import estimate
from kvstack.cli.main import main

# One thread and a small pool keep model runs quick and steady on a busy 2-core machine.
FAST = ["--threads", "1", "--kv-cache-memory", "64MiB"]
PROMPT = "The capital of France is"
TURN = re.compile(r"\[turn (\d+): (\d+) prompt tokens, (\d+) cached, (\d+) new, (\d+) generated")


@pytest.fixture(scope="module", autouse=True)
def _restore_torch_threads() -> Iterator[None]:
    # `--threads` sets torch's process-wide thread count; later test modules get theirs back.
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def run_cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    captured = capsys.readouterr()
    return code, captured.out, captured.err


@pytest.mark.parametrize(
    ("argv", "mentions"),
    [
        (["generate", "--prompt", "hi", "--model", "no-such-model"], "no-such-model"),
        (["generate", "--prompt", "hi", "--max-tokens", "0"], "--max-tokens"),
        (["generate", "--prompt", "hi", "--temperature", "-0.5"], "temperature"),
        (["chat", "--top-p", "1.5"], "top_p"),
        (["estimate", "--layers", "0"], "--layers"),
        (["estimate", "--layers", "32", "--kv-heads", "8"], "--head-dim"),
        (["estimate", "--model", "x", "--layers", "32"], "not both"),
        (["estimate", "--model", "x", "--kv-cache-memory", "lots"], "--kv-cache-memory"),
        (["serve", "--router", "pow2"], "--replicas"),
        (["serve", "--replica-threads", "2"], "--replicas"),
        (["serve", "--prefill-replicas", "1"], "--replicas"),
        (["serve", "--replicas", "2", "--prefill-replicas", "2"], "--prefill-replicas"),
        (["serve", "--max-local-prefill", "512"], "--replicas"),
        (["serve", "--replicas", "2", "--max-local-prefill", "512"], "--prefill-replicas"),
        (["serve", "--replicas", "2", "--prefill-replicas", "1", "--max-local-prefill", "-1"],
         "--max-local-prefill"),
        (["serve", "--replicas", "2", "--kv-redis-url", "redis://h:1/0", "--kv-window", "64"],
         "prefix cache"),
        (["serve", "--replicas", "0"], "--replicas"),
        (["serve", "--responses-pin-ttl", "-1"], "--responses-pin-ttl"),
        (["bench", "cluster", "--requests", "0"], "--requests"),
        (["serve", "--speculative-config", '{"method": "eagle"}'], "'suffix'"),
        (["generate", "--prompt", "hi", "--speculative-config", "suffix"],
         "--speculative-config"),
        (["frobnicate"], "invalid choice"),
        ([], "COMMAND"),
    ],
)
def test_user_errors_are_one_line_and_exit_2(
    capsys: pytest.CaptureFixture[str], argv: list[str], mentions: str
) -> None:
    code, out, err = run_cli(capsys, *argv)
    assert code == 2
    assert out == ""
    assert len(err.splitlines()) == 1
    assert err.startswith("error: ")
    assert mentions in err


def test_replicas_without_redis_route_alone_with_a_one_line_warning(
    capsys: pytest.CaptureFixture[str],
) -> None:
    from kvstack.cli.main import build_parser
    from kvstack.cli.serve import check_cluster_flags

    check_cluster_flags(build_parser().parse_args(["serve", "--replicas", "2"]))
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("warning: ") and "--kv-redis-url" in lines[0]
    check_cluster_flags(build_parser().parse_args(
        ["serve", "--replicas", "2", "--kv-redis-url", "redis://h:1/0"]))
    assert capsys.readouterr().err == ""


def test_keyboard_interrupt_exits_130_quietly(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    def interrupted(args: object) -> int:
        raise KeyboardInterrupt

    monkeypatch.setattr(estimate, "run", interrupted)
    assert run_cli(capsys, "estimate", "--layers", "1") == (130, "", "")


def test_estimate_from_numbers(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run_cli(
        capsys, "estimate", "--layers", "32", "--kv-heads", "8", "--head-dim", "128",
        "--seq-len", "4096", "--batch", "1", "--dtype", "float16",
    )
    assert code == 0
    assert re.search(r"per token\s+128 KiB \(131,072 B\)", out)
    assert re.search(r"4096 tokens x 1 seqs\s+512 MiB", out)


def test_estimate_budget_counts_whole_blocks(capsys: pytest.CaptureFixture[str]) -> None:
    # 8 GiB / (128 KiB/token x 16 tokens) = 4096 blocks = 65,536 tokens = 16 sequences of 4096;
    # sequences of 4097 tokens take 257 blocks each, so only 15 fit.
    code, out, _ = run_cli(
        capsys, "estimate", "--layers", "32", "--kv-heads", "8", "--head-dim", "128",
        "--seq-len", "4097", "--dtype", "bfloat16", "--kv-cache-memory", "8GiB",
    )
    assert code == 0
    assert re.search(r"budget\s+8 GiB = 4096 blocks of 16 tokens", out)
    assert re.search(r"max tokens\s+65,536\n", out)
    assert re.search(r"max seqs of 4097 tokens\s+15\n", out)


@pytest.mark.slow
def test_estimate_from_model_config(capsys: pytest.CaptureFixture[str]) -> None:
    # SmolLM2-135M: 30 layers x 3 KV heads x 64 head dim x 2 (K and V) x 2 bytes.
    code, out, _ = run_cli(capsys, "estimate", "--model", "smollm2-135m", "--dtype", "bfloat16",
                           "--seq-len", "1000")
    assert code == 0
    assert re.search(r"per token\s+22.50 KiB \(23,040 B\)", out)
    assert re.search(r"1000 tokens x 1 seqs\s+.*\(23,040,000 B\)", out)


@pytest.mark.slow
def test_generate_streams_what_llm_generate_returns(capsys: pytest.CaptureFixture[str]) -> None:
    llm = LLM(num_threads=1, kv_cache_memory="64MiB")
    expected = llm.generate(PROMPT, SamplingParams(temperature=0.0, max_tokens=8))[0]
    del llm
    code, out, err = run_cli(capsys, "generate", "--prompt", PROMPT, "--max-tokens", "8", *FAST)
    assert code == 0
    assert expected.outputs[0].text
    assert out == expected.outputs[0].text + "\n"
    summary = f"[{len(expected.prompt_token_ids)} prompt tokens, 0 cached, 8 new tokens, TTFT "
    assert err.startswith(summary)
    assert err.rstrip().endswith(f"finish {expected.outputs[0].finish_reason}]")


@pytest.mark.slow
def test_chat_reuses_the_previous_turns_blocks(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    lines = "What is the capital of France?\n\nAnd of Germany?\n/exit\nnever sent\n"
    monkeypatch.setattr(sys, "stdin", io.StringIO(lines))
    code, out, err = run_cli(capsys, "chat", "--max-tokens", "8", *FAST)
    assert code == 0
    turns = [tuple(map(int, m.groups())) for m in TURN.finditer(err)]
    assert [t[0] for t in turns] == [1, 2]
    (_, prompt1, cached1, new1, _), (_, prompt2, cached2, new2, _) = turns
    assert cached1 == 0 and new1 == prompt1
    # Turn 2's prompt starts with turn 1's prompt, whose full 16-token blocks are reused.
    assert prompt2 > prompt1
    assert cached2 > 0 and cached2 % 16 == 0
    assert cached2 + new2 == prompt2
    assert out.strip()


def test_python_dash_m_help() -> None:
    src = str(Path(__file__).resolve().parents[2] / "src")
    env = os.environ | {"PYTHONPATH": os.pathsep.join(filter(None, [src, os.environ.get(
        "PYTHONPATH")]))}
    result = subprocess.run([sys.executable, "-m", "kvstack", "--help"], capture_output=True,
                            text=True, env=env, timeout=120, check=False)
    assert result.returncode == 0, result.stderr
    for command in ("generate", "chat", "estimate", "demo"):
        assert command in result.stdout
