"""`engine/embedding.py` against transformers on tiny random models (a Llama with QKV bias and
a Gemma 3 whose sliding window is shorter than the input): the pooled final hidden state of
short inputs (the C kernels' row count) and long ones (PyTorch's ops), with no KV block used."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from helpers.tiny_gemma3 import WINDOW, make_tiny_gemma3_folder
from helpers.tiny_models import make_tiny_hf_folder
from transformers import AutoModelForCausalLM

from kvstack import LLM, SamplingParams
from kvstack.engine.embedding import embed

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_embedding_is_transformers_mean_pooled_final_hidden_state(
        family: str, tmp_path: Path) -> None:
    folder = (make_tiny_hf_folder(tmp_path, "qkv_bias") if family == "llama"
              else make_tiny_gemma3_folder(tmp_path, "mqa"))
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    llm = LLM(model=str(folder), skip_tokenizer_init=True, kv_cache_memory="4MiB",
              block_size=4)
    g = torch.Generator().manual_seed(1)
    running = llm.engine.add_request([5, 6, 7, 8, 9], SamplingParams(max_tokens=4))
    # 1 and 7 tokens: within Gemma's window and the kernels' 64 rows; 100: past both.
    for num_tokens in (1, WINDOW - 1, 100):
        token_ids = torch.randint(3, 200, (num_tokens,), generator=g).tolist()
        got = embed(llm.engine.model, token_ids)
        with torch.no_grad():
            hidden = hf.model(torch.tensor([token_ids])).last_hidden_state[0].double()
        want = torch.nn.functional.normalize(hidden.mean(0), dim=0)
        assert got.dtype == torch.float32 and got.shape == want.shape
        assert (got.double() - want).abs().max().item() < 1e-5
    # A waiting request's blocks and the pool are untouched; it then runs as usual.
    assert llm.stats().num_blocks_used == 0
    while llm.engine.has_unfinished():
        llm.engine.step()
    assert len(running.output_token_ids) == 4
    llm.engine.check_integrity()
    assert llm.stats().num_blocks_used == 0
