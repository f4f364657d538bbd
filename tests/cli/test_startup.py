"""`kvstack --help` and every subcommand's --help answer without importing torch or
transformers (seconds of start-up that a help text does not need)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

SRC = str(Path(__file__).resolve().parents[2] / "src")
HEAVY = ("torch", "transformers", "fastapi", "faiss", "sentence_transformers")

SCRIPT = f"""
HEAVY = {HEAVY!r}
import contextlib, io, json, sys
from kvstack.cli.main import build_parser, main
commands = [[]] + [[name] for name in build_parser()._subparsers._group_actions[0].choices]
loaded = {{}}
for argv in commands:
    with contextlib.redirect_stdout(io.StringIO()):
        code = main([*argv, "--help"])
    assert code == 0, (argv, code)
    loaded[" ".join(argv) or "kvstack"] = sorted(m for m in HEAVY if m in sys.modules)
print(json.dumps(loaded))
"""


def test_help_imports_no_heavy_library() -> None:
    done = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True,
                          timeout=120, env={"PYTHONPATH": SRC, "PATH": ""})
    assert done.returncode == 0, done.stderr
    loaded = json.loads(done.stdout.strip().splitlines()[-1])
    assert set(loaded) >= {"kvstack", "bench", "eval", "serve", "generate", "chat", "demo"}
    assert all(not heavy for heavy in loaded.values()), loaded
