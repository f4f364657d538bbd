"""`kvstack bench long_decode`: our engine per KV dtype against llama-bench (a stand-in script
here: the real one prefills 16k tokens) on a tiny Gemma 3 GGUF, --quick; the ratio, the bytes
per part and the llama-bench command and parsing. Timings are never asserted."""

from __future__ import annotations

import json
import shlex
import stat
import sys
from pathlib import Path

import pytest
import torch
from gguf import GGMLQuantizationType as QType
from helpers.tiny_gemma3 import make_tiny_gemma3_folder, write_tiny_gemma3_gguf

from kvstack.bench import decode_bytes, long_decode
from kvstack.bench.peers import llama_bench
from kvstack.cli.main import main
from kvstack.errors import InvalidRequestError

FAKE = """import json, sys
args = sys.argv[1:]
with open({log!r}, "a") as f:
    f.write(" ".join(args) + "\\n")
if {fail}:
    sys.stderr.write("error: failed to load model\\n")
    sys.exit(1)
depth, gen = int(args[args.index("-d") + 1]), int(args[args.index("-n") + 1])
print(json.dumps([{{"n_prompt": 0, "n_gen": gen, "n_depth": depth, "type_k": "f16",
                   "type_v": "f16", "flash_attn": "auto", "build_commit": "fake",
                   "samples_ts": [10.0, 12.0]}}]))
"""


def fake_llama_bench(folder: Path, fail: bool = False) -> tuple[Path, Path]:
    log = folder / "argv.txt"
    script = folder / "llama_bench_fake.py"
    script.write_text(FAKE.format(log=str(log), fail=fail))
    # A shell wrapper, not a `#!python` line: a shebang cannot hold a path with spaces.
    path = folder / "llama-bench"
    python, fake = shlex.quote(sys.executable), shlex.quote(str(script))
    path.write_text(f'#!/bin/sh\nexec {python} {fake} "$@"\n')
    path.chmod(path.stat().st_mode | stat.S_IEXEC)
    return path, log


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = make_tiny_gemma3_folder(tmp_path_factory.mktemp("long-decode"), "mqa")
    return write_tiny_gemma3_gguf(folder / "tiny.gguf", folder, QType.Q8_0)


def test_kv_read_bytes_counts_full_layers_whole_and_sliding_ones_to_their_window() -> None:
    # 2 kv heads x 64 dims, K and V: float32 1,024 bytes per token and layer; int8 codes and a
    # float16 scale per (token, head): 2 x 2 x 66 = 264.
    windows = (None, 8, 8, None)
    assert decode_bytes.kv_read_bytes(windows, 2, 64, "float32", 100) == (100 + 8 + 8 + 100) * 1024
    assert decode_bytes.kv_read_bytes(windows, 2, 64, "int8", 100) == 216 * 264
    assert decode_bytes.kv_read_bytes(windows, 2, 64, "float16", 5) == 4 * 5 * 512


def test_llama_bench_command_and_its_errors(tmp_path: Path, tiny_gguf: Path) -> None:
    binary, log = fake_llama_bench(tmp_path)
    got = llama_bench.run(binary, tiny_gguf, 300, 16, 2, 3)
    assert got.tokens_per_s == [10.0, 12.0] and got.depth == 300 and got.new_tokens == 16
    assert log.read_text().split() == ["-m", str(tiny_gguf), "-t", "2", "-p", "0", "-n", "16",
                                       "-d", "300", "-r", "3", "-o", "json"]
    with pytest.raises(llama_bench.LlamaBenchError, match="no decode test at depth 5"):
        llama_bench.parse(json.dumps([{"n_depth": 300, "n_gen": 16, "samples_ts": [1.0]}]), 5)
    with pytest.raises(llama_bench.LlamaBenchError, match="no JSON"):
        llama_bench.parse("llama-bench: error", 5)
    failing, _ = fake_llama_bench(tmp_path / ".." / tmp_path.name, fail=True)
    with pytest.raises(llama_bench.LlamaBenchError, match="exited 1: error: failed to load"):
        llama_bench.run(failing, tiny_gguf, 300, 16, 2, 1)


def test_quick_run_reports_ratio_and_bytes_per_part(
        tiny_gguf: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    binary, log = fake_llama_bench(tmp_path)
    monkeypatch.setattr(llama_bench, "llama_bench_binary", lambda: binary)
    before = torch.get_num_threads()
    try:
        code = main(["bench", "long_decode", "--quick", "--model", str(tiny_gguf),
                     "--quantization", "gguf", "--threads", "1", "--out", str(tmp_path / "out"),
                     "--no-progress"])
    finally:
        torch.set_num_threads(before)
    assert code == 0
    summary = capsys.readouterr().out.strip().splitlines()
    assert len(summary) == 1 and summary[0].startswith("long_decode: ")
    data = json.loads((tmp_path / "out" / "long_decode.json").read_text())
    per = data["results"]["contexts"]["96"]
    assert per["llamacpp"]["tokens_per_s"] == 12.0  # the better of its repetitions
    assert "-d 96" in log.read_text()
    head, weights = decode_bytes.gguf_head_and_weights(tiny_gguf)
    f32, i8 = per["kvstack_auto"], per["kvstack_int8"]
    assert (f32["kv_dtype"], i8["kv_dtype"]) == ("float32", "int8")
    for e in (f32, i8):
        assert e["tokens_per_s"] > 0 and e["over_llamacpp"] == e["tokens_per_s"] / 12.0
        assert e["bytes_per_step"]["head"] == head  # Q8_0 blocks as held: the file's bytes
        assert e["bytes_per_step"]["weights"] == weights
        parts = e["seconds_per_step"]
        assert parts["head"] > 0 and parts["attention"] > 0
        assert 0 < e["share_of_probe"] < 1
    # read from a GGUF, the tiny model's layers are llama.cpp's Gemma 3 pattern: 5 sliding
    # layers read their window of 8 positions, the full one all 96
    positions = 96 + 5 * 8
    assert f32["bytes_per_step"]["kv"] == positions * 2 * 64 * 4
    assert i8["bytes_per_step"]["kv"] == positions * 2 * (64 + 2)
    assert per["llamacpp"]["bytes_per_step"]["kv"] == positions * 2 * 64 * 2


def test_contexts_the_model_holds_else_its_longest() -> None:
    full = long_decode.sizes(quick=False)
    assert long_decode._contexts(full, 32768) == [16384]  # 32,768 + 64 new tokens do not fit
    assert long_decode._contexts(full, 131072) == [16384, 32768]
    assert long_decode._contexts(full, 8192) == [8192 - 64]  # SmolLM2
    with pytest.raises(InvalidRequestError, match="--quick"):
        long_decode._contexts(full, 2048)
