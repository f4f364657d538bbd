"""`kvstack bench agent` end to end at a tiny size on the embedded model: every arm runs every
turn, and what the cache does (not how fast) is asserted: Responses turns are prefix hits,
the uncached arm computes every prompt token, resumed conversations come back from disk."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import EMBEDDED, cached_checkpoint

from kvstack.bench import agent, common
from kvstack.cli.main import main

pytestmark = pytest.mark.slow

TINY = {"system_tokens": 96, "turns": 3, "result_tokens": 24, "conversations": 2,
        "output_tokens": 2, "idle_conversations": 2}


def test_agent_case_runs_every_arm_and_resumes_from_disk(
        capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch,
        tmp_path: Path) -> None:
    monkeypatch.setattr(common, "load_checkpoint", cached_checkpoint)
    monkeypatch.setattr(agent, "sizes", lambda quick: TINY)
    code = main(["bench", "agent", "--quick", "--model", EMBEDDED, "--threads", "1",
                 "--out", str(tmp_path), "--no-progress"])
    lines = capsys.readouterr().out.splitlines()
    assert code == 0
    data = json.loads((tmp_path / "agent.json").read_text())
    assert lines[-1] == data["summary"] and data["summary"].startswith("agent: ")
    arms = data["results"]["arms"]
    assert set(arms) == set(agent.ARMS)
    for arm in arms.values():
        assert len(arm["ttft_s"]) == len(arm["computed_tokens"]) == TINY["turns"]
        assert all(t > 0 for t in arm["ttft_s"]) and arm["total_s"] > 0
        assert arm["input_tokens"] == sorted(arm["input_tokens"])  # the history grows
    ours, off = arms["responses"], arms["chat_uncached"]
    assert off["computed_tokens"] == off["input_tokens"]  # no prefix cache: all computed
    for turn in range(1, TINY["turns"]):
        # A continued turn computes its new tokens only (and a block's worth of the last).
        new = ours["input_tokens"][turn] - ours["input_tokens"][turn - 1]
        assert ours["computed_tokens"][turn] <= new + 16 < ours["input_tokens"][turn]
    idle = data["results"]["idle"]
    assert idle["resumed_cached_tokens"] > 0 and idle["disk"]["hits"] > 0
    assert len(idle["turns"]) == TINY["idle_conversations"]
    assert all(len(turns) == 3 for turns in idle["turns"])
    targets = data["results"]["targets"]
    assert {"turn_last_vs_turn_2", "turn_last_vs_uncached", "resumed_vs_in_memory"} <= \
        set(targets)
    assert (tmp_path / data["plots"][0]).read_bytes().startswith(b"\x89PNG")
