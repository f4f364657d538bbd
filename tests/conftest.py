"""Shared fixtures. The embedded model is parsed once per session (GGUF parsing takes seconds)."""

from __future__ import annotations

import os
import shutil
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers.tiny_models import make_tiny_hf_folder

import kvstack.engine.builder as engine_module
from kvstack.bench.peers import transformers_model
from kvstack.kernels import isa
from kvstack.weights import Checkpoint, load_checkpoint

EMBEDDED = "smollm2-135m"
_checkpoints: dict[tuple[str, bool], Checkpoint] = {}


def cached_checkpoint(model: str, quantization: str | None = None) -> Checkpoint:
    """load_checkpoint, memoized: engines never modify checkpoint tensors in place. Only
    quantization="gguf" loads differently (weights kept as GGUF blocks)."""
    key = (model, quantization == "gguf")
    if key not in _checkpoints:
        _checkpoints[key] = load_checkpoint(model, "gguf" if key[1] else None)
    return _checkpoints[key]


@pytest.fixture(scope="session", autouse=True)
def _share_checkpoints() -> Iterator[None]:
    patch = pytest.MonkeyPatch()
    patch.setattr(engine_module, "load_checkpoint", cached_checkpoint)
    yield
    patch.undo()


@pytest.fixture(scope="module", autouse=True)
def _module_closes_its_tier_writers() -> Iterator[None]:
    """Every engine a module opens is closed by its end: a tier writer thread left running
    is a leaked engine (and it would fail a later module's stricter per-test check instead)."""
    before = set(threading.enumerate())
    yield
    left = [t for t in threading.enumerate()
            if t.name == "kvstack-kv-writer" and t not in before]
    assert not left, f"{len(left)} KV tier writer thread(s) outlived this module"


@pytest.fixture(scope="module")
def one_torch_thread() -> Iterator[None]:
    """One torch thread for a module: steadier than two on a busy 2-core machine, and a fixed
    BLAS reduction order; the next module gets its thread count back."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _kernel_isas() -> list[str]:
    """The C kernels' implementations to test, best first: each this machine builds and runs,
    or only the one KVSTACK_KERNELS names; none with it 0 or without a compiler (tests taking
    `kernel_isa` are then skipped)."""
    wanted = isa.requested(os.environ.get(isa.ENV, ""))
    if wanted is None or shutil.which(os.environ.get("CC", "cc")) is None:
        return []
    return [name for name in isa.runnable() if wanted in ("best", name)]


@pytest.fixture(scope="module", params=_kernel_isas())
def kernel_isa(request: pytest.FixtureRequest) -> Iterator[str]:
    """Tests (and module fixtures) taking this run once per C-kernel implementation the CPU
    executes (AVX-512 and AVX2 on an AVX-512 CPU), with KVSTACK_KERNELS forcing it."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(isa.ENV, request.param)
        yield request.param


@pytest.fixture(scope="session")
def embedded_checkpoint() -> Checkpoint:
    return cached_checkpoint(EMBEDDED)


@pytest.fixture(scope="session")
def hf_embedded(embedded_checkpoint: Checkpoint) -> Any:
    return transformers_model(embedded_checkpoint)


@pytest.fixture(scope="session")
def tiny4(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 4-layer tiny random model for blending (its check layer needs layers after it)."""
    return make_tiny_hf_folder(tmp_path_factory.mktemp("blend"), "gqa", num_hidden_layers=4,
                               max_position_embeddings=512)
