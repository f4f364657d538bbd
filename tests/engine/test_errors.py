"""User errors: a typed `KvstackError` with one line that says what to do, and an engine that
keeps working (no blocks held, no request left queued) after every one of them."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as QType
from helpers.tiny_models import make_tiny_hf_folder, write_tiny_gguf

from kvstack import LLM, SamplingParams
from kvstack.errors import (
    CapacityError,
    InvalidRequestError,
    KvstackError,
    ModelLoadError,
    ModelNotFoundError,
    PromptTooLongError,
    UnsupportedModelError,
)

GOOD = {"prompt_token_ids": [1, 2, 3, 4, 5]}


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def llm() -> LLM:
    """The embedded model with its tokenizer (text prompts need one)."""
    return LLM(kv_cache_memory="16MiB")


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_hf_folder(tmp_path_factory.mktemp("tiny"), "gqa")


def assert_one_line(err: pytest.ExceptionInfo[BaseException], *mentions: str) -> None:
    message = str(err.value)
    assert isinstance(err.value, KvstackError)
    assert message and "\n" not in message, repr(message)
    for text in mentions:
        assert text in message, (text, message)


def assert_still_works(llm: LLM) -> None:
    """Nothing held or queued, the pool consistent, and a fresh request completes."""
    stats = llm.stats()
    assert (stats.num_blocks_used, stats.num_requests_running, stats.num_requests_waiting) == (
        0, 0, 0,
    )
    llm.engine.check_integrity()
    out = llm.generate(GOOD, SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 3
    assert llm.stats().num_blocks_used == 0
    llm.engine.check_integrity()


# -- bad requests ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("prompt", "error", "mentions"),
    [
        ("", InvalidRequestError, ["prompt is empty", "give"]),
        ({"prompt_token_ids": []}, InvalidRequestError, ["prompt_token_ids is empty", "give"]),
        ({"prompt_token_ids": [1, 49152]}, InvalidRequestError, ["49152", "[0, 49152)", "give"]),
        ({"prompt_token_ids": [-1, 5]}, InvalidRequestError, ["-1", "[0, 49152)"]),
        ({"prompt_token_ids": [1, 2.5]}, InvalidRequestError, ["2.5", "[0, 49152)"]),
        ({"prompt": "no ids"}, InvalidRequestError, ["prompt_token_ids"]),
        ({"prompt_token_ids": 5}, InvalidRequestError, ["prompt_token_ids", "list"]),
        ({"prompt_token_ids": None}, InvalidRequestError, ["prompt_token_ids", "list"]),
        ({"prompt_token_ids": [7] * 8200}, PromptTooLongError, ["8200", "8192", "shorten"]),
    ],
    ids=["empty-text", "empty-ids", "id-past-vocab", "negative-id", "float-id", "no-ids",
         "int-not-list", "none-ids", "too-long"],
)
def test_bad_prompt_raises_typed_error_and_engine_recovers(
    llm: LLM, prompt: Any, error: type[KvstackError], mentions: list[str]
) -> None:
    with pytest.raises(error) as err:
        llm.generate(prompt, SamplingParams(max_tokens=4))
    assert_one_line(err, *mentions)
    assert_still_works(llm)


@pytest.mark.parametrize(
    "ids",
    [np.array([1, 2, 3]), torch.tensor([1, 2, 3]), (1, 2, 3)],
    ids=["numpy", "torch", "tuple"],
)
def test_integer_like_token_ids_are_valid_ids(llm: LLM, ids: Any) -> None:
    # Regression: numpy/torch integers were refused as "not in the vocabulary".
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    out = llm.generate({"prompt_token_ids": ids}, params)[0]
    assert out.prompt_token_ids == [1, 2, 3]
    assert all(type(t) is int for t in out.prompt_token_ids)
    want = llm.generate({"prompt_token_ids": [1, 2, 3]}, params)[0]
    assert out.outputs[0].token_ids == want.outputs[0].token_ids
    assert_still_works(llm)


def test_prompt_too_long_reports_both_lengths(llm: LLM) -> None:
    max_len = llm.engine.max_model_len
    with pytest.raises(PromptTooLongError) as err:
        llm.generate({"prompt_token_ids": [5] * (max_len + 3)})
    assert (err.value.num_prompt_tokens, err.value.max_model_len) == (max_len + 3, max_len)
    assert_one_line(err, f"{max_len + 3} tokens", f"{max_len} tokens")
    assert_still_works(llm)


def test_a_bad_prompt_mid_batch_leaves_nothing_queued(llm: LLM) -> None:
    # The first request is already queued when the second one is refused.
    with pytest.raises(InvalidRequestError) as err:
        llm.generate([GOOD, {"prompt_token_ids": []}, GOOD])
    assert_one_line(err, "give at least one token")
    assert_still_works(llm)


def test_a_bad_prompt_in_stream_leaves_nothing_queued(llm: LLM) -> None:
    with pytest.raises(InvalidRequestError) as err:
        list(llm.stream({"prompt_token_ids": [1, 10**6]}))
    assert_one_line(err, "vocabulary")
    assert_still_works(llm)


def test_feature_options_are_checked_before_anything_is_queued(llm: LLM) -> None:
    # A feature's own add_request keyword reaches its on_add hook only; the engine refuses a
    # keyword no feature declared, and blending refuses a value that is not a BlendSpec.
    engine = llm.engine
    with pytest.raises(TypeError, match="colour"):
        engine.add_request([1, 2, 3], SamplingParams(max_tokens=2), colour="blue")
    with pytest.raises(InvalidRequestError) as err:
        engine.add_request([1, 2, 3], SamplingParams(max_tokens=2), blend={"chunks": []})
    assert_one_line(err, "BlendSpec")
    assert not engine.has_unfinished()
    assert_still_works(llm)


def test_sampling_params_count_must_match_prompts(llm: LLM) -> None:
    with pytest.raises(InvalidRequestError) as err:
        llm.generate([GOOD, GOOD], [SamplingParams()])
    assert_one_line(err, "1 sampling params for 2 prompts")
    assert_still_works(llm)


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("max_tokens", 0),
        ("max_tokens", -5),
        ("temperature", -0.1),
        ("temperature", float("nan")),
        ("top_p", 0.0),
        ("top_p", 1.5),
        ("top_k", -2),
        ("min_p", 1.5),
        ("repetition_penalty", 0.0),
        ("presence_penalty", 2.5),
        ("frequency_penalty", -3.0),
        ("n", 0),
        ("logprobs", 21),
        ("stop", [""]),
        ("stop_token_ids", [-1]),
    ],
)
def test_out_of_range_sampling_value_names_the_field(field: str, value: Any) -> None:
    with pytest.raises(InvalidRequestError) as err:
        SamplingParams(**{field: value})
    assert_one_line(err, field, "must be")


def test_request_larger_than_the_pool_is_a_capacity_error(tiny_folder: Path) -> None:
    # gqa tiny model: 2 layers x 2 KV heads x 64 dims x 4 B x (K, V) = 2 KiB per token, so
    # 128 KiB holds 4 blocks of 16 tokens.
    llm = LLM(model=str(tiny_folder), skip_tokenizer_init=True, kv_cache_memory="128KiB")
    assert llm.stats().num_blocks_total == 4
    with pytest.raises(CapacityError) as err:
        llm.generate({"prompt_token_ids": list(range(3, 53))}, SamplingParams(max_tokens=20))
    assert_one_line(err, "needs 5 KV blocks", "holds 4", "kv_cache_memory")
    assert_still_works(llm)
    # max_tokens=None means "up to the context" (128 tokens), which this pool never fits.
    with pytest.raises(CapacityError) as err:
        llm.generate(GOOD, SamplingParams(max_tokens=None))
    assert_one_line(err, "lower max_tokens or raise kv_cache_memory")
    assert_still_works(llm)
    # A request that fills the pool exactly is fine.
    out = llm.generate({"prompt_token_ids": list(range(3, 53))},
                       SamplingParams(temperature=0, max_tokens=14, ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 14
    assert_still_works(llm)


@pytest.mark.parametrize(
    ("kwargs", "mentions"),
    [
        ({"block_size": 3}, ["block_size", "power of two"]),
        ({"dtype": "float16"}, ["dtype", "float32 or bfloat16"]),
        ({"kv_cache_memory": "lots"}, ["'lots'", "1GiB"]),
        ({"kv_cache_memory": 0}, ["size must be positive"]),
        ({"max_num_seqs": 0}, ["max_num_seqs"]),
        ({"max_num_batched_tokens": 0}, ["max_num_batched_tokens"]),
    ],
)
def test_bad_engine_argument(tiny_folder: Path, kwargs: dict[str, Any],
                             mentions: list[str]) -> None:
    with pytest.raises(InvalidRequestError) as err:
        LLM(model=str(tiny_folder), skip_tokenizer_init=True, **kwargs)
    assert_one_line(err, *mentions)


def test_pool_smaller_than_one_block(tiny_folder: Path) -> None:
    with pytest.raises(InvalidRequestError) as err:
        LLM(model=str(tiny_folder), skip_tokenizer_init=True, kv_cache_memory=1000)
    assert_one_line(err, "raise kv_cache_memory")


# -- bad models --------------------------------------------------------------------------------


def test_unknown_model_name() -> None:
    with pytest.raises(ModelNotFoundError) as err:
        LLM(model="no-such-model-anywhere")
    assert_one_line(err, "no-such-model-anywhere", "smollm2-135m")


def test_missing_gguf_file(tmp_path: Path) -> None:
    with pytest.raises(ModelNotFoundError) as err:
        LLM(model=str(tmp_path / "gone.gguf"))
    assert_one_line(err, "gone.gguf")


def test_garbage_gguf_file(tmp_path: Path) -> None:
    path = tmp_path / "garbage.gguf"
    path.write_bytes(b"this is not a gguf file at all" * 100)
    with pytest.raises(ModelLoadError) as err:
        LLM(model=str(path), skip_tokenizer_init=True)
    assert_one_line(err, "garbage.gguf", "re-download")


def test_truncated_gguf_file(tmp_path: Path, tiny_folder: Path) -> None:
    path = write_tiny_gguf(tmp_path / "tiny.gguf", tiny_folder, QType.Q8_0)
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(ModelLoadError) as err:
        LLM(model=str(path), skip_tokenizer_init=True)
    assert_one_line(err, "tiny.gguf", "re-download")


def test_corrupt_safetensors(tmp_path: Path) -> None:
    folder = make_tiny_hf_folder(tmp_path, "gqa")
    weights = folder / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])
    with pytest.raises(ModelLoadError) as err:
        LLM(model=str(folder), skip_tokenizer_init=True)
    assert_one_line(err, "model.safetensors", "re-download")


def test_folder_without_weights(tmp_path: Path) -> None:
    folder = make_tiny_hf_folder(tmp_path, "gqa")
    (folder / "model.safetensors").unlink()
    with pytest.raises(ModelLoadError) as err:
        LLM(model=str(folder), skip_tokenizer_init=True)
    assert_one_line(err, "model.safetensors")


def test_unsupported_architecture(tmp_path: Path) -> None:
    folder = make_tiny_hf_folder(tmp_path, "gqa")
    config = json.loads((folder / "config.json").read_text())
    config["architectures"] = ["GPT2LMHeadModel"]
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(UnsupportedModelError) as err:
        LLM(model=str(folder), skip_tokenizer_init=True)
    assert_one_line(err, "GPT2LMHeadModel", "LlamaForCausalLM")


def test_text_prompt_without_tokenizer(tiny_folder: Path) -> None:
    llm = LLM(model=str(tiny_folder), skip_tokenizer_init=True, kv_cache_memory="1MiB")
    with pytest.raises(InvalidRequestError) as err:
        llm.generate("hello")
    assert_one_line(err, "prompt_token_ids")
    assert_still_works(llm)


# -- the command line --------------------------------------------------------------------------


def test_cli_unknown_model_exits_2_with_one_stderr_line() -> None:
    src = str(Path(__file__).resolve().parents[2] / "src")
    env = os.environ | {"PYTHONPATH": os.pathsep.join(filter(None, [src, os.environ.get(
        "PYTHONPATH")]))}
    result = subprocess.run(
        [sys.executable, "-m", "kvstack", "generate", "--model", "nope", "--prompt", "hi"],
        capture_output=True, text=True, env=env, timeout=300, check=False,
    )
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr
    lines = result.stderr.splitlines()
    assert len(lines) == 1, result.stderr
    assert "nope" in lines[0]
    assert result.stdout == ""
