"""Anthropic `cache_control` breakpoints are snapshot points for a hybrid model (a tiny
random Qwen3.5 with the embedded model's tokenizer and chat template): the next request that
shares the system prompt up to the breakpoint but nothing after it reads the cache up to the
breakpoint's block boundary, which the periodic policy alone would not give it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from helpers.asgi_clients import AsgiClients
from helpers.tiny_qwen3_5 import make_tiny_qwen3_5_folder

from kvstack import LLM
from kvstack.engine.tokenizer import load_tokenizer
from kvstack.weights import Checkpoint

pytestmark = pytest.mark.usefixtures("one_torch_thread")
BS = 4


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory, embedded_checkpoint: Checkpoint) -> Path:
    tokenizer = load_tokenizer(embedded_checkpoint)
    made = make_tiny_qwen3_5_folder(tmp_path_factory.mktemp("q35chat"),
                                    vocab_size=len(tokenizer))
    tokenizer.save_pretrained(made)
    return made


def cached_tokens(folder: Path, breakpoint: bool) -> list[dict[str, Any]]:
    llm = LLM(model=str(folder), kv_cache_memory="16MiB", block_size=BS, max_num_seqs=2,
              state_snapshot_every=1000)
    clients = AsgiClients(llm)
    system: dict[str, Any] = {"type": "text", "text": "You are a terse assistant for the "
                              "kvstack project; answer in one line. " * 3}
    if breakpoint:
        system["cache_control"] = {"type": "ephemeral"}
    usages = []
    for question in ("What is a block?", "Why hash the prefix of every block?"):
        r = clients.run(clients.http.post("/v1/messages", json={
            "model": str(folder), "max_tokens": 3, "system": [system],
            "messages": [{"role": "user", "content": question}]}))
        assert r.status_code == 200, r.text
        usages.append(r.json()["usage"])
    clients.close(pins=breakpoint)
    return usages


def test_a_cache_control_breakpoint_keeps_the_state_there(folder: Path) -> None:
    plain = cached_tokens(folder, breakpoint=False)
    marked = cached_tokens(folder, breakpoint=True)
    # without a snapshot inside the system prompt's blocks, the second request recomputes
    assert plain[1]["cache_read_input_tokens"] == 0
    read = marked[1]["cache_read_input_tokens"]
    # with one at the breakpoint (the system prompt's end), it reads all of its full blocks
    assert read >= 30 and read % BS == 0
    assert marked[0]["cache_creation_input_tokens"] >= read
