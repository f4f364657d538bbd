"""`kvstack bench drafts`: the sessions repeat what they should, outputs are scored up to their
first loop, and a quick run on a tiny model writes every arm's figures with identical outputs.
Timings are never asserted."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from helpers.tiny_models import make_tiny_hf_folder

from kvstack.bench.drafts import ARMS, STEP_DRAFTS, _sources
from kvstack.bench.drafts_workloads import agent_sessions, chat_sessions, loop_start
from kvstack.cli.main import main
from kvstack.outputs import CompletionOutput, Provenance, RequestMetrics, RequestOutput


@pytest.fixture(scope="module", autouse=True)
def _restore_torch_threads() -> Iterator[None]:
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def test_loop_start_finds_the_first_repeated_span() -> None:
    assert loop_start(list(range(100))) == 100
    looping = list(range(10)) + [1, 2, 3] * 20
    assert loop_start(looping, span=6) == 13  # 1 2 3 1 2 3 again from index 13
    assert loop_start([7] * 5, span=6) == 5


def test_sources_split_accepted_tokens_at_the_cut() -> None:
    out = RequestOutput("r", None, [1], [CompletionOutput(0, "", list(range(10)))], True, 0,
                        RequestMetrics(0.0),
                        provenance=Provenance(output=(("model", 2), ("draft", 5), ("model", 3))))
    assert _sources(out, 4) == (2, 3, 2)  # 2 drafted before token 4, 3 after; 2 model tokens
    assert _sources(out, 10) == (5, 0, 5)


def test_sessions_are_seeded_and_repeat_their_data() -> None:
    sessions = agent_sessions(3)
    assert [s.kind for s in sessions] == ["edit file", "tool call", "plan"]
    assert [s.user_turns for s in sessions] == [s.user_turns for s in agent_sessions(3)]
    assert "```python" in sessions[0].user_turns[0] and '"status": "pending"' in \
        sessions[1].user_turns[0]
    sessions[0].answers.append("done")
    assert [m["role"] for m in sessions[0].messages(1)] == ["user", "assistant", "user"]
    assert len(chat_sessions(2)) == 2


def test_quick_run_writes_every_arm(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    model = make_tiny_hf_folder(tmp_path / "m", "gqa")
    code = main(["bench", "drafts", "--quick", "--model", str(model), "--threads", "1",
                 "--out", str(tmp_path / "out")])
    assert code == 0
    assert capsys.readouterr().out.startswith("drafts: ")
    data = json.loads((tmp_path / "out" / "drafts.json").read_text())
    sessions = data["results"]["sessions"]
    assert set(sessions) == {"agent, batch 1", "agent, batch 4", "plain chat, batch 1"}
    for figures in sessions.values():
        assert figures["identical"] is True
        assert set(ARMS) <= set(figures)
        assert figures["off"]["drafted"] == 0 and figures["suffix"]["drafted"] > 0
        assert 0 <= figures["suffix"]["loop_share"] <= 1
    assert {f"step_over_1_at_{1 + k}" for k in STEP_DRAFTS} <= set(data["results"]["step_cost"])
