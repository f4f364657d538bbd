"""The sparse MoE block (`layers/moe.py`): router choices equal transformers', and a step runs
each chosen expert once, on all the rows that chose it, and never an expert no row chose
(counted by wrapping each expert's linears, not timed)."""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as QType
from helpers.tiny_qwen3 import make_tiny_qwen3_folder, tiny_qwen3_config
from transformers import AutoModelForCausalLM

from kvstack import LLM, SamplingParams
from kvstack.kernels import build
from kvstack.kernels.gguf import GGUFLinear
from kvstack.kernels.linear import Linear
from kvstack.layers import moe as moe_module
from kvstack.layers.moe import SparseMoE

pytestmark = pytest.mark.usefixtures("one_torch_thread")


class Counting:
    """A linear layer that records how often, and on how many rows, it ran."""

    def __init__(self, lin: Any, key: int, calls: Counter[int], rows: Counter[int]) -> None:
        self.lin, self.key, self.calls, self.rows = lin, key, calls, rows
        self.in_features, self.out_features = lin.in_features, lin.out_features

    @property
    def num_bytes(self) -> int:
        return int(self.lin.num_bytes)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        self.calls[self.key] += 1
        self.rows[self.key] += x.shape[0]
        return self.lin(x)


def count_experts(moe: SparseMoE) -> tuple[Counter[int], Counter[int]]:
    """Wrap each expert's gate/up product; (calls, rows) per expert from now on."""
    calls: Counter[int] = Counter()
    rows: Counter[int] = Counter()
    moe.experts = [(Counting(g, e, calls, rows), d) for e, (g, d) in enumerate(moe.experts)]
    return calls, rows


def random_moe(num_experts: int, top_k: int, hidden: int = 64, inter: int = 32,
               norm: bool = True) -> SparseMoE:
    g = torch.Generator().manual_seed(0)
    experts = [(Linear(torch.randn(2 * inter, hidden, generator=g) * 0.1, None, torch.float32),
                Linear(torch.randn(hidden, inter, generator=g) * 0.1, None, torch.float32))
               for _ in range(num_experts)]
    return SparseMoE(torch.randn(num_experts, hidden, generator=g), experts, top_k, norm)


@pytest.mark.parametrize(("num_experts", "top_k", "norm"), [(8, 2, True), (128, 8, True),
                                                            (16, 3, False)])
def test_router_choices_and_output_equal_transformers(num_experts: int, top_k: int,
                                                      norm: bool) -> None:
    config = tiny_qwen3_config("moe", hidden_size=64, moe_intermediate_size=32,
                               num_experts=num_experts, num_experts_per_tok=top_k,
                               norm_topk_prob=norm, num_hidden_layers=1)
    torch.manual_seed(1)
    hf = AutoModelForCausalLM.from_config(config).model.layers[0].mlp.eval()
    with torch.no_grad():
        for p in hf.parameters():
            p.normal_(0.0, 0.2)
    e = hf.experts
    ours = SparseMoE(hf.gate.weight.detach().clone(), [
        (Linear(e.gate_up_proj[i].detach().clone(), None, torch.float32),
         Linear(e.down_proj[i].detach().clone(), None, torch.float32))
        for i in range(num_experts)], top_k, norm)
    x = torch.randn(50, 64)
    with torch.no_grad():
        _, want_weights, want_ids = hf.gate(x)
        want = hf(x[None])[0]
    weights, ids = ours.route(x)
    assert torch.equal(ids, want_ids)
    torch.testing.assert_close(weights, want_weights, rtol=0, atol=1e-7)
    torch.testing.assert_close(ours(x), want, rtol=0, atol=1e-5)


def test_rows_sharing_experts_read_each_once() -> None:
    """A router biased to two experts for positive inputs: 12 rows, one call each to experts
    2 and 5 (12 rows apiece), none to the rest; each row as it would be alone."""
    moe = random_moe(8, 2)
    moe.router[2] += 50.0
    moe.router[5] += 40.0
    x = torch.rand(12, 64) + 0.1
    alone = torch.cat([moe(x[i:i + 1]) for i in range(12)])
    calls, rows = count_experts(moe)
    together = moe(x)
    assert dict(calls) == {2: 1, 5: 1} and dict(rows) == {2: 12, 5: 12}
    torch.testing.assert_close(together, alone, rtol=0, atol=1e-6)


def test_batched_decode_steps_run_each_chosen_expert_once(tmp_path: Path) -> None:
    """Inside the engine: in every decode step of four sequences, each sparse layer runs each
    expert some row chose exactly once, with exactly the rows that chose it."""
    llm = LLM(model=str(make_tiny_qwen3_folder(tmp_path, "moe")), skip_tokenizer_init=True,
              kv_cache_memory="4MiB", block_size=4)
    model = llm.engine.model
    layer = model.layers[1].mlp
    assert isinstance(layer, SparseMoE)
    calls, rows = count_experts(layer)
    chosen: list[Counter[int]] = []
    route = layer.route

    def recording_route(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        weights, ids = route(x)
        chosen.append(Counter(ids.reshape(-1).tolist()))
        return weights, ids

    layer.route = recording_route  # type: ignore[method-assign]
    prompts = [{"prompt_token_ids": [5 + i, 9, 11 + i]} for i in range(4)]
    steps_before = len(chosen)
    llm.generate(prompts, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
    steps = chosen[steps_before:]
    assert len(steps) >= 5
    assert sum(calls.values()) == sum(len(c) for c in steps)  # one call per chosen expert
    assert rows == sum(steps, Counter())  # with exactly its rows
    assert any(max(c.values()) > 1 for c in steps)  # some step did share an expert


def gguf_moe(qtype: QType, num_experts: int = 16, top_k: int = 4, hidden: int = 256,
             inter: int = 128) -> SparseMoE:
    rng = np.random.default_rng(0)

    def lin(rows: int, cols: int) -> GGUFLinear:
        w = rng.normal(0, 0.05, (rows, cols)).astype(np.float32)
        return GGUFLinear(gguf.quants.quantize(w, qtype), qtype, (rows, cols))

    experts = [(lin(2 * inter, hidden), lin(hidden, inter)) for _ in range(num_experts)]
    return SparseMoE(torch.from_numpy(rng.normal(0, 1, (num_experts, hidden)).astype(np.float32)),
                     experts, top_k, True)


@pytest.mark.skipif(build.load() is None, reason="needs the C kernels (a compiler)")
@pytest.mark.parametrize("qtype", [QType.Q4_0, QType.Q8_0, QType.Q4_1])
def test_gguf_experts_run_in_two_calls_with_the_per_expert_bits(
        qtype: QType, monkeypatch: pytest.MonkeyPatch) -> None:
    """GGUF experts at decode size: all chosen experts' gate/up in one C call, their down in
    another, each row's result bit-identical to running the experts one by one."""
    moe = gguf_moe(qtype)
    x = torch.randn(6, 256)
    calls: list[int] = []
    original = moe_module.gemv_many

    def counting(lins: list[GGUFLinear], x: torch.Tensor, offsets: list[int]) -> Any:
        calls.append(len(lins))
        return original(lins, x, offsets)

    monkeypatch.setattr(moe_module, "gemv_many", counting)
    grouped = moe(x)
    _, ids = moe.route(x)
    assert calls == [len(set(ids.reshape(-1).tolist()))] * 2
    one_by_one = SparseMoE(moe.router, [(Counting(g, e, Counter(), Counter()), d)
                                        for e, (g, d) in enumerate(moe.experts)], 4, True)
    assert torch.equal(grouped, one_by_one(x))
