"""load_checkpoint(..., "gguf"): linear weights kept as the file's blocks, rows in HF order."""

from __future__ import annotations

from pathlib import Path

import pytest
from gguf import GGMLQuantizationType as QType
from helpers.tiny_models import make_tiny_hf_folder, write_tiny_gguf

from kvstack.weights import load_checkpoint


@pytest.mark.parametrize(("variant", "qtype"), [("gqa", QType.Q4_1), ("qkv_bias", QType.Q8_0),
                                                ("tied", QType.Q4_K)],
                         ids=lambda x: getattr(x, "name", x))
def test_blocks_dequantize_to_the_plain_loaders_tensors(tmp_path: Path, variant: str,
                                                        qtype: QType) -> None:
    path = str(write_tiny_gguf(tmp_path / "t.gguf", make_tiny_hf_folder(tmp_path, variant),
                               qtype))
    plain = load_checkpoint(path)
    kept = load_checkpoint(path, "gguf")
    assert not set(kept.tensors) & set(kept.blocks)
    assert set(kept.tensors) | set(kept.blocks) == set(plain.tensors)
    assert all(t.dim() == 1 for t in kept.tensors.values())  # norms and biases only
    for name, lin in kept.blocks.items():
        assert lin.qtype == qtype and lin.kernel is None  # the model picks kernels
        # Q/K rows moved back to HF order as whole blocks: bit-equal to the dequantized ones.
        assert lin.dequantize().equal(plain.tensors[name]), name
    assert kept.fingerprint == plain.fingerprint


def test_plain_checkpoints_keep_no_blocks(tmp_path: Path) -> None:
    folder = make_tiny_hf_folder(tmp_path, "gqa")
    path = write_tiny_gguf(tmp_path / "t.gguf", folder, QType.Q8_0)
    assert load_checkpoint(str(path)).blocks == {}
