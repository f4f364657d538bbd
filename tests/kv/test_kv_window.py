"""Sliding-window mode with attention sinks (StreamingLLM): against an independent token-by-token
reference, constant memory over 10,000 tokens past the model's context, full attention before
any eviction, chunking and preemption invariance, and its errors."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers.tiny_models import make_tiny_hf_folder
from transformers import AutoModelForCausalLM

from kvstack import LLM, SamplingParams
from kvstack.cli.main import main
from kvstack.errors import InvalidRequestError
from kvstack.kv.sizing import KVShape
from kvstack.kv.window import SlidingWindow
from kvstack.layers.window_attention import build_span, key_positions

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> str:
    # max_model_len 128, 2 layers, 4 query heads over 2 KV heads of 64.
    return str(make_tiny_hf_folder(tmp_path_factory.mktemp("window"), "gqa"))


def tokens(n: int, seed: int = 0) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 256, (n,), generator=g).tolist()


def window_llm(model: str, **kwargs: Any) -> LLM:
    kwargs.setdefault("kv_cache_memory", "4MiB")
    return LLM(model, skip_tokenizer_init=True, num_threads=1, **kwargs)


# -- geometry --------------------------------------------------------------------------------


def test_dead_blocks_and_the_keys_each_query_sees() -> None:
    w = SlidingWindow(window=20, sink_tokens=4, block_size=8)  # 16 recent tokens
    # The next query at p sees p-15..p: block b (b >= 1) is dead once 8(b+1) <= p - 15.
    assert [w.num_dead_blocks(p) for p in (0, 30, 31, 38, 39, 100)] == [0, 0, 1, 1, 2, 9]
    assert w.max_blocks == 1 + math.ceil((16 + 20) / 8) + 1
    assert key_positions(w, 40, 43).tolist() == [0, 1, 2, 3, *range(25, 43)]
    assert key_positions(w, 0, 6).tolist() == list(range(6))
    span = build_span(w, _NoRope(), [_part(w, 0, 50)])
    seen = span.mask[0, 0].sum(-1)  # keys seen by each query p = 0..49
    assert seen.tolist() == [min(p + 1, 20) for p in range(50)]
    visible = span.mask[0, 0, 49].nonzero().flatten()
    assert key_positions(w, 0, 50)[visible].tolist() == [0, 1, 2, 3, *range(34, 50)]


class _NoRope:
    def table(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        shape = (*positions.shape, 1, 4)
        return torch.ones(shape), torch.zeros(shape)


def _part(w: SlidingWindow, start: int, end: int) -> Any:
    from kvstack.layers.window_attention import SpanRequest

    keys = key_positions(w, start, end)
    return SpanRequest(list(range(end - start)), start, keys, keys)


# -- against an independent reference --------------------------------------------------------


def _rotate(x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
    freqs = positions.double()[:, None] * inv_freq.double()[None]
    emb = torch.cat((freqs, freqs), dim=-1)[:, None]
    half = x.shape[-1] // 2
    return x * emb.cos() + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * emb.sin()


@torch.no_grad()
def streaming_reference(folder: str, ids: list[int], window: int, sinks: int) -> list[float]:
    """StreamingLLM, one token at a time in float64 on transformers' modules: keys kept
    unrotated, then rotated by their index in the kept cache, the query last. Returns the
    log-probability of each ids[t + 1] given ids[:t + 1]."""
    hf = AutoModelForCausalLM.from_pretrained(folder).double().eval()
    m, cfg = hf.model, hf.config
    heads, kv_heads, dim = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    inv_freq = m.rotary_emb.inv_freq
    keys: list[list[torch.Tensor]] = [[] for _ in m.layers]
    values: list[list[torch.Tensor]] = [[] for _ in m.layers]
    logprobs = []
    for t, token in enumerate(ids[:-1]):
        kept = [j for j in range(t + 1) if j < sinks or j > t - (window - sinks)]
        index = torch.arange(len(kept))
        h = m.embed_tokens(torch.tensor([token]))
        for layer_index, layer in enumerate(m.layers):
            a, x = layer.self_attn, layer.input_layernorm(h)
            q = a.q_proj(x).view(1, heads, dim)
            keys[layer_index].append(a.k_proj(x).view(kv_heads, dim))
            values[layer_index].append(a.v_proj(x).view(kv_heads, dim))
            k = _rotate(torch.stack([keys[layer_index][j] for j in kept]), index, inv_freq)
            v = torch.stack([values[layer_index][j] for j in kept])
            q = _rotate(q, index[-1:], inv_freq)
            k = k.repeat_interleave(heads // kv_heads, dim=1)
            v = v.repeat_interleave(heads // kv_heads, dim=1)
            p = torch.softmax(torch.einsum("hd,nhd->hn", q[0], k) / dim**0.5, dim=-1)
            h = h + a.o_proj(torch.einsum("hn,nhd->hd", p, v).reshape(1, heads * dim))
            h = h + layer.mlp(layer.post_attention_layernorm(h))
        logits = hf.lm_head(m.norm(h))[0]
        logprobs.append(torch.log_softmax(logits, dim=-1)[ids[t + 1]].item())
    return logprobs


@pytest.mark.parametrize(("window", "sinks", "block_size", "chunk"), [
    (24, 4, 16, 2048),  # one sink block, whole prompt in chunks of the window
    (20, 4, 8, 7),  # chunks that cut blocks, evictions at every few steps
    (16, 0, 8, 5),  # no sinks: a plain sliding window
    (21, 3, 4, 2048),  # sinks that fill no block
])
def test_matches_a_token_by_token_reference_past_the_context(
    tiny: str, window: int, sinks: int, block_size: int, chunk: int
) -> None:
    ids = tokens(160)  # the tiny model's context is 128: window mode goes past it
    llm = window_llm(tiny, kv_window=window, kv_sink_tokens=sinks, block_size=block_size,
                     max_num_batched_tokens=chunk)
    out = llm.generate({"prompt_token_ids": ids},
                       SamplingParams(max_tokens=1, prompt_logprobs=0))[0]
    want = streaming_reference(tiny, ids, window, sinks)
    got = out.prompt_token_logprobs[1:]
    assert max(abs(a - b) for a, b in zip(got, want, strict=True)) < 1e-4
    llm.engine.check_integrity()
    assert llm.stats().num_blocks_used == 0


# -- memory ----------------------------------------------------------------------------------


def test_ten_thousand_tokens_in_constant_memory(tiny: str) -> None:
    """One conversation, 10,000 new tokens, 78x the model's context: the blocks in use never
    pass what the window needs (and the estimate says), and nothing raises."""
    llm = window_llm(tiny, kv_window=64)
    bound = KVShape.of(llm.model_config, "float32", window=64, sink_tokens=4).window_blocks
    assert bound == 6  # 1 sink block + 60 recent tokens over 4 blocks + the one filling
    params = SamplingParams(temperature=0, max_tokens=10_000, ignore_eos=True)
    used = []
    outputs = llm.stream({"prompt_token_ids": tokens(40)}, params)
    for out in outputs:
        used.append(llm.stats().num_blocks_used)
        last = out
    assert len(last.outputs[0].token_ids) == 10_000
    assert last.outputs[0].finish_reason == "length"
    assert max(used) <= bound
    assert set(used[100:-1]) <= {bound - 1, bound}  # steady: sinks + window, nothing more
    assert used[-1] == 0  # finished: every block back in the pool
    llm.engine.check_integrity()


def test_prefix_caching_is_off_and_window_requests_never_share_blocks(tiny: str) -> None:
    llm = window_llm(tiny, kv_window=32)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    first, second = (llm.generate({"prompt_token_ids": tokens(80)}, params)[0] for _ in range(2))
    assert first.num_cached_tokens == second.num_cached_tokens == 0
    assert first.outputs[0].token_ids == second.outputs[0].token_ids
    assert llm.stats().num_blocks_cached == 0


def test_preemption_in_window_mode_changes_no_output(tiny: str) -> None:
    prompts = [{"prompt_token_ids": tokens(30 + 25 * i, seed=i)} for i in range(4)]
    params = SamplingParams(temperature=0, max_tokens=150, ignore_eos=True)
    want = [o.outputs[0].token_ids for o in window_llm(tiny, kv_window=32).generate(prompts,
                                                                                   params)]
    bytes_per_block = KVShape.of(window_llm(tiny).model_config, "float32").bytes_per_block
    tight = window_llm(tiny, kv_window=32, kv_cache_memory=12 * bytes_per_block)
    got = [o.outputs[0].token_ids for o in tight.generate(prompts, params)]
    assert tight.stats().num_preemptions > 0
    assert got == want
    tight.engine.check_integrity()


@pytest.mark.parametrize(("kv_dtype", "bound"), [("int8", 0.02), ("fp8", 0.08), ("int4", 0.25)])
def test_window_mode_over_a_quantized_cache(tiny: str, kv_dtype: str, bound: float) -> None:
    """Mean |log-prob change| over 300 positions of the random tiny model, measured: int8
    0.0065, fp8 0.028, int4 0.092 (the same as without the window: 0.0062, 0.025, 0.093)."""
    ids = tokens(300)
    params = SamplingParams(max_tokens=1, prompt_logprobs=0)
    full = window_llm(tiny, kv_window=48).generate({"prompt_token_ids": ids}, params)[0]
    llm = window_llm(tiny, kv_window=48, kv_cache_dtype=kv_dtype)
    quantized = llm.generate({"prompt_token_ids": ids}, params)[0]
    diffs = [abs(a - b) for a, b in zip(full.prompt_token_logprobs[1:],
                                        quantized.prompt_token_logprobs[1:], strict=True)]
    assert sum(diffs) / len(diffs) < bound
    assert llm.stats().num_blocks_used == 0
    llm.engine.check_integrity()


# -- the embedded model ----------------------------------------------------------------------


@pytest.mark.slow
def test_embedded_window_before_eviction_is_full_attention() -> None:
    chat = [{"role": "user", "content": "Write a haiku about the sea."}]
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    full = LLM(kv_cache_memory="64MiB", num_threads=1)
    prompt = full.apply_chat_template(chat)
    assert len(prompt) + 40 <= 128
    want = full.generate({"prompt_token_ids": prompt}, params)[0].outputs[0].token_ids
    windowed = LLM(kv_cache_memory="64MiB", num_threads=1, kv_window=128)
    got = windowed.generate({"prompt_token_ids": prompt}, params)[0].outputs[0].token_ids
    assert got == want


# -- bad input -------------------------------------------------------------------------------


@pytest.mark.parametrize(("kwargs", "mentions"), [
    ({"kv_window": 19}, "smaller than kv_sink_tokens \\+ block_size \\(4 \\+ 16\\)"),
    ({"kv_window": 8, "kv_sink_tokens": 0, "block_size": 16}, "at least 16 tokens"),
    ({"kv_window": 64, "kv_sink_tokens": -1}, "kv_sink_tokens must be an integer >= 0"),
    ({"kv_window": 64.5}, "kv_window must be an integer"),
    ({"kv_window": 64, "use_kv_cache": False}, "turn the KV cache on"),
    ({"kv_window": 64, "kv_disk_dir": "kv-tiers"}, "cannot use KV tiers"),
])
def test_bad_window_settings_are_typed_errors(kwargs: dict[str, Any], mentions: str) -> None:
    with pytest.raises(InvalidRequestError, match=mentions):
        LLM("no-such-model", **kwargs)


def test_window_longer_than_the_context_is_refused(tiny: str) -> None:
    with pytest.raises(InvalidRequestError, match="longer than the model's context"):
        window_llm(tiny, kv_window=256)


@pytest.mark.parametrize("flags", [["--kv-window", "12"], ["--kv-window", "64",
                                                         "--kv-sink-tokens", "-1"]])
def test_cli_refuses_bad_windows_in_one_line(capsys: pytest.CaptureFixture[str],
                                             flags: list[str], tmp_path: Path) -> None:
    assert main(["generate", "--prompt", "hi", "--model", str(tmp_path / "none"), *flags]) == 2
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1 and err.startswith("error: ")


def test_the_server_does_not_refuse_long_conversations_in_window_mode() -> None:
    from kvstack.server.errors import ApiError
    from kvstack.server.state import ServerState

    state = ServerState.__new__(ServerState)  # only its context arithmetic is under test
    state.max_model_len, state.pool_tokens, state.unbounded_context = 128, 4096, True
    assert state.max_tokens(500, 1000) == 500
    assert state.max_tokens(None, 1000) == 128
    assert state.max_tokens(None, 1000, default=16) == 16
    state.unbounded_context = False  # outside window mode the same prompt is refused
    with pytest.raises(ApiError) as refused:
        state.max_tokens(None, 1000)
    assert (refused.value.status, refused.value.code) == (400, "context_length_exceeded")


def test_a_prompt_shorter_than_the_sinks_and_tiny_chunks_work() -> None:
    """A first chunk that ends before the sink tokens (here a 2-token prompt, and 2-token
    chunks of a longer one) has no recent part; it must run, not raise."""
    from kvstack import LLM, SamplingParams

    llm = LLM(kv_cache_memory="16MiB", kv_window=64, kv_sink_tokens=4,
              max_num_batched_tokens=2, enable_prefix_caching=False)
    params = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": [1, 2]},
                         {"prompt_token_ids": list(range(10, 20))}], params)
    assert [len(o.outputs[0].token_ids) for o in outs] == [3, 3]
    llm.engine.check_integrity()
