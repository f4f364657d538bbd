"""Recurrent-state snapshots beside the prefix cache (a tiny random Qwen3.5): a hit ends at a
kept snapshot and then computes exactly what a cold run computes; multi-turn, shared
prefixes diverging mid-block, preemption, a corrupt snapshot."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers.tiny_qwen3_5 import make_tiny_qwen3_5_folder
from transformers import AutoModelForCausalLM

from kvstack import LLM, SamplingParams
from kvstack.errors import InvalidRequestError
from kvstack.recurrent.store import StateStore

pytestmark = pytest.mark.usefixtures("one_torch_thread")
BS = 4
GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_qwen3_5_folder(tmp_path_factory.mktemp("tiny-qwen3_5"))


@pytest.fixture(scope="module")
def hf(folder: Path) -> Any:
    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


def tiny_llm(folder: Path, **kwargs: Any) -> LLM:
    kwargs = {"kv_cache_memory": "8MiB", "block_size": BS, "max_num_seqs": 8} | kwargs
    return LLM(model=str(folder), skip_tokenizer_init=True, **kwargs)


def tokens(n: int, seed: int) -> list[int]:
    return torch.randint(3, 256, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def hf_greedy(hf: Any, prompt: list[int], n: int = 6) -> list[int]:
    """Greedy tokens from full forwards (no EOS handling: `ignore_eos` on our side)."""
    seq = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            seq.append(int(hf(torch.tensor([seq])).logits[0, -1].argmax()))
    return seq[len(prompt):]


def run(llm: LLM, prompts: Sequence[list[int]]) -> list[tuple[list[int], int]]:
    """(greedy tokens, cached prompt tokens) per prompt."""
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY)
    return [(list(o.outputs[0].token_ids), o.num_cached_tokens) for o in outs]


def store(llm: LLM) -> StateStore:
    s = llm.engine.hooks.features["recurrent"]
    assert isinstance(s, StateStore)
    return s


def test_hit_resumes_from_snapshot_exactly(folder: Path, hf: Any) -> None:
    llm = tiny_llm(folder, state_snapshot_every=1)
    base = tokens(30, 1)
    longer = base + tokens(9, 2)
    [(first, cached)] = run(llm, [base])
    assert cached == 0 and first == hf_greedy(hf, base)
    [(second, cached)] = run(llm, [longer])
    # every block has a snapshot: the hit is every full block of the shared 30 tokens
    assert cached == 28
    assert second == hf_greedy(hf, longer)
    stats = llm.engine.stats()
    assert stats.state_snapshots == len(store(llm)) > 0
    assert stats.state_snapshot_bytes == stats.state_snapshots * 19200


def test_multi_turn_computes_only_new_tokens(folder: Path, hf: Any) -> None:
    # periodic snapshots far apart: the turns hit through the prompt-end and sequence-end ones
    llm = tiny_llm(folder, state_snapshot_every=1000)
    history, new = tokens(21, 3), 0
    for turn in range(4):
        [(out, cached)] = run(llm, [history])
        assert out == hf_greedy(hf, history)
        if turn:
            # all of the previous turn's sequence up to its last block boundary was a hit
            assert len(history) - cached <= BS + new, (turn, cached)
        new = 5 + turn
        history = history + out + tokens(new, 10 + turn)


def test_shared_prefix_diverging_mid_block(folder: Path) -> None:
    shared = tokens(26, 4)  # 6 full blocks and 2 tokens into the 7th
    sessions = [shared + tokens(7, 20 + i) for i in range(5)]
    every_block = tiny_llm(folder, state_snapshot_every=1)
    got = [run(every_block, [s])[0][1] for s in sessions]
    assert got == [0] + [24] * 4
    sparse = tiny_llm(folder, state_snapshot_every=1000)
    got = [run(sparse, [s])[0][1] for s in sessions]
    # the first session keeps its prompt-end snapshot (in its own tokens); the second finds
    # the shared blocks cached but no snapshot there, computes them and keeps one at the end
    # of the shared run: every later session hits the whole shared prefix
    assert got[0] == 0 and got[2:] == [24] * 3


def test_preemption_keeps_greedy_exact(folder: Path, hf: Any) -> None:
    prompts = [tokens(40, 30 + i) for i in range(3)]
    want = [hf_greedy(hf, p, 16) for p in prompts]
    llm = tiny_llm(folder, kv_cache_memory="220KiB", max_num_seqs=3)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True))
    assert llm.engine.scheduler.num_preemptions > 0
    assert [list(o.outputs[0].token_ids) for o in outs] == want


def test_corrupt_snapshot_is_a_miss(folder: Path, hf: Any) -> None:
    llm = tiny_llm(folder, state_snapshot_every=1)
    base = tokens(30, 5)
    run(llm, [base])
    s = store(llm)
    for snap in s._snaps.values():
        snap.states[0].ssm = snap.states[0].ssm + 1.0  # bytes change under the checksum
    longer = base + tokens(6, 6)
    [(out, cached)] = run(llm, [longer])
    assert cached == 0 and s.num_bad > 0
    assert out == hf_greedy(hf, longer)


def test_refuses_what_a_recurrent_state_cannot_follow(folder: Path) -> None:
    llm = tiny_llm(folder)
    with pytest.raises(InvalidRequestError, match="parallel samples"):
        llm.generate([{"prompt_token_ids": [5, 6, 7]}], SamplingParams(n=2, max_tokens=2))
    with pytest.raises(InvalidRequestError, match="use_kv_cache"):
        tiny_llm(folder, use_kv_cache=False)


def test_engine_wide_drafts_leave_greedy_exact(folder: Path, hf: Any) -> None:
    # suffix drafts would propose the repeated pattern; a rejected draft token would have
    # advanced the recurrent state, so the engine feeds none for a recurrent model
    llm = tiny_llm(folder, speculative_config={"method": "suffix"})
    prompt = tokens(6, 40) * 5
    for _ in range(2):
        [(out, _)] = run(llm, [prompt])
        assert out == hf_greedy(hf, prompt)
    assert llm.engine.stats().num_draft_tokens == 0


def test_cache_breakpoints_keep_a_snapshot(folder: Path, hf: Any) -> None:
    shared = tokens(26, 50)  # a breakpoint after 26 tokens: the snapshot after block 6
    first, second = shared + tokens(30, 51), shared + tokens(9, 52)

    def hits(**options: Any) -> tuple[int, list[int]]:
        llm = tiny_llm(folder, state_snapshot_every=1000)
        engine = llm.engine
        engine.add_request(first, GREEDY, **options)
        while engine.has_unfinished():
            engine.step()
        [(out, cached)] = run(llm, [second])
        return cached, out

    # no snapshot inside the first prompt's blocks that the second can use: it recomputes
    assert hits()[0] == 0
    cached, out = hits(snapshot_at=[26])
    assert cached == 24 and out == hf_greedy(hf, second)
    with pytest.raises(InvalidRequestError, match="snapshot_at"):
        tiny_llm(folder).engine.add_request([5, 6, 7], GREEDY, snapshot_at="26")
